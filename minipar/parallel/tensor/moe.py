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
``sequence_parallel=True``: each tensor rank routes and dispatches its own 1/tp of the tokens.
"""
import dataclasses

from ... import backend, nn
from ... import functional as F
from ...nn import ModuleList, Sequential
from ...nn.moe import MoEBlock, Routing, capacity, route
from ...distributed.sharded import serial_names
from ..context.layout import gather_sequence, split_sequence
from ..context.ring import ring_attention
from ..expert import ExpertParallelMoE, gather_rows, reduce_scatter_rows
from .gpt import ParallelBlock, TensorParallelGPT
from .layers import ParallelMLP, SequenceParallelDropout
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
    whole, its output summed by one all-reduce over T).

    With ``context`` (the cp group) this rank holds only its two chunks of each sequence: the
    routing is still the serial twin's over the whole sequences (``gate``, ``balance_loss``)."""

    expert_type = ParallelMLP
    tensor_split = False  # True: each tensor rank holds its own 1/tp of the tokens

    def __init__(self, n_embd, n_experts, top_k=2, capacity_factor=1.25, hidden=None,
                 aux_coeff=0.01, dropout=0.0, *, group, tensor_group, context=None):
        super().__init__(n_embd, n_experts, top_k, capacity_factor, hidden, aux_coeff, dropout,
                         group=group)
        self.tensor_group = tensor_group
        self.context = context if context is not None and context.size > 1 else None
        self.whole = None  # the Routing of the whole sequences, when they are split
        # The price of whole tokens: every tensor rank sends the same rows, so the all-to-alls
        # move tp times the bytes of one copy (SequenceParallelMoE sends each token once).
        self.experts = ModuleList(*[self.expert_type(n_embd, tensor_group, dropout, hidden)
                                    for _ in self.expert_ids])

    def splits(self):
        """The groups this rank's tokens of a sequence are cut over, outermost first: the cp
        group (two chunks of each sequence a rank), then the tensor group (sequence parallel:
        1/tp of those a rank)."""
        return ([self.context] if self.context is not None else []) + \
            ([self.tensor_group] if self.tensor_split and self.tensor_group.size > 1 else [])

    def forward(self, x):
        self.sequence_shape = x.shape[:-1]  # (B, t): gate() needs the tokens' places
        return super().forward(x)

    def gate(self, x):
        """The serial twin's routing of the whole sequences: the ranks holding other tokens of
        them share their top-k choices (a few integers per token), so capacity counts every
        token of the sequences, in the serial order (sequence b, then position), and drops
        what the serial model drops."""
        probs, gates, mine = super().gate(x)  # mine: routed alone, capacity of its tokens
        splits = self.splits()
        if not splits:
            self.whole = None
            return probs, gates, mine
        B, t = self.sequence_shape
        k = self.top_k
        whole = backend.numpy.ascontiguousarray(mine.expert.reshape(B, t, k))
        for group in splits[::-1]:  # innermost first: tp slices, then the cp chunks
            whole = gather_tokens(whole, group, group is self.context)
        whole = whole.reshape(-1, k)
        self.whole = route(whole, self.n_experts, capacity(len(whole), self.n_experts, k,
                                                          self.capacity_factor))
        slot = self.whole.slot.reshape(B, -1, k)
        for group in splits:  # outermost first: this rank's cp chunks, then its tp slice
            slot = local_tokens(slot, group, group is self.context)
        return probs, gates, routing_of(mine.expert, slot.reshape(-1, k), self.whole.capacity,
                                        self.n_experts)

    def balance_loss(self, probs, routing):
        """This rank's share of the whole sequences' l_aux = E · Σ_e f_e · P_e: f over every
        token of the sequences, P summed over this rank's tokens and divided by all N. The
        shares add up to the serial l_aux (``routing.aux_loss`` is the share). The tensor
        ranks' shares are summed with the router's gradients (sequence parallel); the cp
        ranks' gradients are averaged (over dp × cp, as the main loss's share is weighted),
        so the share is returned times cp."""
        if self.whole is None:
            return super().balance_loss(probs, routing)
        N = len(self.whole.expert)
        f = self.whole.tokens_per_expert / max(N * self.top_k, 1)
        aux = self.n_experts * (probs.sum(axis=0) / N * backend.asarray(f, probs.dtype)).sum()
        routing.aux_loss = float(aux.item())
        return aux if self.context is None else aux * float(self.context.size)


def gather_tokens(choices, group, context):
    """(B, t, k) top-k choices of this rank's tokens -> (B, g·t, k) of ``group``'s tokens in
    sequence order: the cp chunks put back in their places (``context``), or the tensor ranks'
    consecutive slices side by side."""
    if context:
        return gather_sequence(choices, group, dim=1)
    B, t, k = choices.shape
    everyone = group.all_gather(choices)  # (g, B, t, k) -> sequence b, then position rank·t + j
    return everyone.transpose(1, 0, 2, 3).reshape(B, group.size * t, k)


def local_tokens(whole, group, context):
    """The inverse of ``gather_tokens``: this rank's places of the (B, g·t, ...) ``whole``."""
    if context:
        return split_sequence(whole, group, dim=1)
    t = whole.shape[1] // group.size
    return whole[:, group.rank * t:(group.rank + 1) * t]


class SequenceParallelExpert(ParallelMLP):
    """An expert over the tensor group whose rows differ per tensor rank (each routed its own
    tokens): c_fc's input is every tensor rank's rows gathered, c_proj's partial sums go back to
    the rows' own rank reduce-scattered, in place of f and g (Megatron's explicit_expert_comm)."""

    def __init__(self, n_embd, group, dropout=0.0, hidden=None, dtype="float32"):
        super().__init__(n_embd, group, dropout, hidden, dtype=dtype)
        # each tensor rank's rows get their own numbers: the mask of the gathered rows, sliced
        self.dropout = SequenceParallelDropout(dropout, group, axis=0)

    def forward(self, rows):
        group = self.c_fc.group
        counts = [int(n) for n in group.all_gather(backend.numpy.array([len(rows)]))[:, 0]]
        x = gather_rows(rows, counts, group)  # the expert's input, whole on every tensor rank
        h = self.gelu(F.linear(x, self.c_fc.weight, self.c_fc.bias))  # this rank's hidden slice
        y = reduce_scatter_rows(F.linear(h, self.c_proj.weight), counts, group)
        return self.dropout(y + self.c_proj.bias, counts)  # the bias once, after the sum


class SequenceParallelMoE(TensorExpertParallelMoE):
    """``TensorExpertParallelMoE`` on this tensor rank's (B, T/tp, C) slice of the sequence: it
    routes and dispatches only its own tokens, so the all-to-alls carry each token once.

    The routing is the serial twin's, on the whole sequence (``gate``: the tensor ranks share
    their top-k choices, so capacity counts every token in the serial order, and the
    load-balancing loss's f is the whole sequence's). Each rank's l_aux is its share (its
    tokens' probabilities over all N tokens): the shares add up to the serial l_aux, the router's
    gradients to the serial ones once summed over tp (``finalize_grads``)."""

    expert_type = SequenceParallelExpert
    tensor_split = True


def routing_of(expert, slot, cap, n_experts):
    """The ``Routing`` of top-k choices ``expert`` (N, k) whose places in their experts' queues
    (``slot``) were counted elsewhere: kept when slot < cap; rows laid out as ``route`` does."""
    host = backend.numpy
    N, k = expert.shape
    flat = expert.reshape(-1)
    kept = slot.reshape(-1) < cap
    M = int(kept.sum())
    # the kept assignments expert by expert, token order within each (stable): the row layout
    by_expert = host.argsort(host.where(kept, flat, n_experts), kind="stable")[:M]
    row = host.full(N * k, M, dtype=host.int64)
    row[by_expert] = host.arange(M)
    return Routing(expert, slot, kept.reshape(N, k), row.reshape(N, k), by_expert // k,
                   host.bincount(flat, minlength=n_experts),
                   host.bincount(flat[kept], minlength=n_experts), int(cap))


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

    def __init__(self, config, moe, tensor_group, expert_group, sequence_parallel=False,
                 context=None, attention=ring_attention):
        check_moe(config, moe, tensor_group.size, expert_group.size)
        # set first: the base constructor calls serial_twin() and block(), which read them
        self.moe = moe
        self.expert_group = expert_group
        super().__init__(config, tensor_group, sequence_parallel, context=context,
                         attention=attention)

    def serial_twin(self):
        return moe_gpt(self.config, self.moe)

    def block(self):
        """ParallelBlock whose MLP is a TensorExpertParallelMoE: x + attn(ln_1(x));
        x + moe(ln_2(x))."""
        config = self.config
        moe = self.moe
        layer = SequenceParallelMoE if self.sequence_parallel else TensorExpertParallelMoE
        mlp = layer(config.n_embd, moe.n_experts, moe.top_k, moe.capacity_factor, moe.hidden,
                    moe.aux_coeff, config.dropout, group=self.expert_group,
                    tensor_group=self.group, context=self.context)
        return ParallelBlock(config.n_embd, config.n_head, self.group, config.dropout,
                             self.sequence_parallel, mlp=mlp, context=self.context,
                             attention=self.attention)

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
