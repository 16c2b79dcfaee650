"""FP8 scaling recipes: how a tensor becomes FP8 data and one scale per block.

    q = quantize_tiles(x, "float8_e4m3fn")   # DeepSeek-V3's 1x128 tiles: q.scale (M, K/128)
    dequantize(q)                            # float32: x to within e4m3's 2^-4 relative error

One convention for all: x ≈ data · scale, each block's scale over its block (``q.block``): the
scale torch._scaled_mm takes and Transformer Engine stores as scale_inv. The sources:
tensorwise, torchao.float8 (amax_to_scale); DelayedScaling, NVIDIA Transformer Engine
(delayed_scaling.cu); tiles and blocks, the DeepSeek-V3 report §3.3 with DeepGEMM's casts
(per_token_cast_to_fp8, per_block_cast_to_fp8); MX, the OCP Microscaling spec v1.0 §6.3 as
torchao's to_mx implements it. Each saturates to the format's ±max, as their casts do.
Everything here is in docs/float8.md, with what zero, inf and NaN do under each recipe.
"""
from typing import NamedTuple

import numpy

from .. import backend
from ..autograd import Tensor
from ..backend import dtypes

FLOAT32 = dtypes.float32


class Quantized(NamedTuple):
    """FP8 ``data``, float32 (MX: E8M0) ``scale`` of shape ceil(data.shape / block), and the
    ``block`` shape (one size per axis; a size-1 axis of scale covers the whole axis)."""
    data: object
    scale: object
    block: tuple


def float8_dtype(name, where="quantize"):
    """The FP8 dtype ``name`` resolves to; a ValueError naming ``where`` for any other."""
    d = backend.check_dtype(name)
    if d not in dtypes.FLOAT8:
        raise ValueError(f"{where}: dtype must be float8_e4m3fn or float8_e5m2, got {d}")
    return d


def _float32(x, where):
    if isinstance(x, Tensor):  # its array: quantising is not differentiated (Float8Linear is)
        x = x.data
    if not dtypes.is_floating(x.dtype):
        raise TypeError(f"{where}: expected a floating-point array, got {x.dtype}")
    return x.astype(FLOAT32)


def saturate(x, d):
    """x (float32) in FP8 dtype ``d``: clamped to ±max first, the cast every source uses
    (torchao's to_fp8_saturated, TE's and DeepGEMM's saturating casts); NaN stays NaN."""
    fmax = float(dtypes.finfo(d).max)
    return backend.cast(x.clip(-fmax, fmax), d)


def _block_amax(x, block):
    """max |x| over each block (one size per axis), an array of shape ceil(x.shape / block):
    the last blocks partial (padded with zeros, as DeepGEMM pads); NaN propagates (torch.amax's
    rule)."""
    xp = backend.get_array_module(x)
    ### BEGIN SOLUTION fp8-tile-scale
    counts = [-(-n // b) for n, b in zip(x.shape, block)]
    pad = [(0, c * b - n) for n, b, c in zip(x.shape, block, counts)]
    a = xp.abs(x)
    if any(p for _, p in pad):
        a = xp.pad(a, pad)
    a = a.reshape([v for c, b in zip(counts, block) for v in (c, b)])
    return a.max(axis=tuple(range(1, 2 * x.ndim, 2)))
    ### END SOLUTION


def expand(scale, block, shape):
    """Each block's scale repeated over its elements (a single scale stays a scalar)."""
    xp = backend.get_array_module(scale)
    if scale.size == 1:
        return scale.reshape(())
    for axis, b in enumerate(block):
        if b > 1:
            scale = xp.repeat(scale, b, axis=axis)
    return scale[tuple(slice(0, n) for n in shape)]


def _along(x, size, axis, where):
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{where}: axis {axis} is not an axis of a {x.ndim}-d array")
    if size < 1:
        raise ValueError(f"{where}: block size must be at least 1, got {size}")
    block = [1] * x.ndim
    block[axis] = size
    return tuple(block)


def tensorwise_scale(amax, dtype):
    """torchao's amax_to_scale: s = fmax / max(amax, 1e-12), computed in float64 and rounded to
    float32; the multiplier x · s is cast with, 1 / s its scale. Given an amax all ranks agreed
    on (an all-reduce under max: the FP8 DDP hook, ZeRO-3's FP8 all-gather), all cast alike."""
    fmax = float(dtypes.finfo(dtype).max)
    with numpy.errstate(divide="ignore"):  # an inf amax: s = 0, and every value reads back NaN
        return (fmax / amax.astype(dtypes.float64).clip(1e-12, None)).astype(FLOAT32)


def quantize_tensorwise(x, dtype="float8_e4m3fn"):
    """torchao's tensorwise current scaling: s = tensorwise_scale(amax); data = saturate(x · s);
    scale = 1 / s. amax 0: s is fmax / 1e-12, data all zero; an inf gives s = 0 and NaN
    everywhere; a NaN, NaN everywhere."""
    d = float8_dtype(dtype, "quantize_tensorwise")
    x = _float32(x, "quantize_tensorwise")
    s = tensorwise_scale(backend.get_array_module(x).abs(x).max(), d)
    with numpy.errstate(divide="ignore", invalid="ignore"):  # amax inf: s = 0, 1 / s = inf
        return Quantized(saturate(x * s, d), FLOAT32.type(1) / s, tuple(x.shape))


class DelayedScaling:
    """Transformer Engine's delayed scaling for one tensor: quantise with the scale computed
    from the amax of past steps, then record this step's amax and update (TE's
    amax_and_scale_update): amax = max of the last ``amax_history_len`` amaxes (NaN ignored,
    fmaxf's rule) or the most recent; scale = fmax · 2^-margin / amax, kept as it was when that
    amax is 0, inf or NaN. Starts at scale 1, TE's. ``scaling(x)`` returns a Quantized."""

    def __init__(self, dtype="float8_e4m3fn", amax_history_len=1024, amax_compute_algo="max",
                 margin=0):
        self.dtype = float8_dtype(dtype, "DelayedScaling")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {amax_compute_algo!r}")
        if int(amax_history_len) < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be at least 1, got "
                             f"{amax_history_len}")
        self.algo, self.margin = amax_compute_algo, margin
        self.amax_history = backend.xp().zeros(int(amax_history_len), FLOAT32)
        self.scale = FLOAT32.type(1)

    def __call__(self, x, axis=None):
        """Quantise x (``axis`` ignored: one scale for the tensor) and update the scale."""
        x = _float32(x, "DelayedScaling")
        q = Quantized(saturate(x * self.scale, self.dtype), FLOAT32.type(1) / self.scale,
                      tuple(x.shape))
        self.amax_history[0] = backend.get_array_module(x).abs(x).max()
        self._update()
        return q

    def _update(self):
        xp = backend.get_array_module(self.amax_history)
        history, last = self.amax_history, self.amax_history[0]
        amax = last if self.algo == "most_recent" else xp.where(
            xp.isnan(history), 0, history).max()
        if xp.isfinite(amax) and amax > 0:
            self.scale = FLOAT32.type(float(dtypes.finfo(self.dtype).max) * 2.0**-self.margin) / amax
        # roll: the oldest drops out, this step's moves to the end, slot 0 waits for the next
        self.amax_history = xp.concatenate([xp.zeros(1, FLOAT32), history[2:], history[:1]])[
            :len(history)]


def _deepseek(x, d, block):
    """DeepGEMM's casts: amax clamped at 1e-4, data = x · (fmax / amax), scale = amax / fmax."""
    ### BEGIN SOLUTION fp8-tile-scale
    fmax = FLOAT32.type(float(dtypes.finfo(d).max))
    amax = backend.get_array_module(x).maximum(_block_amax(x, block), FLOAT32.type(1e-4))
    with numpy.errstate(invalid="ignore"):  # an inf in a block: that block's data is NaN
        data = saturate(x * expand(fmax / amax, block, x.shape), d)
    return Quantized(data, amax / fmax, block)
    ### END SOLUTION


def quantize_tiles(x, dtype="float8_e4m3fn", tile=128, axis=-1):
    """DeepSeek-V3 §3.3 for activations: one scale per 1x``tile`` tile along ``axis`` (per
    token per 128 channels). amax 0 gives the scale 1e-4 / fmax and zero data; an inf or NaN
    makes its own tile NaN and leaves the others alone."""
    x = _float32(x, "quantize_tiles")
    return _deepseek(x, float8_dtype(dtype, "quantize_tiles"), _along(x, tile, axis,
                                                                         "quantize_tiles"))


def quantize_blocks(w, dtype="float8_e4m3fn", block=128):
    """DeepSeek-V3 §3.3 for weights: one scale per ``block`` x ``block`` block of a 2-d array
    (per 128 input per 128 output channels); zero, inf and NaN as in quantize_tiles."""
    w = _float32(w, "quantize_blocks")
    if w.ndim != 2 or block < 1:
        raise ValueError(f"quantize_blocks: expected a 2-d weight and a block of at least 1, "
                         f"got shape {w.shape} and block {block}")
    return _deepseek(w, float8_dtype(dtype, "quantize_blocks"), (block, block))


def quantize_mx(x, dtype="float8_e4m3fn", block=32, axis=-1):
    """OCP MX v1.0 §6.3: per ``block`` elements along ``axis`` the E8M0 scale X = 2^e,
    e = floor(log2(amax)) - emax_elem (8 for e4m3, 15 for e5m2), clamped to E8M0's [-127, 127];
    data = saturate(x / X). amax 0 gives X = 2^-127 and zero data; an inf or NaN in a block
    gives that block the NaN scale (0xFF), so it reads back NaN (torchao's to_mx, FLOOR)."""
    d = float8_dtype(dtype, "quantize_mx")
    x = _float32(x, "quantize_mx")
    blocks = _along(x, block, axis, "quantize_mx")
    xp = backend.get_array_module(x)
    amax = _block_amax(x, blocks)
    # floor(log2(amax)) is the float32 exponent field (a subnormal amax reads -127, clamped)
    emax_elem = int(numpy.floor(numpy.log2(float(dtypes.finfo(d).max))))
    e = ((amax.view(xp.int32) >> 23) & 0xFF) - 127 - emax_elem
    e = e.clip(-127, 127)
    finite = xp.isfinite(amax)
    scale = xp.where(finite, e + 127, 255).astype(xp.uint8).view(dtypes.float8_e8m0fnu)
    inverse = xp.where(finite, xp.ldexp(FLOAT32.type(1), -e).astype(FLOAT32), numpy.nan)
    return Quantized(saturate(x * expand(inverse.astype(FLOAT32), blocks, x.shape), d), scale,
                     blocks)


def dequantize(q, dtype="float32"):
    """data · scale, each block's scale over its block, in ``dtype`` (float32 by default)."""
    data, scale, block = q
    scale = backend.get_array_module(data).asarray(scale).astype(FLOAT32)
    with numpy.errstate(invalid="ignore"):  # an inf scale over zero data: NaN, the source's
        return (data.astype(FLOAT32) * expand(scale, block, data.shape)).astype(
            backend.check_dtype(dtype))
