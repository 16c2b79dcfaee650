"""3D parallelism: data × tensor × pipeline on Megatron's rank grid (Narayanan et al. 2021).

Each rank has coordinates (tp, dp, pp) in the grid of ``groups.RankGrid`` and belongs to one group
of each kind. The three strategies nest, each using only its own group:

    tensor    the layers of the GPT are split over the tensor group (tensor/):
              two all-reduces per transformer layer forward and two backward
    pipeline  the split GPT's layers are cut into pp stages, one per rank of the pipeline group,
              run by a schedule (pipeline/runtime.py): activations and their gradients move
              between neighbouring stages
    data      the ranks of a data group hold the same slices of the same stages and see
              different shards of the batch; after the pipeline's last backward, each
              averages its gradients over the data group, then every rank steps its optimizer
              (data/allreduce_optimizer.py)

So a step on the global batch of N sequences goes: rank (tp, dp, pp) takes the dp-th shard of
N/dp sequences (the same shard for every tp and pp coordinate), the pipeline splits it into m
micro-batches, and the gradients that reach the optimizer are those of the mean loss over all N:
the serial model's (``tests/test_hybrid.py`` checks the losses step by step).

    groups = ParallelGroups(world, tp=2, pp=2)      # dp = world.size / (tp·pp)
    trainer = Trainer3D(config, groups, schedule="1f1b", microbatches=4)
    loss = trainer.step(ids, targets)               # the global batch, the same on every rank
"""
from .. import backend, random
from ..optim import AdamW
from .data.allreduce_optimizer import AllReduceOptimizer
from .groups import ParallelGroups  # noqa: F401  (re-exported: its old home)
from .pipeline.runtime import Pipeline
from .pipeline.schedules import build
from .tensor import TensorParallelGPT, check_config


def default_optimizer(params):
    """AdamW(lr=1e-3, no weight decay): the optimizer of both the 3D run and its serial twin."""
    return AdamW(params, lr=1e-3, weight_decay=0.0)


class Trainer3D:
    """The tiny GPT trained with data, tensor and pipeline parallelism at once.

    Every rank builds the serial ``nn.GPT(config)`` from ``seed`` and keeps its tensor slices
    (``TensorParallelGPT``); the pipeline keeps this rank's stages of them (equal numbers of
    layers: embedding, blocks, final LayerNorm, LM head). ``make_optimizer(params)`` defaults to
    AdamW(lr=1e-3, weight_decay=0), the same as a serial run would use.
    """

    def __init__(self, config, groups, schedule="1f1b", microbatches=None, chunks=None,
                 make_optimizer=None, seed=0, dtype="float32", algorithm="auto", trace=False):
        check_config(config, groups.grid.tp)
        layers = config.n_layer + 3  # embedding, blocks, ln_f, lm_head
        stages = groups.grid.pp * (chunks or 1)
        if layers < stages:
            raise ValueError(f"the GPT has {layers} pipeline layers (embedding, {config.n_layer} "
                             f"blocks, final LayerNorm, LM head), fewer than the {stages} stages "
                             f"asked for (pp={groups.grid.pp}"
                             f"{f' x {chunks} chunks' if chunks else ''})")
        self.config, self.groups = config, groups
        random.manual_seed(seed)
        self.model = TensorParallelGPT(config, groups.tensor).astype(dtype)
        make_optimizer = make_optimizer or default_optimizer
        self.schedule = build(schedule, groups.grid.pp, microbatches or groups.grid.pp, chunks)
        self.pipe = Pipeline(
            self.model.to_sequential(), self.schedule, groups.pipeline, self.model.loss,
            optimizer=lambda ps: AllReduceOptimizer(ps, make_optimizer, groups.data, algorithm),
            trace=trace)

    def local_shard(self, array):
        """This rank's rows of the global batch: the dp-th of dp equal shards."""
        dp, n = self.groups.grid.dp, len(array)
        if n % dp:
            raise ValueError(f"the global batch of {n} sequences does not divide among the "
                             f"{dp} data-parallel ranks")
        i = self.groups.coords["dp"]
        return array[i * n // dp:(i + 1) * n // dp]

    def step(self, ids, targets):
        """One training step on the global batch (the same arrays on every rank). Returns the
        global mean loss on every rank."""
        loss = self.pipe.step(self.local_shard(ids), self.local_shard(targets))
        last = self.groups.grid.pp - 1
        # the loss lives on the last stage: average it over the data group, hand it to everyone
        value = backend.xp().asarray([loss if loss is not None else 0.0], dtype="float64")
        if self.groups.pipeline.rank == last:
            self.groups.data.all_reduce(value, op="avg", algorithm="mpi", out=value)
        self.groups.pipeline.broadcast(value, root=last, out=value)
        return float(value[0])
