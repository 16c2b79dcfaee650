"""ExpertParallelMoE: the mixture of experts with its experts spread over an expert group.

Rank r of a group of ep ranks holds experts [r·E/ep, (r+1)·E/ep) and the whole (replicated)
router. Its serial twin is ``nn.moe.MoE`` applied to each rank's tokens separately with the same
parameters (why, and how a data-parallel trainer averages it: docs/tensor_parallel.md).

    serial = MoE(C, E, top_k=2)                        # same seed on every rank
    layer = ExpertParallelMoE.from_serial(serial, group)
    y = layer(x)                                       # x: this rank's tokens
    print(*table(counts_matrix(layer.last_routing, group), group.size), sep="\n")
"""
import numbers

from ... import random
from ...comm.agreement import same_everywhere
from ...distributed.sharded import ShardedStateDict
from ...nn import ModuleList
from ...nn.moe import MoE
from .dispatch import combine, dispatch, plan


class ExpertParallelMoE(ShardedStateDict, MoE):
    """``MoE`` whose ``experts`` are this rank's E/ep (``expert_ids``); the rest is replicated.
    Built from the RNG like the serial MoE, so one seed gives the twin's parameters."""

    def __init__(self, n_embd, n_experts, top_k=2, capacity_factor=1.25, hidden=None,
                 aux_coeff=0.01, dropout=0.0, *, group):
        if group is None or not hasattr(group, "all_to_all_v"):
            raise TypeError(f"ExpertParallelMoE needs group=, a Communicator, got {group!r}")
        if not isinstance(n_experts, numbers.Integral) or n_experts % group.size:
            raise ValueError(f"ExpertParallelMoE: n_experts={n_experts} must be divisible by the "
                             f"expert group's size {group.size}")
        # ranks routing by their own top_k or capacity would each finish, with a wrong answer
        same_everywhere(group, "ExpertParallelMoE", dict(n_experts=n_experts, top_k=top_k,
                                                         capacity_factor=capacity_factor))
        super().__init__(n_embd, n_experts, top_k, capacity_factor, hidden, aux_coeff, dropout)
        self.group = group
        per = n_experts // group.size
        self.expert_ids = list(range(group.rank * per, (group.rank + 1) * per))
        self.experts = ModuleList(*(self.experts[e] for e in self.expert_ids))
        self.last_plan = None

    @classmethod
    def from_serial(cls, serial, group):
        """This rank's share of a serial ``MoE``: the router and experts ``expert_ids``, copied
        (the random stream is left as it was)."""
        if not isinstance(serial, MoE):
            raise TypeError(f"from_serial needs an nn.moe.MoE, got {type(serial).__name__}")
        mlp = serial.experts[0]
        with random.fork_rng():
            layer = cls(serial.n_embd, serial.n_experts, serial.top_k, serial.capacity_factor,
                        mlp.c_fc.out_features, serial.aux_coeff, mlp.dropout.p, group=group)
        layer.astype(serial.router.weight.dtype)
        layer.aux_scale = serial.aux_scale
        layer.router.load_state_dict(serial.router.state_dict())
        for mine, e in zip(layer.experts, layer.expert_ids):
            mine.load_state_dict(serial.experts[e].state_dict())
        return layer

    def apply_experts(self, flat, gates, routing):
        """Dispatch this rank's kept rows to the experts' ranks, run the local experts on what
        arrived, combine the results back home (dispatch.py)."""
        self.last_plan = plan(routing.kept_per_expert, self.group)
        rows = dispatch(flat[routing.order], self.last_plan, self.group)
        out = self.run_experts(rows, self.last_plan.per_expert)
        return combine(out, self.last_plan, self.group, gates, routing)

    def serial_name(self, name):
        """The serial MoE's name for this module's parameter ``name`` (experts renumbered)."""
        if name.startswith("experts."):
            i, rest = name[len("experts."):].split(".", 1)
            return f"experts.{self.expert_ids[int(i)]}.{rest}"
        return name

    def router_parameters(self):
        """The replicated parameters (the router's): their gradients need a sum over the group."""
        return list(self.router.parameters())

    def expert_parameters(self):
        """This rank's experts' parameters: gradients already complete for the expert group."""
        return [p for expert in self.experts for p in expert.parameters()]

    def router_grads_sum(self):
        """Sum the router's gradients over the expert group (in place): the serial twin's
        gradient over every rank's tokens."""
        for p in self.router_parameters():
            if p.grad is not None:
                self.group.all_reduce(p.grad, out=p.grad)

    def extra_repr(self):
        return f"experts {self.expert_ids} of {self.n_experts} on rank {self.group.rank}"
