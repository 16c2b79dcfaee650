"""The FP8 scaling recipes, each equal to a reference written here from its source (torchao,
Transformer Engine, DeepGEMM for DeepSeek-V3, torchao's to_mx for OCP MX, in torch as they
are written), dequantising within the format's error, and zero, inf and NaN as the source says."""
import numpy as np
import pytest

from minipar import backend
from minipar.amp.float8_recipes import (DelayedScaling, dequantize, expand, quantize_blocks,
                                        quantize_mx, quantize_tensorwise, quantize_tiles)
from nn_torch_twins import requires_torch as needs_torch, torch

pytestmark = pytest.mark.skipif(backend.device() != "cpu", reason="FP8 lives on the CPU only")
FORMATS = ["float8_e4m3fn", "float8_e5m2"]
MANTISSA = {"float8_e4m3fn": 3, "float8_e5m2": 2}
RNG = np.random.default_rng(0)


def wide(shape):
    """Values over many binades, as activations with outliers are."""
    return (RNG.standard_normal(shape) * np.exp(RNG.uniform(-6, 6, shape))).astype(np.float32)


def bits(a):
    return np.asarray(a).view(np.uint8)


def tbits(t):
    return t.view(torch.uint8).numpy()


def fmax(name):
    return torch.finfo(getattr(torch, name)).max


def torchao_tensorwise(x, name):  # torchao.float8: tensor_to_scale, hp_tensor_and_scale_to_float8
    x = torch.from_numpy(x)
    amax = x.abs().max().to(torch.float64)
    scale = (fmax(name) / torch.clamp(amax, min=1e-12)).to(torch.float32)
    data = (x * scale).clamp(-fmax(name), fmax(name)).to(getattr(torch, name))
    return tbits(data), scale.reciprocal().numpy()  # _scaled_mm's scale: the reciprocal


def deepgemm_per_block(x, name, rows, cols):  # DeepGEMM's per_block_cast_to_fp8, tile (rows, cols)
    x = torch.from_numpy(x)
    m, n = x.shape
    pad = torch.zeros((-(-m // rows) * rows, -(-n // cols) * cols))
    pad[:m, :n] = x
    view = pad.view(-1, rows, pad.size(1) // cols, cols)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    data = (view * (fmax(name) / amax)).to(getattr(torch, name)).view_as(pad)[:m, :n]
    return tbits(data.contiguous()), (amax / fmax(name)).view(view.size(0), view.size(2)).numpy()


def torchao_to_mx(x, name, block=32):  # torchao's to_mx, ScaleCalculationMode.FLOOR
    x = torch.from_numpy(x)
    view = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = view.abs().amax(-1, keepdim=True)
    pow2 = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    unbiased = torch.clamp(pow2 - {"float8_e4m3fn": 8, "float8_e5m2": 15}[name], -127, 128)
    biased = torch.where(torch.isfinite(amax), unbiased + 127, 255).to(torch.uint8)
    inverse = torch.where(biased == 255, float("nan"), 2.0 ** (127 - biased.to(torch.float64)))
    data = (view * inverse.float()).clamp(-fmax(name), fmax(name)).to(getattr(torch, name))
    return tbits(data.reshape(x.shape)), biased.squeeze(-1).numpy()


@needs_torch
@pytest.mark.parametrize("name", FORMATS)
def test_tensorwise_is_torchaos(name):
    x = wide((70, 90))
    q = quantize_tensorwise(x, name)
    data, scale = torchao_tensorwise(x, name)
    np.testing.assert_array_equal(bits(q.data), data)
    assert q.scale == scale and q.block == x.shape


@needs_torch
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", [(6, 256), (5, 300)])  # whole tiles, and a partial last one
def test_tiles_and_blocks_are_deepgemms(name, shape):
    x = wide(shape)
    q = quantize_tiles(x, name)
    data, scale = deepgemm_per_block(x, name, 1, 128)
    np.testing.assert_array_equal(bits(q.data), data)
    np.testing.assert_array_equal(q.scale, scale)
    w = wide((shape[1], 200))
    q = quantize_blocks(w, name)
    data, scale = deepgemm_per_block(w, name, 128, 128)
    np.testing.assert_array_equal(bits(q.data), data)
    np.testing.assert_array_equal(q.scale, scale)
    assert q.block == (128, 128)
    q0 = quantize_tiles(x, name, axis=0)  # 128x1 tiles: the transposed tensor's 1x128
    np.testing.assert_array_equal(bits(q0.data), bits(quantize_tiles(x.T.copy(), name).data).T)


@needs_torch
@pytest.mark.parametrize("name", FORMATS)
def test_mx_is_the_spec_as_torchao_implements_it(name):
    x = wide((8, 256))
    x[0, :32] *= 1e-30  # a block whose scale is clamped at E8M0's 2^-127
    q = quantize_mx(x, name)
    data, biased = torchao_to_mx(x, name)
    np.testing.assert_array_equal(bits(q.data), data)
    np.testing.assert_array_equal(bits(q.scale), biased)
    assert q.scale.dtype.name == "float8_e8m0fnu" and q.block == (1, 32)


def te_delayed(amaxes, length, name, algo="max"):
    """Transformer Engine's amax_and_scale_update, one step after each amax, in plain Python."""
    history, scale, used = [0.0] * length, 1.0, []
    for amax in amaxes:
        used.append(scale)
        history[0] = amax
        window = [a for a in history if a == a]  # fmaxf ignores NaN
        now = history[0] if algo == "most_recent" else max([0.0] + window)
        if np.isfinite(now) and now > 0:
            scale = float(np.float32(fmax(name)) / np.float32(now))
        history = [0.0] + history[2:] + history[:1] if length > 1 else [0.0]
    return used


@needs_torch
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_is_transformer_engines(algo):
    scaling = DelayedScaling("float8_e4m3fn", amax_history_len=3, amax_compute_algo=algo)
    tensors = [wide((4, 8)) * s for s in (1.0, 10.0, 0.1, 0.1, 0.1, 0.0, 5.0)]
    tensors[3][0, 0] = np.inf
    tensors[4][0, 0] = np.nan
    amaxes = [float(np.abs(t).max()) for t in tensors]
    expected = te_delayed(amaxes, 3, "float8_e4m3fn", algo)
    for t, scale in zip(tensors, expected):
        q = scaling(t)
        assert q.scale == np.float32(1) / np.float32(scale)
        ref = (torch.from_numpy(t) * np.float32(scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        np.testing.assert_array_equal(bits(q.data), tbits(ref))


def every_recipe(name):
    return {"tensorwise": lambda x: quantize_tensorwise(x, name),
            "delayed": lambda x: DelayedScaling(name)(x),
            "tiles": lambda x: quantize_tiles(x, name),
            "blocks": lambda x: quantize_blocks(x, name),
            "mx": lambda x: quantize_mx(x, name)}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "tiles", "blocks", "mx"])
def test_dequantising_gives_back_the_input_within_the_formats_error(name, recipe):
    """|error| <= 2^-(mantissa bits + 1) |x| where x / scale is normal in the format; half
    the smallest subnormal times the scale below; past fmax (MX, delayed) saturated to ±fmax."""
    x = wide((130, 260))
    q = every_recipe(name)[recipe](x)
    got = dequantize(q)
    scale = np.broadcast_to(expand(q.scale.astype(np.float32), q.block, x.shape), x.shape)
    info = backend.finfo(name)
    v = np.abs(x) / scale
    clipped = v > float(info.max) * (1 + 2**-16)  # (the block max itself, rounded, is not)
    normal = ~clipped & (v >= float(info.tiny))
    rel = 2.0 ** -(MANTISSA[name] + 1) * (1 + 2**-16)
    assert np.all(np.abs(got - x)[normal] <= rel * np.abs(x)[normal])
    assert np.all(np.abs(got - x)[~normal & ~clipped]
                  <= float(info.smallest_subnormal) / 2 * scale[~normal & ~clipped] * 1.0001)
    np.testing.assert_array_equal(np.abs(got[clipped]), (float(info.max) * scale)[clipped])
    # only MX's block max (in [2^emax, 2^(emax+1))) and delayed scaling's first step (scale 1,
    # TE's start) can pass fmax
    assert recipe in ("mx", "delayed") or not clipped.any()


@pytest.mark.parametrize("name", FORMATS)
def test_amax_zero(name):
    """torchao clamps amax at 1e-12, DeepGEMM at 1e-4, MX reads 2^-127, TE keeps its scale:
    zeros come back as zeros, no NaN."""
    x = np.zeros((4, 128), np.float32)
    qs = {r: f(x) for r, f in every_recipe(name).items()}
    for q in qs.values():
        assert not bits(q.data).any() and not dequantize(q).any()
    top = float(backend.finfo(name).max)
    assert qs["tensorwise"].scale == np.float32(1) / np.float32(top / 1e-12)
    np.testing.assert_array_equal(qs["tiles"].scale, np.float32(1e-4) / np.float32(top))
    assert np.all(qs["mx"].scale.astype(np.float32) == 2.0**-127)
    scaling = DelayedScaling(name)
    scaling(x)
    assert scaling.scale == 1 and scaling(wide((4, 4))).scale == 1


@pytest.mark.parametrize("name", FORMATS)
def test_an_inf(name):
    """One inf: tensor-wise loses the whole tensor (scale 0: NaN everywhere); tiles, blocks and
    MX lose only its own tile or block; delayed scaling saturates it and keeps its scale."""
    x = wide((256, 256))
    x[3, 5] = np.inf
    back = {r: np.isnan(dequantize(f(x))) for r, f in every_recipe(name).items()}
    assert back["tensorwise"].all()
    assert back["tiles"].sum() == 128 and back["tiles"][3, :128].all()
    assert back["blocks"].sum() == 128 * 128 and back["blocks"][:128, :128].all()
    assert back["mx"].sum() == 32 and back["mx"][3, :32].all()
    scaling = DelayedScaling(name, amax_history_len=2)
    q = scaling(x)
    assert not back["delayed"].any() and dequantize(q)[3, 5] == float(backend.finfo(name).max)
    assert scaling.scale == 1  # inf is not finite: kept while it is in the history
    scaling(np.zeros_like(x))
    assert scaling.scale == 1
    scaling(np.zeros_like(x))
    assert scaling.scale == 1  # amax 0 (the inf has left the window): kept


@pytest.mark.parametrize("name", FORMATS)
def test_a_nan(name):
    """One NaN: tensor-wise NaN everywhere (amax NaN); tiles, blocks, MX its own tile or block
    (MX: the scale 0xFF); delayed scaling only that element, and fmaxf skips it in the
    history, so the scale follows the other amaxes."""
    x = wide((256, 256))
    x[3, 5] = np.nan
    back = {r: np.isnan(dequantize(f(x))) for r, f in every_recipe(name).items()}
    assert back["tensorwise"].all()
    assert back["tiles"].sum() == 128 and back["blocks"].sum() == 128 * 128
    assert back["mx"].sum() == 32 and bits(quantize_mx(x, name).scale)[3, 0] == 255
    assert back["delayed"].sum() == 1
    scaling = DelayedScaling(name, amax_history_len=4)
    scaling(np.full_like(x, 2.0))
    scaling(x)
    assert scaling.scale == np.float32(float(backend.finfo(name).max)) / np.float32(2.0)


def test_bad_arguments_are_named():
    x = wide((4, 8))
    with pytest.raises(ValueError, match="quantize_tiles: dtype must be float8_e4m3fn or "
                                         "float8_e5m2, got float16"):
        quantize_tiles(x, "float16")
    with pytest.raises(ValueError, match="quantize_blocks: expected a 2-d weight"):
        quantize_blocks(x[0])
    with pytest.raises(ValueError, match="quantize_mx: axis 2 is not an axis"):
        quantize_mx(x, axis=2)
    with pytest.raises(TypeError, match="quantize_tensorwise: expected a floating-point array"):
        quantize_tensorwise(np.arange(4))
    with pytest.raises(ValueError, match="amax_compute_algo must be 'max' or 'most_recent'"):
        DelayedScaling(amax_compute_algo="mean")
