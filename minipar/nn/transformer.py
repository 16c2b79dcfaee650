"""A tiny GPT-2 (Radford et al. 2019, after nanoGPT): the model the parallel lessons split up.

    ids (B, T) -> token + position embeddings -> n_layer x Block -> LayerNorm -> LM head -> logits

Each Block is pre-LayerNorm: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Weights start as in GPT-2:
N(0, 0.02), with the two projections that write into the residual stream scaled by 1/√(2·n_layer).

The LM head is *not* tied to the token embedding by default (``tie_weights=False``), so that every
parameter belongs to exactly one pipeline stage; ``tie_weights=True`` shares them as GPT-2 does.
"""
import dataclasses
import math

from .. import backend, random
from .. import functional as F
from ..autograd import Tensor, no_grad
from . import init
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear
from .module import Module, Sequential


class MLP(Module):
    """Linear(C, 4C) -> GeLU -> Linear(4C, C) -> Dropout."""

    def __init__(self, n_embd, dropout=0.0, hidden=None):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = Linear(n_embd, hidden)
        self.gelu = GELU()
        self.c_proj = Linear(hidden, n_embd)
        self.dropout = Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class CausalSelfAttention(Module):
    """Multi-head causal self-attention: one Linear makes q, k, v; each of ``n_head`` heads attends
    over the past in d = C / n_head dimensions; a second Linear mixes the heads back."""

    def __init__(self, n_embd, n_head, dropout=0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.p = n_embd, n_head, dropout
        self.c_attn = Linear(n_embd, 3 * n_embd)
        self.c_proj = Linear(n_embd, n_embd)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x):
        # q, k, v: (B, T, C) each, C = n_head·d; every head attends in its d dimensions, and
        # the heads come back side by side, (B, T, C) (see minipar.attention: no copies)
        y = F.attention_heads(self.c_attn(x), self.n_head, dropout_p=self.p,
                              training=self.training)
        return self.resid_dropout(self.c_proj(y))


class Block(Module):
    """GPT-2 transformer block (pre-LN): x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, n_embd, n_head, dropout=0.0):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 32   # the longest context
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = False


class GPTEmbedding(Module):
    """ids (B, T) -> wte[ids] + wpe[0..T-1], then dropout: the first pipeline stage."""

    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout)

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        T = ids.shape[-1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}")
        pos = backend.get_array_module(ids).arange(T)
        return self.drop(self.wte(ids) + self.wpe(pos))


class GPT(Module):
    """``logits, loss = model(ids, targets)``; loss is None without targets.

    ``model.to_sequential()`` gives the same modules as one flat ``Sequential`` (embedding,
    blocks, final LayerNorm, head) that maps ids to logits, for checkpointing and pipelining.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = GPTEmbedding(config)
        self.blocks = Sequential(*[Block(config.n_embd, config.n_head, config.dropout)
                                   for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_gpt2()
        if config.tie_weights:
            self.lm_head.weight = self.embed.wte.weight

    def _init_gpt2(self):
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.data[...] = 0
            elif p.ndim == 2:  # Linear and Embedding weights (LayerNorm keeps its ones)
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.data = init.normal(p.shape, std, p.dtype)

    def to_sequential(self):
        return Sequential(self.embed, *self.blocks, self.ln_f, self.lm_head)

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        x = self.blocks(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss

    def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None):
        return generate(self, ids, max_new_tokens, temperature, top_k)


def generate(model, ids, max_new_tokens, temperature=1.0, top_k=None):
    """Extend ``ids`` (B, T) by sampling one token at a time from softmax(logits / temperature),
    optionally from the ``top_k`` most likely only; the context is cropped to block_size.
    Sampling draws on the host from ``minipar.random``; the model is in eval mode meanwhile."""
    host = backend.get_array_module()  # the module of no arrays: NumPy
    ids = backend.to_numpy(ids.data if isinstance(ids, Tensor) else ids)
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            for _ in range(max_new_tokens):
                context = backend.asarray(ids[:, -model.config.block_size:])
                logits, _ = model(context)
                z = backend.to_numpy(logits.data[:, -1, :]).astype("float64") / temperature
                if top_k is not None:
                    kth = host.sort(z, axis=-1)[:, -min(top_k, z.shape[-1])][:, None]
                    z = host.where(z < kth, -host.inf, z)
                p = host.exp(z - z.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                u = random.generator(host).random((len(p), 1))
                nxt = (p.cumsum(axis=-1) < u).sum(axis=-1, keepdims=True).clip(max=p.shape[-1] - 1)
                ids = host.concatenate([ids, nxt.astype(ids.dtype)], axis=1)
    finally:
        model.train(was_training)
    return ids
