"""Mixture of experts: a router sends each token to k of E expert MLPs (Shazeer et al. 2017).

    p = softmax(x W_rᵀ)                    (N, E)  router probabilities, W_r the router (no bias)
    e_1 .. e_k = the k largest p_e          top-k experts of each token (ties: lower index)
    y = Σ_j g_j · keep_j · expert_ej(x)     g_j its gates, keep_j: within the expert's capacity
    capacity = ceil(capacity_factor · N · k / E)    GShard's expert capacity (None: keep all)
    l_aux = E · Σ_e f_e · P_e               Switch's load-balancing loss, as Megatron-core's

The experts run on rows laid out expert by expert (expert 0's kept tokens in token order, then
expert 1's, ...): ``Routing.order``. Expert parallelism cuts exactly this layout between ranks
(minipar/parallel/expert/). What l_aux measures, and how it trains: docs/engine.md.

    moe = MoE(n_embd=64, n_experts=4, top_k=2)
    y = moe(x)                              # then moe.last_routing: counts, drops, l_aux
"""
import dataclasses
import math

from .. import backend
from .. import functional as F
from ..autograd import Tensor, concat, make_result
from .layers import LayerNorm, Linear
from .module import Module, ModuleList
from .transformer import MLP, CausalSelfAttention


def capacity(tokens, n_experts, top_k, capacity_factor):
    """ceil(capacity_factor · tokens · top_k / n_experts): the assignments one expert takes;
    every token when ``capacity_factor`` is None."""
    if capacity_factor is None:
        return tokens
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


@dataclasses.dataclass
class Routing:
    """What the router decided for N tokens (host arrays, printable):

    expert (N, k)     the chosen experts of each token, best first
    slot (N, k)       the assignment's place in its expert's queue (token order)
    kept (N, k)       slot < capacity
    row (N, k)        its row in the expert-major layout, or M (= kept assignments) when dropped
    order (M,)        the token of each row of that layout: expert 0's kept tokens, then 1's...
    tokens_per_expert (E,)  assignments before drops;  kept_per_expert (E,)  after
    """
    expert: object
    slot: object
    kept: object
    row: object
    order: object
    tokens_per_expert: object
    kept_per_expert: object
    capacity: int
    aux_loss: float = 0.0

    @property
    def dropped(self):
        """Assignments dropped because their expert was full."""
        return int(self.tokens_per_expert.sum() - self.kept_per_expert.sum())

    def load(self):
        """max / mean of the kept tokens per expert (1.0: perfectly balanced)."""
        mean = self.kept_per_expert.mean()
        return float(self.kept_per_expert.max() / mean) if mean else 0.0


def route(expert, n_experts, cap):
    """The ``Routing`` of top-k choices ``expert`` (N, k host ints) under capacity ``cap``."""
    host = backend.numpy
    N, k = expert.shape
    # First come first served in token order: a token never picks one expert twice, so the
    # order within an expert is the token order. A dropped assignment contributes zero; in a
    # block x + moe(ln(x)) the token's residual passes on.
    ### BEGIN SOLUTION moe-top-k
    flat = expert.reshape(-1)  # assignments in token order: (token 0, choice 0), (0, 1), ...
    by_expert = host.argsort(flat, kind="stable")  # stable: token order within an expert
    assigned = host.bincount(flat, minlength=n_experts)
    starts = host.concatenate([[0], host.cumsum(assigned)[:-1]])
    slot = host.empty(N * k, dtype=host.int64)
    slot[by_expert] = host.arange(N * k) - host.repeat(starts, assigned)
    kept = slot < cap
    ### END SOLUTION
    kept_per_expert = host.minimum(assigned, cap)
    offsets = host.concatenate([[0], host.cumsum(kept_per_expert)[:-1]])
    M = int(kept_per_expert.sum())
    row = host.where(kept, offsets[flat] + slot, M)
    order = host.empty(M, dtype=host.int64)
    order[row[kept]] = host.arange(N * k)[kept] // k
    return Routing(expert, slot.reshape(N, k), kept.reshape(N, k), row.reshape(N, k), order,
                   assigned, kept_per_expert, int(cap))


def aux_loss_autoscaler(y, aux, coeff):
    """Identity on ``y``; its backward also gives ``aux`` the gradient ``coeff`` (Megatron's
    MoEAuxLossAutoScaler): the loss stays what it was, d(loss)/d(params) gains coeff·d(aux)."""
    xp = backend.get_array_module(aux.data)
    return make_result(y.data, (y, aux), lambda g: (g, xp.full(aux.shape, coeff, aux.dtype)),
                       "moe_aux_loss")


class MoE(Module):
    """A router (Linear n_embd -> n_experts, no bias) and ``n_experts`` MLPs; ``forward(x)`` of
    shape (..., n_embd) returns y of the same shape. After each forward ``last_routing`` holds
    the ``Routing`` (counts per expert, drops, l_aux) of its tokens, all one capacity group."""

    def __init__(self, n_embd, n_experts, top_k=2, capacity_factor=1.25, hidden=None,
                 aux_coeff=0.01, dropout=0.0):
        super().__init__()
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE needs n_experts >= 1 and 1 <= top_k <= n_experts, got "
                             f"n_experts={n_experts}, top_k={top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: drop nothing), "
                             f"got {capacity_factor}")
        self.n_embd, self.n_experts, self.top_k = n_embd, n_experts, top_k
        # aux_scale: what the main loss is scaled by (1/m when m micro-batches are averaged)
        self.capacity_factor, self.aux_coeff, self.aux_scale = capacity_factor, aux_coeff, 1.0
        self.router = Linear(n_embd, n_experts, bias=False)
        self.experts = ModuleList(*[MLP(n_embd, dropout, hidden) for _ in range(n_experts)])
        self.last_routing = None

    def gate(self, x):
        """Router on x (N, n_embd): (probabilities (N, E), gates (N, k), Routing)."""
        if x.ndim != 2 or x.shape[1] != self.n_embd:
            raise ValueError(f"MoE(n_embd={self.n_embd}) got input of shape {tuple(x.shape)}: "
                             f"its last axis must be {self.n_embd}")
        ### BEGIN SOLUTION moe-top-k
        probs = F.softmax(self.router(x), axis=-1)
        p = backend.to_numpy(probs.data)
        expert = backend.numpy.argsort(-p, axis=1, kind="stable")[:, :self.top_k]
        cap = capacity(len(p), self.n_experts, self.top_k, self.capacity_factor)
        routing = route(expert, self.n_experts, cap)
        # k = 1: Switch's raw probability, so the router learns through the gate. k >= 2: GShard
        # and Mixtral renormalise the kept top-k to sum 1 (before capacity drops anything).
        gates = probs.gather(1, expert)
        if self.top_k > 1:
            gates = gates / gates.sum(axis=-1, keepdims=True)
        ### END SOLUTION
        return probs, gates, routing

    def balance_loss(self, probs, routing):
        """l_aux = E · Σ_e f_e · P_e (the Switch loss, f from the assignments before drops)."""
        N = probs.shape[0]
        f = routing.tokens_per_expert / max(N * self.top_k, 1)
        aux = self.n_experts * (probs.mean(axis=0) * backend.asarray(f, probs.dtype)).sum()
        routing.aux_loss = float(aux.item())
        return aux

    def run_experts(self, rows, counts, first=0):
        """Expert first+i on its ``counts[i]`` consecutive rows of ``rows`` (expert-major)."""
        outs, lo = [], 0
        for i, n in enumerate(counts):
            outs.append(self.experts[first + i](rows[lo:lo + int(n)]))
            lo += int(n)
        return concat(outs, axis=0)

    def apply_experts(self, flat, gates, routing):
        """Every expert on its kept rows, here; weighted back per token (``combine``).
        Expert parallelism replaces just this step (parallel/expert/layer.py)."""
        rows = self.run_experts(flat[routing.order], routing.kept_per_expert)
        return combine(rows, gates, routing)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, gates, routing = self.gate(flat)
        y = self.apply_experts(flat, gates, routing)
        self.last_routing = routing
        aux = self.balance_loss(probs, routing)
        # The loss the trainer returns is unchanged, and the balance still trains, in any
        # pipeline stage: y's identity hands l_aux its gradient in backward.
        return aux_loss_autoscaler(y, aux, self.aux_coeff * self.aux_scale).reshape(shape)


def combine(rows, gates, routing):
    """y_i = Σ_j g_ij · rows[row_ij]: each token's expert outputs, weighted by its gates; a
    dropped assignment points at an appended zero row."""
    zero = Tensor(backend.get_array_module(rows.data).zeros((1,) + rows.shape[1:], rows.dtype))
    picked = concat([rows, zero], axis=0)[routing.row]  # (N, k, C)
    return (picked * gates.reshape(*gates.shape, 1)).sum(axis=1)


class MoEBlock(Module):
    """A GPT-2 block whose MLP is a mixture of experts: x + attn(ln_1(x)); x + moe(ln_2(x)).
    Parameter names as nn.transformer.Block's (ln_1, attn, ln_2, mlp), with mlp a ``MoE``."""

    def __init__(self, n_embd, n_head, n_experts, top_k=2, capacity_factor=1.25, dropout=0.0,
                 hidden=None, aux_coeff=0.01):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = LayerNorm(n_embd)
        self.mlp = MoE(n_embd, n_experts, top_k, capacity_factor, hidden, aux_coeff, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
