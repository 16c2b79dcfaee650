"""3D parallelism, data × tensor × pipeline, with context: Megatron's grid (Narayanan et al. 2021).

Each rank has coordinates (tp, cp, dp, pp) in the grid of ``groups.RankGrid`` and belongs to one
group of each kind; the strategies nest, each using only its own group. The gradients that reach
the optimizer are those of the mean loss over the whole global batch: the serial model's
(``tests/test_hybrid.py`` checks the losses step by step).

    groups = ParallelGroups(world, tp=2, cp=2, pp=2)    # dp = world.size / (tp·cp·pp)
    trainer = Trainer3D(config, groups, schedule="1f1b", microbatches=4, sequence_parallel=True)
    loss = trainer.step(ids, targets)                   # the global batch, the same on every rank

Checkpoints: the serial GPT's names and shapes, so a checkpoint of one (tp, pp) layout loads into
another or into the serial GPT (distributed/hybrid_state.py; docs/checkpoints.md). Sequence
parallelism: docs/tensor_parallel.md; context parallelism: docs/context_parallel.md.
"""
from .. import backend, random
from ..distributed.hybrid_state import Trainer3DState
from ..optim import AdamW
from .context.layout import split_sequence
from .context.ring import ring_attention
from .context.ulysses import head_splits, ulysses_attention
from .data.allreduce_optimizer import AllReduceOptimizer
from .pipeline.runtime import Pipeline
from .pipeline.schedules import build
from .tensor import TensorParallelGPT, check_config

# cp_comm: how attention reaches the other tokens of the cp group (Megatron's --cp-comm-type)
CP_ATTENTION = {"ring": ring_attention,    # k/v blocks round the ring, (cp − 1) steps
                "a2a": ulysses_attention}  # all-to-alls: all tokens of H/(tp·cp) heads a rank


def default_optimizer(params):
    """AdamW(lr=1e-3, no weight decay): the optimizer of both the 3D run and its serial twin."""
    return AdamW(params, lr=1e-3, weight_decay=0.0)


class SequenceParallelGrads:
    """A data-parallel optimizer (``reducer``) whose ``step`` first runs
    ``model.finalize_grads()``: the replicated parameters (LayerNorms, row biases, position
    table, router) saw only this tensor rank's 1/tp of the tokens under sequence parallelism,
    so their gradients are summed over the tensor group (Megatron's finalize_model_grads)."""

    def __init__(self, reducer, model):
        self.reducer, self.model = reducer, model
        self.optimizer = reducer.optimizer  # the AdamW itself: checkpoints read it here

    def step(self):
        self.model.finalize_grads()  # over tp; then the reducer's average over dp
        self.reducer.step()

    def zero_grad(self):
        self.reducer.zero_grad()


def cp_attention(cp_comm, n_head, tp, cp):
    """The attention function of ``cp_comm`` ("ring" or "a2a"), or a ValueError (the same on
    every rank: it reads only the config and the grid) naming the choices, or for "a2a" a head
    count per tensor rank that cp does not divide, with the cp sizes and head counts that fit."""
    if cp_comm not in CP_ATTENTION:
        raise ValueError(f"cp_comm={cp_comm!r} is not one of {sorted(CP_ATTENTION)}: \"ring\" "
                         f"(ring attention) or \"a2a\" (Ulysses all-to-alls)")
    heads = n_head // tp  # this tensor rank's heads (check_config: tp divides n_head)
    if cp_comm == "a2a" and cp > 1 and heads % cp:
        raise ValueError(f"cp_comm=\"a2a\": the n_head / tp = {n_head} / {tp} = {heads} heads of "
                         f"a tensor rank do not split over cp = {cp} ranks (Ulysses gives each "
                         f"cp rank whole heads): use cp in {head_splits(heads)}, or n_head a "
                         f"multiple of tp·cp = {tp * cp}, or cp_comm=\"ring\"")
    return CP_ATTENTION[cp_comm]


class Trainer3D:
    """The tiny GPT trained with data, tensor and pipeline parallelism at once.

    Every rank builds the serial ``nn.GPT(config)`` from ``seed`` and keeps its tensor slices
    (``TensorParallelGPT``); the pipeline keeps this rank's stages of them (equal numbers of
    layers: embedding, blocks, final LayerNorm, LM head). ``make_optimizer(params)`` defaults to
    AdamW(lr=1e-3, weight_decay=0), the same as a serial run would use. ``dtype="float16"``
    with ``scaler=GradScaler(group=world)`` trains in mixed precision with a loss scale (call
    ``step`` under ``minipar.amp.autocast``); the pipeline scales the loss and skips the step
    on every rank of the scaler's group when one finds an inf.

    With cp > 1 each rank holds two chunks of every sequence of its shard, and ``cp_comm``
    chooses how attention reaches the rest of the sequence over the cp group: ``"ring"`` (the
    default, ``ring_attention``: k/v blocks go round the ring) or ``"a2a"`` (Ulysses,
    ``ulysses_attention``: an all-to-all gives each rank the whole sequence of H/(tp·cp) of the
    heads, and one back returns its tokens; H/tp must be a multiple of cp). Both train to the
    serial GPT's numbers (tests/test_context_gpt.py, tests/test_ulysses_trainer.py); an unknown
    ``cp_comm`` or a head count cp does not divide is a ValueError on every rank, before any
    communication.
    """

    def __init__(self, config, groups, schedule="1f1b", microbatches=None, chunks=None,
                 make_optimizer=None, seed=0, dtype="float32", algorithm="auto", trace=False,
                 sequence_parallel=False, scaler=None, cp_comm="ring"):
        check_config(config, groups.grid.tp)
        self.cp_comm = cp_comm
        self.attention = cp_attention(cp_comm, config.n_head, groups.grid.tp, groups.grid.cp)
        self.sequence_parallel = sequence_parallel
        self.schedule = build(schedule, groups.grid.pp, microbatches or groups.grid.pp, chunks)
        layers = config.n_layer + 3  # embedding, blocks, ln_f, lm_head
        stages = self.schedule.n_stages  # pp x chunks (zb-v: always 2 chunks per rank)
        if layers < stages:
            raise ValueError(f"the GPT has {layers} pipeline layers (embedding, {config.n_layer} "
                             f"blocks, final LayerNorm, LM head), fewer than the {stages} stages "
                             f"of {schedule!r} on pp={groups.grid.pp}")
        self.config, self.groups = config, groups
        # context: each rank of the cp group holds two chunks of every sequence of its shard
        # (the balanced layout); attention is the ring over it, and each cp rank's gradients
        # are those of other tokens of the same samples, so they average over dp × cp
        cp = groups.grid.cp
        self.context = groups.context if cp > 1 else None
        self.gradients = groups.data_context if cp > 1 else groups.data
        random.manual_seed(seed)
        # tensor: the GPT's layers split over the tensor group (tensor/), two all-reduces per
        # transformer layer forward and two backward; under sequence parallelism each is an
        # all-gather of T and a reduce-scatter of T, and between them the activations, the
        # pipeline's messages included, are this rank's (B, T/tp, C) slice
        self.model = self.build_model(config, groups).astype(dtype)
        make_optimizer = make_optimizer or default_optimizer
        # pipeline: the split GPT's layers cut into pp stages, one per rank of the pipeline group,
        # run by the schedule: activations and their gradients move between neighbouring stages;
        # data: after the pipeline's last backward, each rank averages its gradients over the
        # data group (ranks holding the same slices of the same stages), then steps
        self.pipe = Pipeline(
            self.model.to_sequential(), self.schedule, groups.pipeline, self.model.loss,
            optimizer=lambda ps: self.finalizing(self.reducer(ps, make_optimizer, algorithm)),
            trace=trace, scaler=scaler)

    def build_model(self, config, groups):
        """This rank's tensor slices of the serial GPT drawn from the random stream."""
        return TensorParallelGPT(config, groups.tensor, self.sequence_parallel,
                                 context=self.context, attention=self.attention)

    def finalizing(self, reducer):
        """``reducer``, first summing over tp the gradients sequence parallelism left partial."""
        return SequenceParallelGrads(reducer, self.model) if self.sequence_parallel else reducer

    def reducer(self, params, make_optimizer, algorithm):
        """The optimizer of this rank's stages, stepping on gradients averaged over dp (× cp)."""
        return AllReduceOptimizer(params, make_optimizer, self.gradients, algorithm)

    def local_shard(self, array):
        """This rank's rows of the global batch, the dp-th of dp equal shards; with cp, its two
        chunks of each row (``split_sequence``: T a multiple of 2·cp, or a clear error)."""
        # rank (tp, dp, pp) takes the dp-th shard of N/dp sequences, the same for every tp and pp
        # coordinate; the pipeline splits it into m micro-batches
        dp = self.groups.grid.dp
        n = len(array)
        if n % dp:
            raise ValueError(f"the global batch of {n} sequences does not divide among the "
                             f"{dp} data-parallel ranks")
        i = self.groups.coords["dp"]
        rows = array[i * n // dp:(i + 1) * n // dp]
        return rows if self.context is None else split_sequence(rows, self.context, dim=1)

    def step(self, ids, targets):
        """One training step on the global batch (the same arrays on every rank). Returns the
        global mean loss on every rank, a 0-d float64 array on the device (``float(loss)``
        reads it; on NumPy it already is a float)."""
        loss = self.pipe.step(self.local_shard(ids), self.local_shard(targets))
        last = self.schedule.rank_of(self.schedule.n_stages - 1)  # pp - 1; 0 in zb-v's V
        # the loss lives on the last stage: average it over the data group (× cp: each rank's
        # share of its sequences' mean, context/gpt.py), hand it to everyone
        value = backend.xp().zeros(1, dtype="float64")
        if loss is not None:
            value[0] = loss  # device to device: no host read
        if self.groups.pipeline.rank == last:
            self.gradients.all_reduce(value, op="avg", algorithm="mpi", out=value)
        self.groups.pipeline.broadcast(value, root=last, out=value)
        return value[0]

    # --- checkpoints: the serial GPT's names and shapes (distributed/hybrid_state.py) --------
    state_adapter = Trainer3DState

    def state_dict(self):
        """{"model": {name: sharded}, "optimizer": {"state": {name: {...}}, "hyperparameters"}}
        with the serial GPT's names: this rank's slices of its stages."""
        return self.state_adapter(self).state_dict()

    def load_state_dict(self, state_dict):
        """Load whole (serial) arrays; every problem is named before anything changes."""
        self.state_adapter(self).load_state_dict(state_dict)
