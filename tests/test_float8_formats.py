"""FP8 formats: every float32 converts to torch 2.13's 8 bits (backend.cast), names as torch
spells them, 1 byte an element, and a refusal by name on the strict device (CuPy has none)."""
import numpy as np
import pytest

import minipar
from minipar import backend
from minipar.backend import dtypes
from minipar.memory import ActivationMemory
from nn_torch_twins import requires_torch as needs_torch, torch

FORMATS = ["float8_e4m3fn", "float8_e5m2"]
# float32 exponents where each format's rounding changes rule: half its smallest subnormal and
# below (ties to zero), the subnormal/normal boundary, and past its largest value (saturation
# for e4m3fn, inf for e5m2); every bit pattern of each, both signs
EXPONENTS = {"float8_e4m3fn": (-11, -10, -7, -6, 8, 9), "float8_e5m2": (-18, -17, -15, -14, 15, 16)}
on_cpu = pytest.mark.skipif(backend.device() != "cpu", reason="FP8 lives on the CPU only")


def _structured(name):
    """Random bit patterns, float32 subnormals, every FP8 value, the exact midpoints between
    neighbouring FP8 values (ties: even and odd both), and the edges past each format's max."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    sub = rng.integers(1, 2**23, size=2000, dtype=np.uint32).view(np.float32)
    values = np.arange(256, dtype=np.uint8).view(backend.dtype(name)).astype(np.float32)
    values = np.unique(values[np.isfinite(values)])
    ties = (values[:-1] + values[1:]) / 2  # exact in float32: 3 or 4 more bits
    near = np.concatenate([np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 448, 449, 463.99, 464, 465, 480, 1e4, 57344,
                      61439, 61440, 65536, 1e30, 3.4e38], np.float32)
    x = np.concatenate([bits, sub, values, ties, near, edges]).astype(np.float32)
    x = np.concatenate([x, -x])
    return x[~np.isnan(x)]


def _exponent_range(e):
    mantissas = np.arange(2**23, dtype=np.uint32)
    x = ((np.uint32(e + 127) << np.uint32(23)) | mantissas).view(np.float32)
    return np.concatenate([x, -x])


def _torch_bits(x, name):
    return torch.from_numpy(x).to(getattr(torch, name)).view(torch.uint8).numpy()


@needs_torch
@pytest.mark.parametrize("name", FORMATS)
def test_every_float32_converts_to_torchs_eight_bits(name):
    cases = [_structured(name)] + [_exponent_range(e) for e in EXPONENTS[name]]
    for x in cases:
        ours = backend.cast(x, name)
        assert ours.dtype == backend.dtype(name) and ours.itemsize == 1
        np.testing.assert_array_equal(ours.view(np.uint8), _torch_bits(x, name))


@needs_torch
def test_ml_dtypes_alone_differs_from_torch_past_e4m3fn_max():
    """The one rule cast adds: ml_dtypes gives NaN above 464, torch 2.13 saturates."""
    x = np.array([464.01, 1e4, np.inf, -np.inf], np.float32)
    assert np.isnan(x.astype(dtypes.float8_e4m3fn).astype(np.float32)).all()
    np.testing.assert_array_equal(backend.cast(x, "float8_e4m3fn").astype(np.float32),
                                  [448, 448, 448, -448])
    np.testing.assert_array_equal(_torch_bits(x, "float8_e4m3fn"),
                                  backend.cast(x, "float8_e4m3fn").view(np.uint8))


@needs_torch
@pytest.mark.parametrize("name", FORMATS)
def test_nan_stays_nan(name):
    x = np.array([np.nan, -np.nan], np.float32)
    assert np.isnan(backend.cast(x, name).astype(np.float32)).all()
    assert torch.from_numpy(x).to(getattr(torch, name)).float().isnan().all()


@needs_torch
def test_names_resolve_as_torch_spells_them():
    for name in FORMATS:
        d = backend.dtype(name)
        assert d == backend.dtype(getattr(torch, name)) == backend.dtype(d.char)
        assert backend.is_floating(d) and not backend.is_low_precision(d)
        assert backend.finfo(name).max == torch.finfo(getattr(torch, name)).max
    assert backend.dtype("e4m3") == dtypes.float8_e4m3fn and backend.float8_e5m2.itemsize == 1
    with pytest.raises(TypeError, match="'float8_e4m3fn' or 'float8_e5m2'"):
        backend.dtype("float8_e4m2")


@on_cpu
@pytest.mark.parametrize("name", FORMATS)
def test_one_byte_an_element(name):
    x = minipar.zeros((8, 64), dtype=name)
    assert x.dtype == backend.dtype(name) and x.data.nbytes == 8 * 64
    from minipar.amp.float8 import Float8Linear

    layer = Float8Linear(64, 32, bias=False)
    inputs = minipar.randn(8, 64, requires_grad=True) * 1.0  # not a leaf: an activation
    with ActivationMemory() as mem:
        out = layer(inputs)
    # kept for backward: the FP8 input and weight, one byte an element, and their two scales
    assert mem.live_bytes == 8 * 64 + 32 * 64 + 2 * 4
    out.sum().backward()
    assert inputs.grad is None and layer.weight.grad.shape == (32, 64)


@pytest.mark.parametrize("name", FORMATS + ["float8_e8m0fnu"])
def test_fp8_refused_by_name_on_the_strict_device(name):
    host = np.zeros(3, backend.dtype(name))
    backend.set_device("strict")
    with pytest.raises(TypeError, match=f"{name} arrays are not supported on the strict device"):
        minipar.zeros(3, dtype=name)
    with pytest.raises(TypeError, match=f"CuPy has no {name} dtype"):
        backend.xp().asarray(host)
    with pytest.raises(TypeError, match="bfloat16 arrays are not supported on the strict"):
        backend.asarray(host.astype(np.float32), "bf16")
    assert backend.asarray(np.zeros(3, np.float16)).dtype == np.float16


@needs_torch
@on_cpu
@pytest.mark.parametrize("name", FORMATS)
def test_tensor_to_and_module_astype_round_as_torch(name):
    """Tensor.to, minipar's own and torch's spelling of the dtype, and Module.astype go through
    the same rounding: past e4m3fn's max they saturate as torch's .to() does, not NaN."""
    x = np.array([0.0, 1e-9, 0.3, 448.0, 500.0, -1e5, 60000.0, 70000.0], np.float32)
    want = torch.tensor(x).to(getattr(torch, name)).view(torch.uint8).numpy()
    for d in (name, getattr(minipar, name), getattr(torch, name)):
        assert (minipar.tensor(x).to(d).data.view(np.uint8) == want).all()
    layer = minipar.nn.Linear(1, x.size, bias=False)
    layer.weight.data = x.reshape(-1, 1).copy()
    assert (layer.astype(name).weight.data.view(np.uint8).ravel() == want).all()
