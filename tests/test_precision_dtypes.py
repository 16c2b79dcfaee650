"""The 16-bit floats of mixed precision: rounding bit for bit as PyTorch's, 2 bytes per element
for real, names as torch spells them, and a clear refusal where the device lacks bfloat16."""
import numpy as np
import pytest

import minipar
from minipar import backend, nn
from minipar.memory import ActivationMemory
from nn_torch_twins import requires_torch as needs_torch, torch

on_cpu = pytest.mark.skipif(backend.device() != "cpu", reason="bfloat16 lives on the CPU only")


def _float32_cases():
    """Normals over the whole range, float32 subnormals, fp16's subnormal range, values past
    each type's max, ±0, ±inf, and exact ties (the rounding rule shows only there)."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    normals = bits.view(np.float32)
    normals = normals[np.isfinite(normals)]
    subnormals = (rng.integers(1, 2**23, size=2000, dtype=np.uint32)).view(np.float32)
    fp16_small = rng.uniform(-1e-4, 1e-4, size=2000).astype(np.float32)
    # a bf16 tie: the 16 bits dropped are exactly 0x8000; even and odd kept parts both occur
    bf16_ties = (rng.integers(0, 2**16, size=2000, dtype=np.uint32) << 16 | 0x8000)
    bf16_ties = bf16_ties.astype(np.uint32).view(np.float32)
    # an fp16 tie: halfway between neighbours, i.e. (2k+1) / 2^11 in [1, 2)
    fp16_ties = ((2 * rng.integers(1024, 2048, size=2000) + 1) / 2.0**11).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 65519.99, 1e5, -1e5,
                      3.3895314e38, 3.39e38, 6e-8, 2.98e-8, 1e-45], dtype=np.float32)
    cases = np.concatenate([normals, -normals, subnormals, fp16_small, bf16_ties, fp16_ties,
                            -fp16_ties, edges]).astype(np.float32)
    return cases[~np.isnan(cases)]  # NaN's own test follows


def _bits(array):
    return np.asarray(array).view(np.uint16)


@needs_torch
@on_cpu
@pytest.mark.parametrize("name, torch_name", [("bfloat16", "bfloat16"), ("float16", "float16")])
def test_rounding_equals_torch_bit_for_bit(name, torch_name):
    x = _float32_cases()
    ours = minipar.tensor(x).astype(name).data
    theirs = torch.from_numpy(x).to(getattr(torch, torch_name)).view(torch.int16).numpy()
    assert ours.dtype == backend.dtype(name) and ours.itemsize == 2
    np.testing.assert_array_equal(_bits(ours), theirs.view(np.uint16))


@needs_torch
@on_cpu
def test_nan_stays_nan():
    """NaN's payload is not specified: torch writes 0xFFFF, ml_dtypes the quiet NaN 0x7FC0.
    Both are NaN, and every other value agrees to the bit (above)."""
    x = np.array([np.nan, -np.nan], dtype=np.float32)
    for name in ("bfloat16", "float16"):
        assert np.isnan(minipar.tensor(x).astype(name).data.astype(np.float32)).all()
        assert torch.from_numpy(x).to(getattr(torch, name)).isnan().all()


@on_cpu
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_sixteen_bits_are_two_bytes(name):
    model = nn.Linear(64, 32).to(name)
    assert model.weight.dtype == backend.dtype(name)
    assert model.weight.data.nbytes == 64 * 32 * 2
    x = minipar.randn(8, 64, dtype=name, requires_grad=True)
    with ActivationMemory() as mem16:
        (x * 2.0).tanh().sum().backward()
    x32 = minipar.randn(8, 64, requires_grad=True)
    with ActivationMemory() as mem32:
        (x32 * 2.0).tanh().sum().backward()
    assert mem16.peak_bytes * 2 == mem32.peak_bytes > 0
    assert x.grad.dtype == backend.dtype(name)


@on_cpu
def test_gradient_of_a_cast_comes_back_in_the_parameters_dtype():
    w = minipar.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    (w.bfloat16() * 3.0).sum().backward()
    assert w.grad.dtype == np.float32
    np.testing.assert_array_equal(w.grad, np.full((2, 3), 3.0, np.float32))


@needs_torch
def test_names_resolve_as_torch_and_numpy_spell_them():
    assert backend.dtype("half") == backend.dtype(torch.float16) == minipar.float16
    assert backend.dtype("bf16") == backend.dtype(torch.bfloat16) == minipar.bfloat16
    assert backend.dtype("float") == np.float32 and backend.dtype("double") == np.float64
    assert all(backend.is_floating(d) for d in ("bfloat16", "float16", "float32", "float64"))
    assert not backend.is_floating("int32") and not backend.is_low_precision("float32")
    assert backend.finfo("float16").tiny == np.float16(2.0**-14)
    assert backend.finfo("bfloat16").eps == 2.0**-7
    with pytest.raises(TypeError, match="unknown dtype 'brainfloat'"):
        backend.dtype("brainfloat")


def test_bfloat16_refused_by_name_on_a_device_without_it():
    backend.set_device("strict")
    with pytest.raises(TypeError, match="bfloat16 arrays are not supported on the strict"):
        minipar.zeros(3, dtype="bfloat16")
    with pytest.raises(TypeError, match="CuPy has no bfloat16"):
        nn.Linear(2, 2).bfloat16()
    half = nn.Linear(2, 2).half()
    assert half.weight.dtype == np.float16 and backend.is_gpu_array(half.weight.data)


@needs_torch
@on_cpu
def test_a_python_number_keeps_bfloat16_as_torch_does():
    """NumPy widens bfloat16 * 2.1 to float32; torch computes in float32 and rounds back, and so
    does minipar. (torch's add and sub round the number itself to bfloat16 first, so they differ
    where the sum cancels; minipar keeps its one rule, float32 then one rounding, for every op.)"""
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    ours = minipar.tensor(x).bfloat16().requires_grad_()
    theirs = torch.from_numpy(x).bfloat16().requires_grad_()
    y, ty = ours * 2.1, theirs * 2.1
    assert y.dtype == minipar.bfloat16
    torch_bits = ty.detach().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(_bits(y.data), torch_bits)
    z, tz = y + 0.3, ty + 0.3
    once = (y.data.astype(np.float32) + np.float32(0.3)).astype(minipar.bfloat16)
    np.testing.assert_array_equal(_bits(z.data), _bits(once))
    (z * z / 3.0).sum().backward()
    (tz * tz / 3.0).sum().backward()
    assert ours.grad.dtype == minipar.bfloat16
    # a few bf16 units apart: the forwards differ where torch rounded 0.3 first
    np.testing.assert_allclose(ours.grad.astype(np.float32), theirs.grad.float().numpy(),
                               rtol=2.0**-6, atol=2.0**-8)


@on_cpu
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_every_gradient_of_a_16bit_gpt_is_16bit(name):
    """torch's rule: a parameter's gradient has the parameter's dtype, whatever the backward
    mixed in (layer norm's statistics, a Python number)."""
    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    model.to(name)
    ids = np.arange(16).reshape(2, 8) % 11
    model(ids, ids)[1].backward()
    wrong = {n: p.grad.dtype for n, p in model.named_parameters() if p.grad.dtype != name}
    assert not wrong
