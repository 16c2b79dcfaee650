"""The parallel layers: a linear layer Y = X Aᵀ split by its output rows or its input columns.

    column parallel   A's output rows split: rank i holds A_i and computes Y_i = X A_iᵀ
    row parallel      A's input columns split: rank i holds A_i and X_i; Y = Σ_i X_i A_iᵀ

The MLP and attention are a column-parallel layer followed by a row-parallel one (why:
docs/tensor_parallel.md). Each layer draws its serial twin's weight whole and keeps its slice
(shard.py), and enters and leaves the parallel region through mappings.py's operators.

    fc = ColumnParallelLinear(C, 4 * C, group)    # with the same seed: nn.Linear(C, 4 * C)'s rows
"""
from ... import backend, nn
from ... import functional as F
from ...autograd import Tensor
from ...distributed.sharded import ShardedStateDict
from ...nn import Module, Parameter
from ..context.ring import ring_attention
from .mappings import (copy_to_tensor_region, gather_from_sequence_region,
                       gather_from_tensor_region, reduce_from_tensor_region,
                       reduce_scatter_to_sequence_region, scatter_to_tensor_region)
from .shard import divide, shard


class ColumnParallelLinear(ShardedStateDict, Module):
    """Y_i = X A_iᵀ + b_i. Rank i holds out/p of the weight's rows (and of the bias). The input
    enters through f, or through an all-gather of T under sequence parallelism. The output stays
    split unless ``gather_output``. ``stride`` (Megatron's name) splits each of that many row
    blocks separately: 3 for a fused QKV weight, so a rank keeps q, k and v of the same heads."""

    def __init__(self, in_features, out_features, group, bias=True, gather_output=False,
                 stride=1, sequence_parallel=False, dtype="float32"):
        super().__init__()
        divide(out_features // stride, group.size, "output size")
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.where = "column"
        full = nn.Linear(in_features, out_features, bias, dtype)  # drawn whole on every rank
        self.weight = Parameter(shard(full.weight.data, 0, group.rank, group.size, stride))
        self.bias = Parameter(shard(full.bias.data, 0, group.rank, group.size, stride)) \
            if bias else None
        self.tp_split = {"weight": (0, stride), "bias": (0, stride)}

    def forward(self, x):
        enter = gather_from_sequence_region if self.sequence_parallel else copy_to_tensor_region
        y = F.linear(enter(x, self.group, self.where), self.weight, self.bias)
        return gather_from_tensor_region(y, self.group, self.where) if self.gather_output else y


class RowParallelLinear(ShardedStateDict, Module):
    """Y = Σ_i X_i A_iᵀ + b. Rank i holds in/p of the weight's columns and the input slice X_i
    (scattered first unless ``input_is_parallel``). The partial products are summed by g, or by a
    reduce-scatter of T under sequence parallelism. The bias is replicated and added once, after
    the sum."""

    def __init__(self, in_features, out_features, group, bias=True, input_is_parallel=True,
                 sequence_parallel=False, dtype="float32"):
        super().__init__()
        divide(in_features, group.size, "input size")
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.where = "row"
        full = nn.Linear(in_features, out_features, bias, dtype)
        self.weight = Parameter(shard(full.weight.data, 1, group.rank, group.size))
        self.bias = Parameter(full.bias.data) if bias else None
        self.tp_split = {"weight": (1, 1)}

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group, self.where)
        leave = reduce_scatter_to_sequence_region if self.sequence_parallel \
            else reduce_from_tensor_region
        y = leave(F.linear(x, self.weight), self.group, self.where)
        return y if self.bias is None else y + self.bias


class SequenceParallelDropout(Module):
    """Dropout on this rank's slice of a sequence split over ``group`` along ``axis``, with the
    serial model's mask: every rank draws the mask of the whole (``counts``: each rank's length,
    equal by default) from the shared stream and keeps its own slice. A mask of the slice alone
    would repeat on every rank (one stream), the same pattern in each 1/p of the sequence;
    Megatron forks a stream per tensor rank instead. The price: p times the random numbers."""

    def __init__(self, p, group, axis=1):
        super().__init__()
        self.p, self.group, self.axis = p, group, axis

    def forward(self, x, counts=None):
        if not self.training or self.p == 0:
            return x
        counts = counts or [x.shape[self.axis]] * self.group.size
        start = sum(counts[:self.group.rank])
        whole = list(x.shape)
        whole[self.axis] = sum(counts)
        ones = backend.get_array_module(x.data).ones(whole, x.dtype)
        mask = F.dropout(Tensor(ones), self.p, training=True).data  # the serial mask, whole
        index = [slice(None)] * x.ndim
        index[self.axis] = slice(start, start + x.shape[self.axis])
        return x * Tensor(mask[tuple(index)])


def dropout_layer(p, group, sequence_parallel):
    """nn.Dropout, or under sequence parallelism the serial mask's slice of T."""
    return SequenceParallelDropout(p, group) if sequence_parallel else nn.Dropout(p)


class ParallelMLP(ShardedStateDict, Module):
    """nn.MLP split: c_fc column-parallel -> GeLU on each rank's slice -> c_proj row-parallel.
    One all-reduce forward (g) and one backward (f). The GeLU is what decides the split: see
    docs/tensor_parallel.md."""

    def __init__(self, n_embd, group, dropout=0.0, hidden=None, sequence_parallel=False,
                 dtype="float32"):
        super().__init__()
        hidden = hidden or 4 * n_embd
        divide(hidden, group.size, "MLP hidden size")
        self.c_fc = ColumnParallelLinear(n_embd, hidden, group, sequence_parallel=sequence_parallel,
                                         dtype=dtype)
        self.gelu = nn.GELU()
        self.c_proj = RowParallelLinear(hidden, n_embd, group, sequence_parallel=sequence_parallel,
                                        dtype=dtype)
        self.dropout = dropout_layer(dropout, group, sequence_parallel)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class ParallelSelfAttention(ShardedStateDict, Module):
    """nn.CausalSelfAttention split by heads. Rank i owns H/p whole heads: its rows of q, k and v
    (c_attn column-parallel with stride 3) and the matching input columns of c_proj (row-parallel).
    Heads attend independently, so the only sum is c_proj's.

    Attention dropout draws this rank's mask for its own heads. That is correct training, but it
    is not the serial model's mask sliced, so equivalence with the serial model needs
    dropout = 0. Megatron keeps a separate random stream per tensor rank for this.

    With ``context`` (a cp group) x holds this rank's chunks of each sequence and its heads
    attend over the cp ranks by ``attention(q, k, v, context)``: ``ring_attention`` (the
    default; k/v blocks round the ring) or ``ulysses_attention`` (all-to-alls swap the sequence
    split for a split of this rank's H/tp heads, which cp must divide). tp splits the heads, cp
    the sequence. The layer holds the function as ``self.attention``, chosen once (Trainer3D's
    ``cp_comm``), so ``forward`` has no switch on it."""

    def __init__(self, n_embd, n_head, group, dropout=0.0, sequence_parallel=False,
                 dtype="float32", context=None, attention=ring_attention):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        if context is not None and context.size > 1 and dropout:
            raise ValueError(f"ParallelSelfAttention with context parallelism (cp = "
                             f"{context.size}) takes dropout = 0, got {dropout}: ring attention "
                             f"(and Ulysses) has no attention dropout")
        self.context = context if context is not None and context.size > 1 else None
        self.attention = attention  # over the cp group: ring_attention or ulysses_attention
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.p = dropout
        self.local_heads = divide(n_head, group.size, "number of attention heads")
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, group, stride=3,
                                           sequence_parallel=sequence_parallel, dtype=dtype)
        self.c_proj = RowParallelLinear(n_embd, n_embd, group, sequence_parallel=sequence_parallel,
                                        dtype=dtype)
        self.resid_dropout = dropout_layer(dropout, group, sequence_parallel)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3·H/p·d): [q, k, v] of this rank's heads
        B, T, _ = qkv.shape
        H, d = self.local_heads, self.head_dim
        qkv = qkv.reshape(B, T, 3, H, d).permute(2, 0, 3, 1, 4)  # (3, B, H/p, T, d)
        if self.context is not None:  # the other chunks' k/v by the ring, or heads by a2a
            y = self.attention(qkv[0], qkv[1], qkv[2], self.context)
        else:
            y = F.causal_self_attention(qkv[0], qkv[1], qkv[2], dropout_p=self.p,
                                        training=self.training)
        return self.resid_dropout(self.c_proj(y.permute(0, 2, 1, 3).reshape(B, T, H * d)))
