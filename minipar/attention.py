"""Causal self-attention, fused (``minipar.functional`` re-exports every public name here).

With S = q kᵀ, a scale s = 1/√d and the causal mask M (M_ij = −∞ for j > i, else 0):

    P = softmax(s·S + M) (then dropout: P̃ = P ⊙ D),   O = P̃ v
    dv = P̃ᵀ dO;  dP = (dO vᵀ) ⊙ D;  dS = s · P ⊙ (dP − Σ_j dP⊙P);  dq = dS k;  dk = dSᵀ q

Three passes are fused. ``causal_softmax`` is the middle line's scale + mask + softmax as one
function (Megatron's FusedScaleMaskSoftmax): the mask is added, not written by boolean
indexing, and forward and backward each work in place in one array of scores. ``attention_heads``
takes the heads straight from c_attn's output (B, T, 3C): q, k and v are strided views of it,
the output is written with its heads already side by side (B, T, C), and backward writes dq, dk
and dv into one (B, T, 3C) gradient: no split, no permute copy, no gradient summed from three
slices. ``causal_self_attention`` is the same kernel on q, k, v given apart (B, H, T, d).
"""
import math

from . import backend, ops, random
from .amp.autocast_mode import to_float32, to_lower_precision
from .autograd import as_tensor, make_result
from .sums import max_last, sum_last

_MASKS = {}  # (array module, T, dtype) -> M, made once


def causal_mask(xp, T, dtype):
    """M (T, T): 0 on and below the diagonal, −∞ above it (position i sees positions j ≤ i)."""
    key = (xp.__name__, T, str(dtype))
    if key not in _MASKS:
        _MASKS[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _MASKS[key]


def exp_scores(s, scale):
    """E = exp(scale·S + M − max) over the last axis, written over S (a fresh array of scores)."""
    xp = backend.get_array_module(s)
    s *= scale
    s += causal_mask(xp, s.shape[-1], s.dtype)
    s -= max_last(s)  # the diagonal is never masked: every row max is finite
    return xp.exp(s, out=s)


def softmax_forward(s, scale):
    """P = softmax(scale·S + M) = E / Σ_j E over the last axis, written over S."""
    e = exp_scores(s, scale)
    e /= sum_last(e)
    return e


def softmax_backward(p, gp, scale):
    """dS = scale · P ⊙ (dP − Σ_j dP⊙P), written over dP (a fresh array)."""
    rows = sum_last(gp * p)
    gp -= rows
    gp *= p
    gp *= scale
    return gp


def causal_softmax(x, scale=1.0):
    """y = softmax(scale·x + M) over the last axis, M the causal mask of the last two axes
    (a square T × T block): the scores of causal attention, scaled, masked and normalised in
    one function.  dx = scale · y ⊙ (g − Σ g⊙y)."""
    x = to_float32(as_tensor(x))  # a softmax: float32 under autocast
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"causal_softmax: the last two axes must be a square (T, T) block of "
                         f"scores, got shape {x.shape}")
    y = softmax_forward(x.data.copy(), scale)
    return make_result(y, (x,), lambda g: (softmax_backward(y, g.copy(), scale),),
                       "causal_softmax")


def _dropout_mask(xp, p, dropout_p, training):
    """D: 1/(1−p) where kept, 0 where dropped (None when nothing is dropped)."""
    if not (training and dropout_p > 0):
        return None
    keep = random.generator(xp).random(p.shape) >= dropout_p
    return keep.astype(p.dtype) / (1 - dropout_p)


# 16-bit q, k, v: every product takes 16-bit operands and sums in float32, as FlashAttention
# (Dao 2023) and torch's fused kernels do. What stays inside the kernel (the scores S, the row
# sums, dP) stays float32, and the softmax runs in float32; what enters a product (E, dS) or
# leaves the kernel (O, dq, dk, dv) is rounded once to the 16-bit dtype. Rounding S too (as
# unfused autocast code does) would move O by more than one bf16 ulp from torch's SDPA.
def _forward(q, k, v, dropout_p, training, out=None):
    """O (into ``out`` if given), P and the dropout mask D, for q, k, v of shape (..., T, d)."""
    xp = backend.get_array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = ops.upcast(q) @ ops.upcast(k).swapaxes(-1, -2)
    if not backend.is_low_precision(v.dtype):
        p = softmax_forward(s, scale)
        mask = _dropout_mask(xp, p, dropout_p, training)
        pd = p if mask is None else p * mask
        return xp.matmul(pd, v, out=out), p, mask
    # FlashAttention's order: the weights E rounded for the product, their sum l divided after it
    e = exp_scores(s, scale)
    mask = _dropout_mask(xp, e, dropout_p, training)
    total = sum_last(e)
    ed = (e if mask is None else e * mask).astype(v.dtype)
    o = ops.low_precision(lambda a, b: xp.matmul(a, b) / total, ed, v, out=out)
    e /= total
    return o, e, mask


def _backward(g, q, k, v, p, mask, out=(None, None, None)):
    """(dq, dk, dv), each into its ``out`` array if given."""
    xp = backend.get_array_module(g)
    scale = 1.0 / math.sqrt(q.shape[-1])
    pd = p if mask is None else p * mask
    dv = ops.low_precision(xp.matmul, pd.astype(g.dtype, copy=False).swapaxes(-1, -2), g,
                           out=out[2])
    gp = ops.upcast(g) @ ops.upcast(v).swapaxes(-1, -2)
    if mask is not None:
        gp *= mask
    gs = softmax_backward(p, gp, scale).astype(q.dtype, copy=False)
    return (ops.low_precision(xp.matmul, gs, k, out=out[0]),
            ops.low_precision(xp.matmul, gs.swapaxes(-1, -2), q, out=out[1]), dv)


def causal_self_attention(q, k, v, dropout_p=0.0, training=True):
    """softmax(q kᵀ/√d + M) v for q, k, v of one shape (batch, heads, T, d); the formulas are
    the module's docstring's."""
    q, k, v = to_lower_precision(as_tensor(q), as_tensor(k), as_tensor(v))
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ValueError(f"causal_self_attention: q, k, v must share one (batch, heads, T, d) "
                         f"shape, got {q.shape}, {k.shape}, {v.shape}")
    qd, kd, vd = q.data, k.data, v.data
    out, p, mask = _forward(qd, kd, vd, dropout_p, training)
    return make_result(out, (q, k, v), lambda g: _backward(g, qd, kd, vd, p, mask), "attention")


def attention_heads(qkv, n_head, dropout_p=0.0, training=True):
    """Multi-head causal self-attention from c_attn's output ``qkv`` (B, T, 3C), laid out
    [q | k | v] with each C = n_head · d split head by head, to the heads side by side (B, T, C):
    what ``reshape(B, T, 3, H, d).permute(2, 0, 3, 1, 4)``, ``causal_self_attention`` and
    ``permute(0, 2, 1, 3).reshape(B, T, C)`` compute, without their copies."""
    qkv = to_lower_precision(as_tensor(qkv))
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"attention_heads: qkv must have shape (B, T, 3·C) with C divisible by "
                         f"n_head={n_head}, got {qkv.shape}")
    xp = backend.get_array_module(qkv.data)
    B, T, C3 = qkv.shape
    d = C3 // (3 * n_head)

    def heads(a):  # (B, T, 3, H, d) -> three (B, H, T, d) views: q, k, v
        return [a[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]

    q, k, v = heads(qkv.data.reshape(B, T, 3, n_head, d))
    y = xp.empty((B, T, n_head, d), qkv.dtype)
    _, p, mask = _forward(q, k, v, dropout_p, training, out=y.transpose(0, 2, 1, 3))

    def backward(g):
        grad = xp.empty((B, T, 3, n_head, d), g.dtype)
        _backward(g.reshape(B, T, n_head, d).transpose(0, 2, 1, 3), q, k, v, p, mask,
                  out=heads(grad))
        return (grad.reshape(B, T, C3),)

    return make_result(y.reshape(B, T, C3 // 3), (qkv,), backward, "attention")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch's name and signature for ``causal_self_attention``: is_causal=True, no attn_mask,
    the default scale 1/√d, q, k, v of one (batch, heads, T, d) shape; dropout applies whenever
    dropout_p > 0, as in torch."""
    d = query.shape[-1]
    if not is_causal or attn_mask is not None or enable_gqa or (
            scale is not None and not math.isclose(scale, 1 / math.sqrt(d))):
        raise NotImplementedError("scaled_dot_product_attention: only is_causal=True without "
                                  "attn_mask, enable_gqa or a scale other than 1/sqrt(d)")
    return causal_self_attention(query, key, value, dropout_p=dropout_p, training=True)
