"""4D parallelism: data × tensor × pipeline × expert, for a GPT with mixture-of-experts blocks.

The 3D trainer (hybrid.py) with every block's MLP a mixture of experts (nn/moe.py). The rank grid
gains the expert dimension (groups.py): ep divides dp, and each data group of dp ranks is cut into
expert groups of ep ranks (different experts) and expert-data groups of dp/ep ranks (the same
experts). Attention, router, LayerNorms, embeddings and head are split over tp as in 3D and
replicated over dp; the experts, E/ep per expert rank, receive their tokens by all-to-all within
the expert group, each split over tp like the dense MLP (tensor/moe.py); an expert group sits at
one stage and runs the same schedule, so its all-to-alls pair up micro-batch by micro-batch.
With cp (a fifth axis) the cp ranks route each whole sequence together (tensor/moe.py).

    groups = ParallelGroups(world, tp=2, pp=2, ep=2)          # dp = world / (tp·pp), ep | dp
    trainer = Trainer4D(config, MoEConfig(n_experts=4), groups, microbatches=2)
    loss = trainer.step(ids, targets)                       # the global batch, on every rank
"""
import warnings

from .. import backend
from ..comm.agreement import same_everywhere
from ..distributed.hybrid_state import Trainer4DState
from ..flat import offsets
from .data.allreduce_optimizer import average_grads
from .hybrid import Trainer3D
from .tensor.moe import TensorParallelMoEGPT


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
    rank's local index), so a checkpoint loads into any layout or into ``moe_gpt``. With
    ``sequence_parallel=True`` each tensor rank routes and dispatches only its 1/tp of the
    tokens (tensor/moe.py's SequenceParallelMoE). With cp > 1 (``cp_comm`` as Trainer3D's)
    each rank holds two chunks of every sequence, and the experts' capacity and balancing loss
    are the whole sequences' (tests/test_hybrid_5d.py)."""

    def __init__(self, config, moe, groups, schedule="1f1b", microbatches=None, chunks=None,
                 make_optimizer=None, seed=0, dtype="float32", algorithm="auto", trace=False,
                 sequence_parallel=False, cp_comm="ring"):
        # on every rank, not only within an expert group: data ranks route their own tokens
        same_everywhere(groups.world, "Trainer4D", vars(moe))
        # Megatron-core refuses experts with tp > 1 without sequence parallelism: every tensor
        # rank would send the same tokens, tp times the all-to-all bytes. minipar warns and runs
        # it, so that the two can be measured side by side (tests/test_sequence_parallel.py).
        if groups.grid.tp > 1 and groups.grid.ep > 1 and not sequence_parallel:
            warnings.warn(f"Trainer4D with tp={groups.grid.tp} and sequence_parallel=False: "
                          f"every tensor rank dispatches the same tokens, {groups.grid.tp} times "
                          f"the all-to-all bytes (Megatron-core refuses this); pass "
                          f"sequence_parallel=True", stacklevel=2)
        self.moe = moe
        super().__init__(config, groups, schedule, microbatches, chunks, make_optimizer, seed,
                         dtype, algorithm, trace, sequence_parallel, cp_comm=cp_comm)
        # Every micro-batch's main loss is scaled by 1/m in the pipeline; each MoE layer's
        # aux_scale is 1/m too, so its load-balancing term reaches the gradient in the same
        # proportion (right only for micro-batches of equal size: local_shard checks).
        for layer in self.model.moe_layers():
            layer.aux_scale = 1.0 / self.schedule.microbatches

    # checkpoints: Trainer3D's, each expert under its serial name (distributed/hybrid_state.py)
    state_adapter = Trainer4DState

    def build_model(self, config, groups):
        return TensorParallelMoEGPT(config, self.moe, groups.tensor, groups.expert,
                                    self.sequence_parallel, context=self.context,
                                    attention=self.attention)

    # Gradients (Megatron's finalize_model_grads). The global loss is L = (1/dp) Σ_d L_d, L_d the
    # mean loss of data rank d's shard. A dense parameter's gradient on rank d is ∂L_d/∂θ, so it
    # is averaged over the data group, as in 3D. An expert's gradient on a rank already sums the
    # losses of its whole expert group (their tokens came to it), Σ_{d ∈ expert group} ∂L_d/∂θ,
    # so it is summed over the expert-data group and divided by dp: an average over the dp/ep
    # ranks of the expert-data group, times 1/ep (Megatron scales expert gradients by 1/dp).
    # With cp, read dp·cp for dp: L is the mean of the dp·cp ranks' shares, the dense gradients
    # average over the data-context group, and the expert grid cuts that group in ep × edp.
    def reducer(self, params, make_optimizer, algorithm):
        experts = self.model.expert_parameters()
        return ExpertDataParallelOptimizer(params, experts, make_optimizer, self.gradients,
                                           self.groups.expert_data, algorithm)

    # Capacity and the auxiliary loss are per group of tokens: each data rank routes its
    # micro-batch of its shard alone (GShard's groups), so the serial twin is the serial MoE GPT
    # run once per (data rank, micro-batch) with the same parameters (tests/test_hybrid_4d.py),
    # not on the whole batch. The ranks of a cp group (and of a tensor group under sequence
    # parallelism) hold parts of the same sequences: they route them together, as one group
    # (tensor/moe.py), so cp changes nothing of the grouping (tests/test_hybrid_5d.py).
    def local_shard(self, array):
        shard = super().local_shard(array)
        m = self.schedule.microbatches
        if len(shard) % m:
            raise ValueError(f"the data-parallel shard of {len(shard)} sequences does not cut "
                             f"into {m} equal micro-batches: the load-balancing loss is scaled "
                             f"by 1/m, right only for equal micro-batches")
        return shard
