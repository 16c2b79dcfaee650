"""The mixture of experts split two ways: experts over an expert group, each expert over the
tensor group (Megatron-core with expert tensor parallelism ETP = TP).

A GPT whose blocks are ``nn.moe.MoEBlock``s (``moe_gpt``, the serial twin) becomes, on a rank
with tensor group T (size tp) and expert group X (size ep):

    blocks.i.ln_1, ln_2          replicated
    blocks.i.attn                ParallelSelfAttention over T, as in the dense GPT
    blocks.i.mlp.router          replicated: every rank routes its own tokens
    blocks.i.mlp.experts         this expert rank's E/ep experts (``expert_ids``), each a
                                 ParallelMLP over T: c_fc by rows, c_proj by columns

    model = TensorParallelMoEGPT(config, MoEConfig(n_experts=4), groups.tensor, groups.expert)
"""
import dataclasses

from ... import nn
from ...nn import ModuleList, Sequential
from ...nn.moe import MoEBlock
from ...distributed.sharded import serial_names
from ..expert import ExpertParallelMoE
from .gpt import ParallelBlock, TensorParallelGPT
from .layers import ParallelMLP
from .shard import local_slices


@dataclasses.dataclass
class MoEConfig:
    """The mixture of experts in every block (nn.moe.MoE's arguments)."""
    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25  # None: an expert takes every token, nothing is dropped
    aux_coeff: float = 0.01
    hidden: int = None  # each expert's MLP width; 4·n_embd by default


def moe_gpt(config, moe):
    """The serial twin: ``nn.GPT(config)`` with every block an ``MoEBlock`` (experts as wide
    as ``moe.hidden``), GPT-2's initialisation over all of it."""
    model = nn.GPT(config)
    model.blocks = Sequential(*[
        MoEBlock(config.n_embd, config.n_head, moe.n_experts, moe.top_k, moe.capacity_factor,
                 config.dropout, moe.hidden, moe.aux_coeff) for _ in range(config.n_layer)])
    model._init_gpt2()
    return model


class TensorExpertParallelMoE(ExpertParallelMoE):
    """``ExpertParallelMoE`` over ``group`` whose experts are ``ParallelMLP``s over
    ``tensor_group``; routing, dispatch and combine are ExpertParallelMoE's.

    The tp ranks of a tensor group hold the same tokens and route them alike, so each runs the
    same all-to-all inside its own expert group (the ranks with its tensor coordinate): the rows
    that reach an expert are the same on all tp ranks, which is what ParallelMLP needs (its input
    whole, its output summed by one all-reduce over T)."""

    def __init__(self, n_embd, n_experts, top_k=2, capacity_factor=1.25, hidden=None,
                 aux_coeff=0.01, dropout=0.0, *, group, tensor_group):
        super().__init__(n_embd, n_experts, top_k, capacity_factor, hidden, aux_coeff, dropout,
                         group=group)
        # The price of whole tokens: every tensor rank sends the same rows, so the all-to-alls
        # move tp times the bytes of one copy. Megatron-core refuses MoE with tp > 1 unless
        # sequence parallelism is on, so that each tensor rank dispatches only its 1/tp of the
        # tokens; minipar keeps the tokens whole for clarity.
        self.experts = ModuleList(*[ParallelMLP(n_embd, tensor_group, dropout, hidden)
                                    for _ in self.expert_ids])


def check_moe(config, moe, tp, ep):
    """Every split of the experts must be whole; one clear error on every rank."""
    if moe.n_experts % ep:
        raise ValueError(f"n_experts {moe.n_experts} is not divisible by the expert-parallel "
                         f"size ep {ep}: each expert rank holds E/ep whole experts")
    hidden = moe.hidden or 4 * config.n_embd
    if hidden % tp:
        raise ValueError(f"expert hidden size {hidden} is not divisible by the tensor-parallel "
                         f"size {tp}: each expert's MLP is split over the tensor group")


class TensorParallelMoEGPT(TensorParallelGPT):
    """``TensorParallelGPT`` with MoE blocks: this rank's part of ``moe_gpt(config, moe)``
    drawn from the random stream (which it leaves where the serial twin does)."""

    def __init__(self, config, moe, tensor_group, expert_group):
        check_moe(config, moe, tensor_group.size, expert_group.size)
        # set first: the base constructor calls serial_twin() and block(), which read them
        self.moe = moe
        self.expert_group = expert_group
        super().__init__(config, tensor_group)

    def serial_twin(self):
        return moe_gpt(self.config, self.moe)

    def block(self):
        """ParallelBlock whose MLP is a TensorExpertParallelMoE: x + attn(ln_1(x));
        x + moe(ln_2(x))."""
        config = self.config
        moe = self.moe
        mlp = TensorExpertParallelMoE(config.n_embd, moe.n_experts, moe.top_k,
                                      moe.capacity_factor, moe.hidden, moe.aux_coeff,
                                      config.dropout, group=self.expert_group,
                                      tensor_group=self.group)
        return ParallelBlock(config.n_embd, config.n_head, self.group, config.dropout, mlp=mlp)

    def serial_twin_names(self):
        return serial_names(self)

    def moe_layers(self):
        return [block.mlp for block in self.blocks]

    def expert_parameters(self):
        """Every parameter of this rank's experts: reduced over the expert-data group."""
        return [p for layer in self.moe_layers() for p in layer.expert_parameters()]


def serial_slices(model, full, tensor_group):
    """{parameter name in ``model``: this rank's slice} of arrays ``full`` keyed by the serial
    twin's names (weights or gradients): its expert, its tensor slice."""
    return local_slices(model, full, tensor_group, serial_names(model))
