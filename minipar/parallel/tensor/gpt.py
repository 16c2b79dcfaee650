"""The tiny GPT built from tensor-parallel layers: ``nn.GPT`` module by module, same names.

Each parameter is this rank's slice of the serial parameter of the same name:

    embed.wte       VocabParallelEmbedding   rows (vocabulary) split; g sums
    blocks.i.attn   ParallelSelfAttention    c_attn by heads (column, stride 3), c_proj row
    blocks.i.mlp    ParallelMLP              c_fc column, c_proj row
    lm_head         ColumnParallelLinear     vocabulary rows split: logits stay split, and the
                                             loss is vocab_parallel_cross_entropy
    embed.wpe, ln_*, row biases              replicated

    model = shard_from_serial(serial_gpt, group)    # or TensorParallelGPT(config, group)
    local_logits, loss = model(ids, targets)        # logits: this rank's V/p; loss: whole
    loss.backward(); model.finalize_grads()         # sequence parallelism's extra sum
"""
from ... import nn, random
from ...distributed.sharded import ShardedStateDict
from ...nn import Module, Sequential
from ..context.gpt import local_positions, loss_share
from ..context.ring import ring_attention
from .embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, dropout_layer
from .mappings import allreduce_replicated_grads
from .shard import copy_serial_slices, divide


class ParallelGPTEmbedding(ShardedStateDict, Module):
    """nn.GPTEmbedding with a vocab-parallel token table. Under sequence parallelism the sum is
    a reduce-scatter, and each rank adds the positions of its own T slice. Under context
    parallelism (``context``: the cp group) the ids are this rank's chunks of each sequence,
    and so are the positions (the slice of sequence parallelism is then one of those)."""

    def __init__(self, config, group, sequence_parallel=False, context=None):
        super().__init__()
        self.block_size = config.block_size
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.context = context
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group,
                                          sequence_parallel)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        # under sequence parallelism: the serial model's mask, this rank's T slice of it
        self.drop = dropout_layer(config.dropout, group, sequence_parallel)

    def forward(self, ids):
        T = ids.shape[-1]
        whole = T * (self.context.size if self.context is not None else 1)
        if whole > self.block_size:
            raise ValueError(f"sequence of length {whole} is longer than "
                             f"block_size={self.block_size}")
        pos = local_positions(T, self.context)
        if self.sequence_parallel:
            n = divide(T, self.group.size, "sequence length")
            pos = pos[self.group.rank * n:(self.group.rank + 1) * n]
        return self.drop(self.wte(ids) + self.wpe(pos))


class ParallelBlock(ShardedStateDict, Module):
    """nn.Block with parallel attention and MLP: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, n_embd, n_head, group, dropout=0.0, sequence_parallel=False, mlp=None,
                 context=None, attention=ring_attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = ParallelSelfAttention(n_embd, n_head, group, dropout, sequence_parallel,
                                          context=context, attention=attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        if mlp is None:  # a mixture of experts passes its own (tensor/moe.py)
            mlp = ParallelMLP(n_embd, group, dropout, sequence_parallel=sequence_parallel)
        self.mlp = mlp

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def check_config(config, tp):
    """Every shape the tensor group splits must divide by tp; one clear error, raised on every
    rank before any communication."""
    if config.tie_weights:
        raise ValueError("TensorParallelGPT does not tie lm_head to the token embedding "
                         "(tie_weights=False)")
    divide(config.n_embd, tp, "hidden size n_embd")
    divide(config.n_head, tp, "number of attention heads n_head")
    divide(config.vocab_size, tp, "vocabulary size")


class TensorParallelGPT(ShardedStateDict, Module):
    """``local_logits, loss = model(ids, targets)``: nn.GPT over the tensor group ``group``.
    ``local_logits`` is this rank's vocabulary slice (B, T, V/p). ``loss`` is the same number
    on every rank.

    ``TensorParallelGPT(config, group)`` holds the slices of ``serial_twin()`` (``nn.GPT(config)``
    drawn with the same seed), and leaves the random stream where the serial model does; pass
    ``serial`` to slice a model already built instead. With ``context`` (a cp group) ids and
    targets are this rank's chunks of each sequence (``split_sequence``), attention is the ring,
    and ``loss`` is this rank's share of the whole sequences' mean (context/gpt.py).
    """

    def __init__(self, config, group, sequence_parallel=False, serial=None, context=None,
                 attention=ring_attention):
        super().__init__()
        check_config(config, group.size)
        self.config = config
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.context = context if context is not None and context.size > 1 else None
        self.attention = attention  # over the cp group: ring_attention or ulysses_attention
        # Megatron's CPU initialisation: every rank draws the whole serial model from the same
        # seed (the only draws the stream keeps) and keeps its slices of it.
        if serial is None:
            serial = self.serial_twin()
        with random.fork_rng():  # the layers' own draws are overwritten by the slices below
            self.embed = ParallelGPTEmbedding(config, group, sequence_parallel, self.context)
            self.blocks = Sequential(*[self.block() for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, group,
                                                bias=False, sequence_parallel=sequence_parallel)
        self.astype(serial.lm_head.weight.dtype)
        copy_serial_slices(self, serial, group, self.serial_twin_names())
        for name, module in self.named_modules():  # accounting labels: "blocks.0.attn.c_proj"
            if hasattr(module, "where"):
                module.where = name

    def serial_twin(self):
        """The serial model this one is a slice of, drawn from the random stream."""
        return nn.GPT(self.config)

    def block(self):
        """One transformer block over the tensor group."""
        return ParallelBlock(self.config.n_embd, self.config.n_head, self.group,
                             self.config.dropout, self.sequence_parallel, context=self.context,
                             attention=self.attention)

    def serial_twin_names(self):
        """{parameter name: the serial twin's name} where they differ (None: nowhere)."""
        return None

    def to_sequential(self):
        """embed, blocks, ln_f and lm_head as one Sequential from ids to this rank's logit slice,
        for pipelines: a stage is a slice of it, the last stage's loss is ``model.loss``, and
        ``copy_serial_slices(stage, serial.to_sequential()[i:j], group)`` loads a stage."""
        return Sequential(self.embed, *self.blocks, self.ln_f, self.lm_head)

    def loss(self, local_logits, targets):
        loss = vocab_parallel_cross_entropy(local_logits, targets, self.group)
        if self.context is None:
            return loss
        # the mean of this rank's tokens, weighted so the average over cp is the whole mean
        return loss * loss_share(targets, self.context).astype(loss.dtype)

    def forward(self, ids, targets=None):
        logits = self.lm_head(self.ln_f(self.blocks(self.embed(ids))))
        return logits, None if targets is None else self.loss(logits, targets)

    def finalize_grads(self):
        """Under sequence parallelism, all-reduce the replicated parameters' partial gradients
        over the tensor group (a no-op otherwise), as Megatron's ``finalize_model_grads`` does.
        Call after backward, before the optimizer."""
        # The LayerNorms, wpe and row biases saw only this rank's T/p tokens: partial sums.
        if self.sequence_parallel:
            allreduce_replicated_grads(self, self.group)


def shard_from_serial(serial, group, sequence_parallel=False):
    """A TensorParallelGPT holding this rank's slices of the serial ``nn.GPT`` ``serial``."""
    return TensorParallelGPT(serial.config, group, sequence_parallel, serial=serial)
