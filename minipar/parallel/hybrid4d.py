"""4D parallelism: data × tensor × pipeline × expert, for a GPT with mixture-of-experts blocks.

The 3D trainer (hybrid.py) with every block's MLP a mixture of experts (nn/moe.py). The rank
grid gains the expert dimension (groups.py): ep divides dp, and each data group of dp ranks is
cut into expert groups of ep ranks (different experts) and expert-data groups of dp/ep ranks
(the same experts). Each part of the model uses its groups:

    attention, router, LayerNorms, embeddings, head    split over tp as in 3D; replicated over dp
    experts      E/ep per expert rank (expert group: tokens go there and back by all-to-all),
                 each split over tp like the dense MLP (ETP = TP; tensor/moe.py)
    stages       pp, as in 3D: an expert group sits at one stage and runs the same schedule,
                 so its all-to-alls pair up micro-batch by micro-batch

Gradients (Megatron's finalize_model_grads). The global loss is L = (1/dp) Σ_d L_d, L_d the
mean loss of data rank d's shard. A dense parameter's gradient on rank d is ∂L_d/∂θ, so it is
averaged over the data group, as in 3D. An expert's gradient on a rank already sums the losses
of its whole expert group (their tokens came to it), Σ_{d ∈ expert group} ∂L_d/∂θ, so it is
summed over the expert-data group and divided by dp: an average over the dp/ep ranks of the
expert-data group, times 1/ep (Megatron scales expert gradients by 1/dp the same way).

Capacity and the auxiliary loss are per group of tokens: each rank routes its micro-batch of
its shard alone (GShard's groups), so the serial twin is the serial MoE GPT run once per (data
rank, micro-batch) with the same parameters (``train_serial_4d``), not on the whole batch.
Every micro-batch's main loss is scaled by 1/m in the pipeline; each MoE layer's ``aux_scale``
is 1/m too, so its load-balancing term reaches the gradient in the same proportion. The
micro-batches must be of equal size for that one number to be right.

    groups = ParallelGroups(world, tp=2, pp=2, ep=2)          # dp = world / (tp·pp), ep | dp
    trainer = Trainer4D(config, MoEConfig(n_experts=4), groups, microbatches=2)
    loss = trainer.step(ids, targets)                       # the global batch, on every rank
"""
from .. import backend, random
from .data.buckets import flatten_grads, offsets
from .hybrid import Trainer3D, default_optimizer
from .tensor.moe import (MoEConfig, TensorParallelMoEGPT, moe_gpt, serial_names,  # noqa: F401
                         serial_slices)


class ExpertDataParallelOptimizer:
    """``make_optimizer(params)``'s optimizer, stepping with dense gradients averaged over
    ``data`` and expert gradients (``experts``: the parameters that are) averaged over
    ``expert_data`` and scaled by ``expert_data.size / data.size`` (= 1/ep)."""

    def __init__(self, params, experts, make_optimizer, data, expert_data, algorithm="auto"):
        self.params, self.algorithm = list(params), algorithm
        self.optimizer = make_optimizer(self.params)
        ids = {id(p) for p in experts}
        self.reductions = []  # (parameters, group, scale, flat buffer)
        for group, scale, mine in ((data, 1.0, [p for p in self.params if id(p) not in ids]),
                                   (expert_data, expert_data.size / data.size,
                                    [p for p in self.params if id(p) in ids])):
            if mine and (group.size > 1 or scale != 1.0):
                flat = backend.get_array_module(mine[0].data).zeros(offsets(mine)[1],
                                                                    mine[0].dtype)
                self.reductions.append((mine, group, scale, flat))

    def step(self):
        from .data.allreduce_optimizer import average_grads  # the one AllReduceOptimizer uses
        for params, group, scale, flat in self.reductions:
            average_grads(params, flat, group, self.algorithm, scale)
        self.optimizer.step()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class Trainer4D(Trainer3D):
    """The 3D trainer on a GPT whose blocks are mixtures of experts, the experts spread over
    the expert groups of ``groups`` (``ParallelGroups(..., ep=)``). The model is this rank's
    part of ``moe_gpt(config, moe)`` drawn from ``seed``; the rest as ``Trainer3D``, checkpoints
    too: ``state_dict`` names every parameter as the serial twin does (expert ``e``, not this
    rank's local index), so a checkpoint loads into any layout or into ``moe_gpt``."""

    def __init__(self, config, moe, groups, schedule="1f1b", microbatches=None, chunks=None,
                 make_optimizer=None, seed=0, dtype="float32", algorithm="auto", trace=False):
        self.moe = moe
        super().__init__(config, groups, schedule, microbatches, chunks, make_optimizer, seed,
                         dtype, algorithm, trace)
        for layer in self.model.moe_layers():  # the main loss of a micro-batch is scaled 1/m
            layer.aux_scale = 1.0 / self.schedule.microbatches
        self._experts = {id(p) for p in self.model.expert_parameters()}

    def build_model(self, config, groups):
        return TensorParallelMoEGPT(config, self.moe, groups.tensor, groups.expert)

    def reducer(self, params, make_optimizer, algorithm):
        experts = self.model.expert_parameters()
        return ExpertDataParallelOptimizer(params, experts, make_optimizer, self.groups.data,
                                           self.groups.expert_data, algorithm)

    def local_shard(self, array):
        shard = super().local_shard(array)
        m = self.schedule.microbatches
        if len(shard) % m:
            raise ValueError(f"the data-parallel shard of {len(shard)} sequences does not cut "
                             f"into {m} equal micro-batches: the load-balancing loss is scaled "
                             f"by 1/m, right only for equal micro-batches")
        return shard

    # --- checkpoints: Trainer3D's, with each expert under its serial name ----------------------
    def _held(self):
        names = serial_names(self.model)
        return [(names[name], p, spec) for name, p, spec in super()._held()]

    def _writes(self, p):
        """An expert is written by expert-data rank 0 of the ranks holding it (one per expert
        rank), the rest by data rank 0."""
        if id(p) in self._experts:
            return self.groups.coords["edp"] == 0
        return super()._writes(p)

    def held(self):
        """{name in ``self.model``: Parameter} of this rank's stages, in the optimizer's order."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return {names[id(p)]: p for p in self.pipe.params}


def train_serial_4d(model, optimizer, batches, dp, microbatches):
    """The serial twin of a Trainer4D run: each global batch cut into dp shards and each shard
    into m micro-batches, one forward per (shard, micro-batch) (its own capacity group), the
    loss scaled by 1/m, every gradient summed then divided by dp; one optimizer step per batch.
    Returns the global mean losses, as floats."""
    losses, m = [], microbatches
    for block in model.blocks:
        block.mlp.aux_scale = 1.0 / m
    for ids, targets in batches:
        if len(ids) % (dp * m):
            raise ValueError(f"a batch of {len(ids)} sequences does not cut into {dp} shards of "
                             f"{m} equal micro-batches")
        model.zero_grad()
        total = 0.0
        for d in range(dp):
            shard = slice(d * len(ids) // dp, (d + 1) * len(ids) // dp)
            for x, t in zip(_cut(ids[shard], m), _cut(targets[shard], m)):
                _, loss = model(x, t)
                (loss * (1.0 / m)).backward()
                total += loss.item() / m / dp
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad / dp
        optimizer.step()
        losses.append(total)
    return losses


def _cut(array, m):
    n = len(array) // m
    return [array[k * n:(k + 1) * n] for k in range(m)]


def serial_model(config, moe, seed=0, dtype="float32"):
    """The serial MoE GPT a Trainer4D with the same ``seed`` starts from, and its optimizer's
    default (``default_optimizer``)."""
    random.manual_seed(seed)
    model = moe_gpt(config, moe).astype(dtype)
    return model, default_optimizer(model.parameters())
