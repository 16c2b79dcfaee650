"""The tiny GPT built from tensor-parallel layers, and its serial twin.

``TensorParallelGPT`` mirrors ``nn.GPT`` module by module. The names are the same
(embed.wte, blocks.0.attn.c_attn, ..., lm_head), so each parameter is this rank's slice of the
serial parameter with the same name:

    embed.wte       VocabParallelEmbedding   rows (vocabulary) split; g sums
    blocks.i.attn   ParallelSelfAttention    c_attn by heads (column, stride 3), c_proj row
    blocks.i.mlp    ParallelMLP              c_fc column, c_proj row
    lm_head         ColumnParallelLinear     vocabulary rows split: logits stay split, and the
                                             loss is vocab_parallel_cross_entropy
    embed.wpe, ln_*, row biases              replicated

Sequence parallelism (``sequence_parallel=True``) keeps the residual stream split along T:
(B, T/p, C) on each rank. Every all-reduce becomes a reduce-scatter or an all-gather. The
replicated parameters (LayerNorms, wpe, row biases) then see only their rank's tokens, so their
gradients are partial sums: ``finalize_grads()`` all-reduces them over the tensor group after
backward, as Megatron's ``finalize_model_grads`` does. One simplification remains: every rank draws
dropout masks from the one shared stream. Under sequence parallelism the ranks' token slices
therefore get the same mask pattern, and attention dropout is not the serial mask sliced.
Megatron keeps a separate stream per tensor rank for these. The equality tests use dropout 0.

The serial twin: ``shard_from_serial(gpt, group)`` gives the parallel model of a serial one.
``local_slices`` cuts serial arrays (weights, gradients) into this rank's slices for comparison.
``gather_to_serial`` all-gathers the whole arrays back.

For pipelines: ``to_sequential()`` gives embed, blocks, ln_f and lm_head as one Sequential that
maps ids to this rank's logit slice. A stage is a slice of it. The last stage's loss is
``model.loss(local_logits, targets)``. ``copy_serial_slices(stage, serial_stage, group)`` loads
a stage from the same slice of the serial ``GPT.to_sequential()``.
"""
from ... import backend, nn, random
from ...nn import Module, Sequential
from .embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention
from .mappings import allreduce_replicated_grads
from .shard import divide, shard, split_specs, unshard


class ParallelGPTEmbedding(Module):
    """nn.GPTEmbedding with a vocab-parallel token table. Under sequence parallelism the sum is
    a reduce-scatter, and each rank adds the positions of its own T slice."""

    def __init__(self, config, group, sequence_parallel=False):
        super().__init__()
        self.block_size, self.group, self.sequence_parallel = config.block_size, group, \
            sequence_parallel
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group,
                                          sequence_parallel)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, ids):
        T = ids.shape[-1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}")
        pos = backend.xp().arange(T)
        if self.sequence_parallel:
            n = divide(T, self.group.size, "sequence length")
            pos = pos[self.group.rank * n:(self.group.rank + 1) * n]
        return self.drop(self.wte(ids) + self.wpe(pos))


class ParallelBlock(Module):
    """nn.Block with parallel attention and MLP: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, n_embd, n_head, group, dropout=0.0, sequence_parallel=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = ParallelSelfAttention(n_embd, n_head, group, dropout, sequence_parallel)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = ParallelMLP(n_embd, group, dropout, sequence_parallel=sequence_parallel)

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


class TensorParallelGPT(Module):
    """``local_logits, loss = model(ids, targets)``: nn.GPT over the tensor group ``group``.
    ``local_logits`` is this rank's vocabulary slice (B, T, V/p). ``loss`` is the same number
    on every rank.

    With the same seed, ``TensorParallelGPT(config, group)`` holds the slices of
    ``nn.GPT(config)``, and the random stream afterwards is where the serial model leaves it.
    Every rank builds the serial model and keeps its slices (Megatron's CPU initialisation).
    """

    def __init__(self, config, group, sequence_parallel=False):
        super().__init__()
        check_config(config, group.size)
        self.config, self.group, self.sequence_parallel = config, group, sequence_parallel
        serial = nn.GPT(config)
        with random.fork_rng():  # the layers' own draws are overwritten below
            self.embed = ParallelGPTEmbedding(config, group, sequence_parallel)
            self.blocks = Sequential(*[ParallelBlock(config.n_embd, config.n_head, group,
                                                     config.dropout, sequence_parallel)
                                       for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, group,
                                                bias=False, sequence_parallel=sequence_parallel)
        copy_serial_slices(self, serial, group)
        for name, module in self.named_modules():  # accounting labels: "blocks.0.attn.c_proj"
            if hasattr(module, "where"):
                module.where = name

    def to_sequential(self):
        return Sequential(self.embed, *self.blocks, self.ln_f, self.lm_head)

    def loss(self, local_logits, targets):
        return vocab_parallel_cross_entropy(local_logits, targets, self.group)

    def forward(self, ids, targets=None):
        logits = self.lm_head(self.ln_f(self.blocks(self.embed(ids))))
        return logits, None if targets is None else self.loss(logits, targets)

    def finalize_grads(self):
        """Under sequence parallelism, all-reduce the replicated parameters' partial gradients
        over the tensor group (a no-op otherwise). Call after backward, before the optimizer."""
        if self.sequence_parallel:
            allreduce_replicated_grads(self, self.group)


# ----------------------------------------------------------------------------------------------
# The serial twin: slices in, whole arrays out
# ----------------------------------------------------------------------------------------------

def local_slices(parallel, full_arrays, group):
    """{name: this rank's slice} of serial arrays named as ``parallel``'s parameters (weights or
    gradients); replicated parameters keep the whole array."""
    specs, out = split_specs(parallel), {}
    for name, _ in parallel.named_parameters():
        axis, stride = specs.get(name, (None, 1))
        full = full_arrays[name]
        out[name] = full if axis is None else shard(full, axis, group.rank, group.size, stride)
    return out


def copy_serial_slices(parallel, serial, group):
    """Load each parameter of ``parallel`` with its slice of the same-named parameter of the
    mirrored ``serial`` module (a layer, a GPT, or a pipeline stage of one)."""
    full = {name: p.data for name, p in serial.named_parameters()}
    missing = [name for name, _ in parallel.named_parameters() if name not in full]
    if missing:
        raise KeyError(f"the serial module has no parameters {missing}: the two module trees "
                       f"must mirror each other")
    parts = local_slices(parallel, full, group)
    for name, p in parallel.named_parameters():
        p.data[...] = backend.get_array_module(p.data).asarray(parts[name], dtype=p.dtype)
    return parallel


def gather_to_serial(parallel, group, grads=False):
    """{name: full NumPy array} of every parameter (or gradient): the serial twin's values.
    Collective over ``group``: all-gathers the split ones."""
    specs, out = split_specs(parallel), {}
    for name, p in parallel.named_parameters():
        value = p.grad if grads else p.data
        if name in specs:
            parts = group.all_gather(backend.get_array_module(value).ascontiguousarray(value))
            value = unshard(parts, *specs[name])
        out[name] = backend.to_numpy(value)
    return out


def shard_from_serial(serial, group, sequence_parallel=False):
    """A TensorParallelGPT holding this rank's slices of the serial ``nn.GPT`` ``serial``."""
    with random.fork_rng():
        model = TensorParallelGPT(serial.config, group, sequence_parallel)
    model.astype(serial.lm_head.weight.dtype)
    return copy_serial_slices(model, serial, group)
