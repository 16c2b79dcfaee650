"""The vocabulary split over the tensor group: the token table going in, the loss coming out.

Rank i holds the rows of tokens [i·V/p, (i+1)·V/p) of the token table and of lm_head (why the
logits are never gathered: docs/tensor_parallel.md):

    VocabParallelEmbedding         a token's row lives on one rank; g sums it into every rank
    vocab_parallel_cross_entropy   the loss from each rank's V/p logits: three numbers per
                                   token all-reduced (max, sum of exponentials, target logit)
"""
from ... import backend, nn, ops
from ... import functional as F
from ...amp.autocast_mode import to_float32
from ...autograd import Tensor, as_tensor, embedding, make_result
from ...distributed.sharded import ShardedStateDict
from ...nn import Module, Parameter
from .mappings import logged, reduce_from_tensor_region, reduce_scatter_to_sequence_region
from .shard import divide, shard


class VocabParallelEmbedding(ShardedStateDict, Module):
    """nn.Embedding split by vocabulary. Rank i holds rows [i·V/p, (i+1)·V/p). A token outside
    that range gets a zero vector, so g's sum (or a reduce-scatter of T under sequence
    parallelism) gives every token its one owner's row."""

    def __init__(self, num_embeddings, embedding_dim, group, sequence_parallel=False,
                 dtype="float32"):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.per_rank = divide(num_embeddings, group.size, "vocabulary size")
        self.vocab_start = group.rank * self.per_rank
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.where = "embedding"
        full = nn.Embedding(num_embeddings, embedding_dim, dtype)
        self.weight = Parameter(shard(full.weight.data, 0, group.rank, group.size))
        self.tp_split = {"weight": (0, 1)}

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        ids = ids if backend.is_gpu_array(ids) else backend.numpy.asarray(ids)
        # checked before they go to the device (host ids for free, device ids under MINIPAR_DEBUG)
        ops.check_ids(ids, self.num_embeddings, values=backend.check_values(ids))
        ids = backend.asarray(ids)
        xp = backend.get_array_module(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.per_rank)
        rows = embedding(self.weight, xp.where(mine, local, 0))
        rows = rows * mine[..., None].astype(rows.dtype)
        leave = reduce_scatter_to_sequence_region if self.sequence_parallel \
            else reduce_from_tensor_region
        return leave(rows, self.group, self.where)


def vocab_parallel_cross_entropy(local_logits, targets, group, where="loss", ignore_index=-100):
    """Mean cross-entropy from each rank's vocabulary slice of the logits, none gathered.

    With z the logits of one token and M = max_v z_v:
        loss = log Σ_v exp(z_v − M) − (z_target − M)
    Three all-reduces of one number per token give it: the max (op max), the sum of exponentials,
    and the target's shifted logit (only its owner contributes a non-zero). The backward pass
    needs no communication: d loss/d z_v = (softmax(z)_v − [v = target]) / n on each local slice.
    Targets as ``functional.cross_entropy`` takes them: integers in [0, V) for the global V, or
    ``ignore_index``: such tokens are left out of the mean (n counts the others; 0 if none is
    left) and get a zero gradient. Every rank holds the same targets, so a bad one is the same
    error on every rank, before any collective.
    """
    # under autocast in float32, as functional.cross_entropy (torch's float32 list): the three
    # all-reduces then move float32 numbers, one each per token
    logits = to_float32(as_tensor(local_logits))
    given = targets.data if isinstance(targets, Tensor) else targets
    t = given if isinstance(targets, Tensor) else backend.asarray(given)
    if t.dtype.kind not in "iu":
        raise TypeError(f"vocab_parallel_cross_entropy: targets must hold integer class indices, "
                        f"got {t.dtype}")
    if logits.shape[:-1] != t.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits of shape {logits.shape} need "
                         f"targets of shape {logits.shape[:-1]}, got {t.shape}")
    xp = backend.get_array_module(logits.data)
    v_local = logits.shape[-1]
    vocab = v_local * group.size
    z = logits.data.reshape(-1, v_local)
    t, keep = F.kept_targets(t, vocab, ignore_index, "vocab_parallel_cross_entropy", given)
    local_t = t - group.rank * v_local
    mine = keep & (local_t >= 0) & (local_t < v_local)
    local_t = xp.where(mine, local_t, 0)
    rows = xp.arange(z.shape[0])
    group = logged(group, where, "forward")  # recorded while a CollectiveLog is open
    ### BEGIN SOLUTION vocab-cross-entropy
    z = z - group.all_reduce(z.max(axis=-1), op="max")[:, None]
    e = xp.exp(z)
    total = group.all_reduce(e.sum(axis=-1))
    z_target = group.all_reduce(z[rows, local_t] * mine)
    ### END SOLUTION
    n = xp.maximum(keep.sum(), 1).astype(z.dtype)  # on the device: no host read
    loss = ((xp.log(total) - z_target) * keep).sum() / n

    def backward(g):
        grad = e / total[:, None]
        grad[rows, local_t] -= mine
        grad *= keep[:, None]
        grad *= g / n
        return (grad.reshape(logits.shape),)

    return make_result(xp.asarray(loss, dtype=logits.dtype), (logits,), backward,
                       "vocab_parallel_cross_entropy")
