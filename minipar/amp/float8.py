"""FP8 training: the scaled FP8 matmul, ``Float8Linear`` and torchao's model conversion.

    convert_to_float8_training(model, recipe="blockwise")   # its Linears become Float8Linear
    scaled_mm(a, a_scale, b, b_scale)    # (a·a_scale) @ (b·b_scale), summed in float32

An FP8 GEMM multiplies 8-bit operands exactly, adds in float32 and applies the scales after
(torch._scaled_mm). Float8Linear (torchao's; Micikevicius et al. 2022) quantises its three
GEMMs' operands on the fly: e4m3 for activations and weights, e5m2 for gradients (torchao's
default); the weight stays a high-precision Parameter, so the optimizer keeps its update (and an
fp32 master of a bf16 weight). Recipes (float8_recipes.py): "tensorwise" (torchao), "delayed"
(Transformer Engine), "blockwise" (DeepSeek-V3: 1x128 tiles, 128x128 weight blocks), "mxfp8"
(OCP MX). DeepSeek-V3 §3.3 adds the K-chunks' partial sums into float32 every 128 elements
(``promote_every=128``), as its GEMM must when scales change along K. docs/float8.md
"""
from .. import backend
from ..autograd import as_tensor, make_result
from ..backend import dtypes
from ..nn.layers import Linear
from ..nn.module import Module
from .autocast_mode import active_dtype
from .float8_recipes import (DelayedScaling, Quantized, expand, float8_dtype, quantize_blocks,
                             quantize_mx, quantize_tensorwise, quantize_tiles)

FLOAT32 = dtypes.float32


def _block(x, scale, block, name):
    """The block shape of operand ``name``: given, or the whole array for a single scale (a
    scale's shape alone cannot say: 300 columns in 3 tiles are 128 + 128 + 44, or 3 x 100)."""
    if block is not None:
        return tuple(block)
    if scale.size == 1:
        return tuple(x.shape)
    raise ValueError(f"scaled_mm: {name} has a scale of shape {scale.shape} for data of shape "
                     f"{x.shape}: pass {name}_block, the block shape its quantiser returned")


def _chunk(k, sizes):
    """The K-chunk every scale is constant over: the smallest block or promotion interval."""
    sizes = [s for s in sizes if s is not None and s < k]
    chunk = min(sizes, default=k)
    if any(s % chunk for s in sizes):
        raise ValueError(f"scaled_mm: the blocks along K and promote_every ({sizes}) must be "
                         f"multiples of one another")
    return chunk


def scaled_mm(a, a_scale, b, b_scale, *, a_block=None, b_block=None, bias=None,
              out_dtype="float32", promote_every=None):
    """(a·a_scale) @ (b·b_scale) for FP8 a (M, K) and b (K, N) with their scales (a scalar, or
    one per block of shape ``a_block``, ``b_block``: a Quantized's ``block``). The products
    of each K-chunk over which the scales are constant are summed in float32, scaled, and
    added into a float32 accumulator; ``promote_every`` (DeepSeek's 128) cuts K into chunks of
    that size too. ``bias`` is added in float32 before the one rounding to ``out_dtype``."""
    xp = backend.get_array_module(a, b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm: expected a (M, K) and b (K, N), got {a.shape} and "
                         f"{b.shape}")
    for name, x in (("a", a), ("b", b)):
        float8_dtype(x.dtype, f"scaled_mm: {name}")
    a_scale, b_scale = (xp.asarray(s).astype(FLOAT32) for s in (a_scale, b_scale))
    a_block, b_block = _block(a, a_scale, a_block, "a"), _block(b, b_scale, b_block, "b")
    k = a.shape[1]
    chunk = _chunk(k, (a_block[1], b_block[0], promote_every))
    sa, sb = expand(a_scale, a_block, a.shape), expand(b_scale, b_block, b.shape)
    a32, b32 = a.astype(FLOAT32), b.astype(FLOAT32)
    out = xp.zeros((a.shape[0], b.shape[1]), FLOAT32)
    for k0 in range(0, k, chunk):
        part = a32[:, k0:k0 + chunk] @ b32[k0:k0 + chunk]  # exact products, float32 sums
        out += part * (sa if sa.ndim == 0 else sa[:, k0:k0 + 1]) * (
            sb if sb.ndim == 0 else sb[k0:k0 + 1])
    if bias is not None:
        out += bias.astype(FLOAT32)
    return out.astype(backend.check_dtype(out_dtype))


# --- recipes: for each operand role, a quantiser ``q(x, axis)`` along the contraction axis ---
def _tensorwise(role, dtype):
    return lambda x, axis: quantize_tensorwise(x, dtype)


def _delayed(role, dtype):
    return DelayedScaling(dtype)  # one amax history per tensor, as TE keeps


def _blockwise(role, dtype):
    if role == "weight":
        return lambda x, axis: quantize_blocks(x, dtype)
    return lambda x, axis: quantize_tiles(x, dtype, axis=axis)


def _mxfp8(role, dtype):
    return lambda x, axis: quantize_mx(x, dtype, axis=axis)


RECIPES = {"tensorwise": _tensorwise, "delayed": _delayed, "blockwise": _blockwise,
           "mxfp8": _mxfp8}


def _recipe(recipe):
    if callable(recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}: choose one of {', '.join(RECIPES)} "
                         f"(or pass a function (role, dtype) -> quantiser)")
    return RECIPES[recipe]


def _for_contraction(q, x, axis, quantise):
    """q as an operand contracted over ``axis``: as it is unless its scales change element by
    element along that axis, then quantised again along it from x (TE quantises rowwise and
    columnwise; DeepSeek re-quantises its 1x128 tiles as 128x1)."""
    if q.block[axis] == 1 and x.shape[axis] > 1:
        return quantise(x, axis)
    return q


def _t(q):
    scale = q.scale if q.scale.ndim == 0 else q.scale.T
    return Quantized(q.data.T, scale, q.block[::-1])


def _mm(qa, qb, promote_every, out_dtype=FLOAT32, bias=None):
    return scaled_mm(qa.data, qa.scale, qb.data, qb.scale, a_block=qa.block, b_block=qb.block,
                     bias=bias, out_dtype=out_dtype, promote_every=promote_every)


class Float8Linear(Module):
    """A Linear whose three GEMMs run in FP8: y = x Wᵀ + b with x and W quantised (e4m3),
    dx = g W and dW = gᵀ x with g quantised (e5m2), each product by ``scaled_mm``; the bias
    and its gradient stay in high precision. y is in autocast's dtype when autocast is on
    (torchao's rule), else in x's. The input is kept for backward as FP8 (1 byte an element)."""

    def __init__(self, in_features, out_features, bias=True, recipe="tensorwise",
                 dtype="float32", promote_every=None, grad_dtype="float8_e5m2"):
        super().__init__()
        self._set(Linear(in_features, out_features, bias, dtype), recipe, promote_every,
                  grad_dtype)

    def _set(self, linear, recipe, promote_every, grad_dtype):
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        make = _recipe(recipe)
        self.recipe, self.promote_every = recipe, promote_every
        e4m3, e5m2 = dtypes.float8_e4m3fn, float8_dtype(grad_dtype, "Float8Linear")
        self._quantise = {"input": make("input", e4m3), "weight": make("weight", e4m3),
                          "grad_output": make("grad_output", e5m2)}

    @classmethod
    def from_float(cls, linear, recipe="tensorwise", promote_every=None,
                   grad_dtype="float8_e5m2"):
        """The Float8Linear of ``linear``, sharing its Parameters (torchao's from_float)."""
        module = cls.__new__(cls)
        Module.__init__(module)
        module._set(linear, recipe, promote_every, grad_dtype)
        return module

    def forward(self, x):
        q_in, q_w, q_g = (self._quantise[r] for r in ("input", "weight", "grad_output"))
        x, w = as_tensor(x), self.weight.data
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Float8Linear: input has {x.shape[-1]} features (shape {x.shape}) "
                             f"but the layer expects {self.in_features}")
        shape, x_dtype, promote = x.shape, x.data.dtype, self.promote_every
        x2 = x.data.reshape(-1, shape[-1])
        qx, qw = q_in(x2, -1), q_w(w, 1)
        out_dtype = active_dtype() or x_dtype
        bias = None if self.bias is None else self.bias.data
        y = _mm(qx, _t(qw), promote, out_dtype, bias).reshape(shape[:-1] + (w.shape[0],))
        # saved for the weight gradient, where the tokens are the contraction axis
        qx = _for_contraction(qx, x2, 0, q_in)
        parents = (x, self.weight) if self.bias is None else (x, self.weight, self.bias)
        bias_dtype = None if bias is None else bias.dtype  # (the closure keeps no bf16 input)

        def backward(g):
            g2 = g.reshape(-1, g.shape[-1])
            qg = q_g(g2, -1)
            dx = _mm(qg, _for_contraction(qw, w, 0, q_w), promote, x_dtype)
            dw = _mm(_t(_for_contraction(qg, g2, 0, q_g)), qx, promote, w.dtype)
            grads = [dx.reshape(shape), dw]
            if bias_dtype is not None:
                grads.append(g2.astype(FLOAT32).sum(axis=0).astype(bias_dtype))
            return grads

        return make_result(y, parents, backward, "float8_linear")

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}")


def convert_to_float8_training(module, *, recipe="tensorwise", module_filter_fn=None,
                               promote_every=None, grad_dtype="float8_e5m2"):
    """Swap every ``Linear`` of ``module`` for a Float8Linear with the same Parameters (call
    it before making the optimizer, as torchao says); the rest of the model keeps its dtype.
    ``module_filter_fn(mod, fqn)`` (torchao's) says which Linears to convert. Returns module."""
    _recipe(recipe)
    if isinstance(module, Linear):
        return Float8Linear.from_float(module, recipe, promote_every, grad_dtype)
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if type(child) is Linear and (module_filter_fn is None
                                          or module_filter_fn(child, fqn)):
                setattr(parent, child_name, Float8Linear.from_float(
                    child, recipe, promote_every, grad_dtype))
    return module

