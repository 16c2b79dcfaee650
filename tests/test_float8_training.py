"""FP8 matmul and training: scaled_mm equals the float32 product of the dequantised operands
within float32 accumulation error; Float8Linear's three GEMMs are the recipe's quantised
operands multiplied; convert_to_float8_training swaps Linears (torchao's filter too); the
optimizer keeps fp32 masters; the GPT trained 50 steps in FP8 stays within BAND of bf16."""
import numpy as np
import pytest

import minipar
from minipar import backend, nn, optim
from minipar.amp import autocast
from minipar.amp.float8 import RECIPES, Float8Linear, convert_to_float8_training, scaled_mm
from minipar.amp.float8_recipes import (dequantize, quantize_blocks, quantize_mx,
                                        quantize_tensorwise, quantize_tiles)
from minipar.data import CharTokenizer, load_text

pytestmark = pytest.mark.skipif(backend.device() != "cpu", reason="FP8 lives on the CPU only")
RNG = np.random.default_rng(1)
# the loss gap to bf16 at step 50 accepted for every recipe (measured: 0.002 to 0.006)
BAND = 0.05
EPS32 = 2.0**-24


def operands(recipe, m=64, k=384, n=48):
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    qb = {"tensorwise": lambda: quantize_tensorwise(b),
          "tiles": lambda: quantize_blocks(b),
          "mx": lambda: quantize_mx(b, axis=0)}[recipe]()
    qa = {"tensorwise": quantize_tensorwise, "tiles": quantize_tiles, "mx": quantize_mx}[recipe](a)
    return qa, qb


@pytest.mark.parametrize("promote_every", [None, 128])
@pytest.mark.parametrize("recipe", ["tensorwise", "tiles", "mx"])
def test_scaled_mm_is_the_product_of_the_dequantised_operands(recipe, promote_every):
    qa, qb = operands(recipe)
    got = scaled_mm(qa.data, qa.scale, qb.data, qb.scale, a_block=qa.block, b_block=qb.block,
                    promote_every=promote_every)
    da, db = dequantize(qa).astype(np.float64), dequantize(qb).astype(np.float64)
    exact = da @ db
    # float32 accumulation: K additions, each at most one rounding, plus the scaling
    bound = (da.shape[1] + 4) * EPS32 * (np.abs(da) @ np.abs(db))
    assert got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= bound)


def test_scaled_mm_bias_out_dtype_and_shapes():
    qa, qb = operands("tensorwise")
    bias = RNG.standard_normal(48).astype(np.float32)
    plain = scaled_mm(qa.data, qa.scale, qb.data, qb.scale)
    with_bias = scaled_mm(qa.data, qa.scale, qb.data, qb.scale, bias=bias, out_dtype="bf16")
    np.testing.assert_array_equal(with_bias, (plain + bias).astype(minipar.bfloat16))
    with pytest.raises(ValueError, match=r"expected a \(M, K\) and b \(K, N\)"):
        scaled_mm(qa.data, qa.scale, qa.data, qa.scale)
    with pytest.raises(ValueError, match="scaled_mm: a: dtype must be float8_e4m3fn"):
        scaled_mm(qa.data.astype(np.float32), qa.scale, qb.data, qb.scale)
    qt = quantize_tiles(RNG.standard_normal((4, 300)).astype(np.float32))
    qw = quantize_blocks(RNG.standard_normal((300, 8)).astype(np.float32))
    with pytest.raises(ValueError, match=r"a has a scale of shape \(4, 3\) .* pass a_block"):
        scaled_mm(qt.data, qt.scale, qw.data, qw.scale)


def reference_linear(x, w, g, quantise):
    """Float8Linear's three products written out: each operand quantised along its GEMM's
    contraction axis (x along features forward and along tokens for dW, g likewise)."""
    y = dequantize(quantise(x, -1, "input")) @ dequantize(quantise(w, 1, "weight")).T
    dx = dequantize(quantise(g, -1, "grad")) @ dequantize(quantise(w, 0, "weight"))
    dw = dequantize(quantise(g, 0, "grad")).T @ dequantize(quantise(x, 0, "input"))
    return y, dx, dw


QUANTISE = {
    "tensorwise": lambda t, axis, role: quantize_tensorwise(
        t, "float8_e5m2" if role == "grad" else "float8_e4m3fn"),
    "blockwise": lambda t, axis, role: quantize_blocks(t) if role == "weight" else
    quantize_tiles(t, "float8_e5m2" if role == "grad" else "float8_e4m3fn", axis=axis),
    "mxfp8": lambda t, axis, role: quantize_mx(
        t, "float8_e5m2" if role == "grad" else "float8_e4m3fn", axis=axis)}


@pytest.mark.parametrize("recipe", sorted(QUANTISE))
def test_float8_linear_forward_and_backward_are_the_quantised_products(recipe):
    layer = Float8Linear(256, 160, bias=True, recipe=recipe)
    x = minipar.tensor(RNG.standard_normal((3, 96, 256)).astype(np.float32), requires_grad=True)
    g = RNG.standard_normal((3, 96, 160)).astype(np.float32)
    y = layer(x)
    y.backward(g)
    w = layer.weight.data
    ref_y, ref_dx, ref_dw = reference_linear(x.data.reshape(-1, 256), w, g.reshape(-1, 160),
                                             QUANTISE[recipe])
    tol = dict(rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(y.data.reshape(-1, 160), ref_y + layer.bias.data, **tol)
    np.testing.assert_allclose(x.grad.reshape(-1, 256), ref_dx, **tol)
    np.testing.assert_allclose(layer.weight.grad, ref_dw, **tol)
    np.testing.assert_allclose(layer.bias.grad, g.reshape(-1, 160).sum(0), rtol=1e-5)
    with pytest.raises(ValueError, match="Float8Linear: input has 3 features"):
        layer(minipar.randn(2, 3))


def gpt(vocab):
    minipar.manual_seed(0)
    return nn.GPT(nn.GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=4, n_embd=64))


def test_convert_swaps_linears_sharing_parameters_and_keeps_the_rest():
    model = gpt(11).to(minipar.bfloat16)
    before = dict(model.named_parameters())
    convert_to_float8_training(model, recipe="blockwise",
                               module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["lm_head"] is nn.Linear and kinds["blocks.0.attn.c_attn"] is Float8Linear
    assert sum(k is Float8Linear for k in kinds.values()) == 8  # 4 a block, 2 blocks
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert all(p.dtype == minipar.bfloat16 for p in after.values())
    with pytest.raises(ValueError, match="unknown FP8 recipe 'rowwise': choose one of"):
        convert_to_float8_training(model, recipe="rowwise")


def test_the_optimizer_keeps_fp32_masters_of_bf16_fp8_layers():
    layer = Float8Linear(64, 32, dtype="bfloat16")
    opt = optim.AdamW(layer.parameters(), lr=1e-3)
    with autocast(dtype=minipar.bfloat16):
        out = layer(minipar.randn(8, 64))
    assert out.dtype == minipar.bfloat16  # autocast's dtype, torchao's rule
    out.float().sum().backward()
    assert layer.weight.grad.dtype == minipar.bfloat16
    opt.step()
    master = opt.state[0]["master"]
    assert master.dtype == np.float32
    np.testing.assert_array_equal(master.astype(minipar.bfloat16), layer.weight.data)


def train(recipe, data, vocab, steps=50):
    """Lesson 13's bf16 run (bf16 weights, fp32 masters, autocast), its Linears in FP8."""
    model = gpt(vocab).to(minipar.bfloat16)
    if recipe is not None:
        convert_to_float8_training(model, recipe=recipe)
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(steps):
        starts = np.random.default_rng(s).integers(0, len(data) - 33, 16)
        windows = data[starts[:, None] + np.arange(33)]
        opt.zero_grad()
        with autocast(dtype=minipar.bfloat16):
            loss = model(windows[:, :-1], windows[:, 1:])[1]
        loss.backward()
        opt.step()
    return float(loss.item())


def test_fp8_training_stays_within_the_band_of_bf16():
    text = load_text("sonnets")
    tok = CharTokenizer(text)
    data = np.array(tok.encode(text))
    bf16 = train(None, data, tok.vocab_size)
    gaps = {r: train(r, data, tok.vocab_size) - bf16 for r in RECIPES}
    assert bf16 < 2.6  # it learned (from 4.0)
    assert all(abs(gap) < BAND for gap in gaps.values()), gaps
