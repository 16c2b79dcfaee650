"""Fused neural-network functions (``minipar.functional``, imported as ``F`` like PyTorch's).

Each could be written from the ops in ``ops.py``; written whole, its backward is one formula
instead of a chain of small ones, which is faster and saves fewer arrays. Each docstring gives the
formula its backward implements.

torch's argument forms work too (``_torch_*`` below): ``layer_norm(x, normalized_shape, weight,
bias, eps)``, ``softmax(x, dim=)``, ``cross_entropy(input, target, weight, ..., reduction=)``
with torch's (N, C, d...) layout, ``dropout(x, p, training, inplace=False)`` and
``scaled_dot_product_attention(q, k, v, is_causal=True)``; ``relu``, ``nll_loss`` and
``max_pool2d`` are torch's own (its tutorials' MNIST net runs on them). The losses live in
``losses.py``, torch's arguments and all.
"""
import functools
import math
import numbers
import operator

from . import backend, ops, random
from .attention import (attention_heads, causal_self_attention, causal_softmax,  # noqa: F401
                        scaled_dot_product_attention)
from .amp.autocast_mode import to_float32, to_lower_precision
from .autograd import as_tensor, make_result
from .losses import (binary_cross_entropy_with_logits, cross_entropy, kept_targets,  # noqa: F401
                     l1_loss, mse_loss, nll_loss)
from .sums import sum_last, sum_rows


def _xp(a):
    return backend.get_array_module(a)


def _is_shape(value):
    return isinstance(value, numbers.Integral) or (
        isinstance(value, (tuple, list)) and all(isinstance(n, numbers.Integral) for n in value))


def _torch_dim(fn):
    """Also take torch's ``dim=`` (and ``dtype=``, the input cast first) for ``axis``."""
    @functools.wraps(fn)
    def call(x, axis=-1, *, dim=None, dtype=None):
        if dtype is not None:
            x = as_tensor(x).astype(dtype)
        return fn(x, axis if dim is None else dim)
    del call.__wrapped__  # the signature shown is this one
    return call


def _torch_layer_norm(fn):
    """Also take torch's form ``layer_norm(x, normalized_shape, weight, bias, eps)``; a
    normalized_shape of several trailing axes normalises over them together."""
    @functools.wraps(fn)
    def layer_norm(x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
        if not _is_shape(normalized_shape):  # minipar's layer_norm(x, weight, bias, eps)
            if isinstance(bias, numbers.Real):  # eps given third: a bias is never a number
                eps, bias = bias, None
            if normalized_shape is not None:  # the weight given second
                weight, bias = normalized_shape, (bias if weight is None else weight)
            return fn(x, weight, bias, eps)
        x = as_tensor(x)
        shape = ((normalized_shape,) if isinstance(normalized_shape, numbers.Integral)
                 else tuple(normalized_shape))
        if tuple(x.shape[x.ndim - len(shape):]) != shape or not shape:
            raise ValueError(f"layer_norm: normalized_shape {shape} is not the trailing shape "
                             f"of the input {x.shape}")
        if len(shape) == 1:
            return fn(x, weight, bias, eps)
        flat = (lambda t: None if t is None else as_tensor(t).reshape(-1))
        y = fn(x.reshape(x.shape[:x.ndim - len(shape)] + (-1,)), flat(weight), flat(bias), eps)
        return y.reshape(x.shape)
    del layer_norm.__wrapped__
    return layer_norm


@_torch_dim
def softmax(x, axis=-1):
    """y = exp(x − max) / Σ exp(x − max);  dx = y ⊙ (g − Σ g⊙y)."""
    x = to_float32(as_tensor(x))
    xp = _xp(x.data)
    e = xp.exp(x.data - x.data.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)

    def backward(g):
        return (y * (g - (g * y).sum(axis=axis, keepdims=True)),)

    return make_result(y, (x,), backward, "softmax")


def _logsumexp(a, axis):
    xp = _xp(a)
    m = a.max(axis=axis, keepdims=True)
    return m + xp.log(xp.exp(a - m).sum(axis=axis, keepdims=True))


@_torch_dim
def log_softmax(x, axis=-1):
    """y = x − logsumexp(x);  dx = g − softmax(x) ⊙ Σ g."""
    x = to_float32(as_tensor(x))
    xp = _xp(x.data)
    y = x.data - _logsumexp(x.data, axis)

    def backward(g):
        return (g - xp.exp(y) * g.sum(axis=axis, keepdims=True),)

    return make_result(y, (x,), backward, "log_softmax")


def relu(input, inplace=False):
    """max(x, 0), torch's F.relu (``Tensor.relu``'s op). ``inplace=True`` is refused, as in
    dropout: autograd keeps x, so the result is a new tensor."""
    if inplace:
        raise ValueError("relu: inplace=True is not supported; write y = relu(x)")
    return as_tensor(input).relu()


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    """torch's F.max_pool2d: the pool of ``nn.functional_conv``, where the window ops live."""
    from .nn import functional_conv  # here, not at the top: minipar.nn imports this module
    return functional_conv.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode,
                                      return_indices)


def gelu(x, approximate="tanh"):
    """GeLU, tanh form (GPT-2): y = ½x(1 + tanh u), u = √(2/π)(x + 0.044715x³).

    With s = ½(1 + tanh u) = σ(2u): y = x·s, dy/dx = s + 2x·s(1 − s)·u',
    u' = √(2/π)(1 + 3·0.044715x²). The intermediates are updated in place.
    """
    if approximate != "tanh":
        raise ValueError(f"gelu: only approximate='tanh' is implemented (got {approximate!r})")
    x = as_tensor(x)
    xp = _xp(x.data)
    a = x.data
    c, k = math.sqrt(2 / math.pi), 0.044715
    z = a * a  # (a ** 3 would call the slow general power function)
    z *= c * k
    z += c
    z *= a  # z = u
    if backend.is_low_precision(a.dtype):  # in 16 bits 1 + tanh u would cancel for u < 0:
        z *= -2  # σ(2u) = 1 / (1 + e^(−2u)) instead
        xp.minimum(z, _exp_limit(a.dtype), out=z)  # e^(−2u) stays finite: σ → 0 as it should
        xp.exp(z, out=z)
        z += 1
        s = xp.reciprocal(z, out=z)
    else:  # one tanh (vectorised in NumPy, as torch's CPU kernel computes it) costs less
        s = xp.tanh(z, out=z)
        s += 1
        s *= 0.5  # σ(2u)
    y = a * s

    def backward(g):
        # x·s(1 − s) = y(1 − s): y is kept anyway where the next layer keeps its input (GPT's
        # c_proj), and it saves a pass over x
        d = a * a
        d *= 6 * c * k
        d += 2 * c  # 2u'
        r = 1 - s
        r *= y
        d *= r
        d += s
        d *= g
        return (d,)

    return make_result(y, (x,), backward, "gelu")


def _exp_limit(dtype):
    """The largest z with e^z comfortably finite in ``dtype`` (80 for float32)."""
    return 0.9 * math.log(float(backend.finfo(dtype).max))


def dropout(x, p=0.5, training=True, inplace=False):
    """Zero each element with probability p, scale the rest by 1/(1−p) (inverted dropout).

    The mask comes from ``minipar.random``, so a checkpointed re-run draws the same mask.
    ``inplace=True`` (torch's) is refused: autograd keeps x, so the result is a new tensor.
    """
    if inplace:
        raise ValueError("dropout: inplace=True is not supported; write y = dropout(x, p, "
                         "training)")
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    x = as_tensor(x)
    if not training or p == 0:
        return x
    xp = _xp(x.data)
    mask = (random.generator(xp).random(x.shape) >= p) * x.data.dtype.type(1 / (1 - p))
    mask = mask.astype(x.dtype, copy=False)
    return make_result(x.data * mask, (x,), lambda g: (g * mask,), "dropout")


@_torch_layer_norm
def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Normalise over the last axis: x̂ = (x − μ)/√(σ² + ε), y = x̂·w + b.

    dx = (1/σ̂)·(ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)) with ĝ = g⊙w;  dw = Σ g⊙x̂;  db = Σ g.
    """
    x, weight, bias = to_float32(as_tensor(x), weight, bias)
    xp = _xp(x.data)
    inv_n = 1.0 / x.shape[-1]
    mu = sum_last(x.data)
    mu *= inv_n
    xhat = x.data - mu  # x − μ, normalised in place below
    rstd = sum_last(xhat * xhat)
    rstd *= inv_n
    rstd += eps
    rstd = 1 / xp.sqrt(rstd, out=rstd)
    xhat *= rstd
    if weight is None:
        y = xhat if bias is None else xhat + bias.data
    else:
        y = xhat * weight.data
        if bias is not None:
            y += bias.data
    parents = [p for p in (x, weight, bias) if p is not None]
    w = None if weight is None else weight.data
    has_bias = bias is not None

    def backward(g):
        ### BEGIN SOLUTION layer-norm
        gxhat = g * w if w is not None else g.copy()  # ĝ, then dx in place
        mean_g = sum_last(gxhat)
        mean_g *= inv_n
        mean_gx = sum_last(gxhat * xhat)
        mean_gx *= inv_n
        gxhat -= mean_g
        gxhat -= xhat * mean_gx
        gxhat *= rstd
        grads = [gxhat]
        if w is not None:
            grads.append(sum_rows(g * xhat))
        if has_bias:
            grads.append(sum_rows(g))
        return grads
        ### END SOLUTION

    return make_result(y, parents, backward, "layer_norm")


def linear(x, weight, bias=None):
    """y = x Wᵀ + b with W of shape (out, in), as in PyTorch.

    dx = g W;  dW = gᵀ x (over all batch rows);  db = Σ g. 16-bit operands: each product in
    float32 rounded once (``ops.low_precision``), the bias added before that rounding, as a GEMM's
    epilogue adds it (torch's bf16 linear too, bit for bit).
    """
    x, weight, bias = to_lower_precision(as_tensor(x), weight, bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features (shape {x.shape}) but the "
                         f"weight of shape {weight.shape} expects {weight.shape[1]}")
    xd, wd = x.data, weight.data
    x2 = xd.reshape(-1, xd.shape[-1])  # all batch rows as one matrix: one BLAS call, not many
    y = ops.low_precision(_affine, x2, wd, None if bias is None else bias.data)
    y = y.reshape(xd.shape[:-1] + (wd.shape[0],))
    parents = (x, weight) if bias is None else (x, weight, bias)
    needs = tuple(p.requires_grad for p in parents)

    def backward(g, only=needs):  # a split backward (graph.py): dx in B, dW and db in W
        g2 = g.reshape(-1, g.shape[-1])
        dx = ops.low_precision(operator.matmul, g2, wd).reshape(xd.shape) if only[0] else None
        grads = [dx, ops.low_precision(operator.matmul, g2.T, x2) if only[1] else None]
        if len(only) == 3:
            grads.append(ops.low_precision(sum_rows, g2) if only[2] else None)
        return grads

    return make_result(y, parents, backward, "linear", split="only")


def _affine(x, w, b):
    y = x @ w.T
    if b is not None:
        y += b
    return y
