"""minipar.amp.autocast: 16-bit matrix products rounded once, float32 where torch's CUDA lists say,
gradients of float32 parameters in float32, and torch.autocast's results within one bf16 ulp."""
import math

import numpy as np
import pytest

import minipar
import minipar.functional as F
from minipar import amp, backend, nn
from minipar.nn import functional_conv

BF16, FP16, FP32 = backend.bfloat16, backend.float16, backend.dtypes.float32
rng = np.random.default_rng(23)

bf16_only = pytest.mark.skipif(backend.device() != "cpu",
                               reason="bfloat16 lives on NumPy (ml_dtypes); CuPy has none")


def randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype("float32")


def rounded(a, dtype=BF16):
    """a rounded to the 16-bit dtype and back to float32 (exact)."""
    return np.asarray(a).astype(dtype).astype("float32")


def bits(t):
    return minipar.to_numpy(t.data if hasattr(t, "data") else t)


def causal_attention(q, k, v):
    """minipar's causal attention on (B, H, T, d) tensors, as models call it."""
    return F.causal_self_attention(q, k, v)


# --- the 16-bit product rule: float32 sums, one rounding, inside or outside autocast ------------
@pytest.mark.parametrize("dtype", [pytest.param(BF16, marks=bf16_only), FP16])
def test_matmul_of_16bit_tensors_is_16bit_rounded_once(dtype):
    a, b = randn(4, 6, 64), randn(64, 5)
    out = minipar.tensor(a).astype(dtype) @ minipar.tensor(b).astype(dtype)
    assert out.dtype == dtype  # ml_dtypes alone gives float32 for bf16 @ bf16
    expected = (rounded(a, dtype) @ rounded(b, dtype)).astype(dtype)
    np.testing.assert_array_equal(bits(out).view(np.uint16), expected.view(np.uint16))


def test_numpy_float16_matmul_is_not_the_rule():
    """Why the rule is written out: NumPy's own float16 @ rounds differently (the test above
    would fail with a plain ``a @ b``)."""
    a, b = rounded(randn(64, 512), FP16), rounded(randn(512, 64), FP16)
    rule = (a @ b).astype(FP16)
    assert (a.astype(FP16) @ b.astype(FP16) != rule).any()


@bf16_only
def test_16bit_gradients_are_16bit():
    a = minipar.tensor(randn(3, 8)).bfloat16().requires_grad_()
    w = minipar.tensor(randn(5, 8)).bfloat16().requires_grad_()
    (F.linear(a, w) @ minipar.tensor(randn(5, 2)).bfloat16()).sum().backward()
    assert a.grad.dtype == BF16 and w.grad.dtype == BF16


@bf16_only
def test_mixed_16bit_dtypes_are_refused():
    with pytest.raises(TypeError, match="one 16-bit dtype"):
        minipar.tensor(randn(2, 3)).half() @ minipar.tensor(randn(3, 2)).bfloat16()


# --- autocast outputs: the float32 product of the rounded inputs, rounded (NumPy: exactly) -------
def _cases():
    x, w, b = randn(2, 5, 16), randn(12, 16, scale=0.3), randn(12)
    a, c = randn(3, 4, 16), randn(3, 16, 7)
    q, k, v = randn(2, 3, 8, 16), randn(2, 3, 8, 16), randn(2, 3, 8, 16)
    img, kern, kb = randn(2, 3, 6, 6), randn(4, 3, 3, 3, scale=0.3), randn(4)

    def attention_reference():  # FlashAttention's order: O = (E v) / Σ_j E, E = exp(S − max)
        s = rounded(q) @ rounded(k).swapaxes(-1, -2)
        s *= np.float32(1 / math.sqrt(16))
        s += np.triu(np.full((8, 8), -np.inf, "float32"), k=1)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return (rounded(e) @ rounded(v)) / e.sum(axis=-1, keepdims=True)

    def conv_reference():
        return bits(functional_conv.conv2d(rounded(img), minipar.tensor(rounded(kern)),
                                           minipar.tensor(rounded(kb)), padding=1))
    return {
        "linear": ((x, w, b), lambda x, w, b: F.linear(x, w, b),
                   lambda: rounded(x) @ rounded(w).T + rounded(b)),
        "matmul": ((a, c), lambda a, c: a @ c, lambda: rounded(a) @ rounded(c)),
        "attention": ((q, k, v), causal_attention, attention_reference),
        "conv2d": ((img, kern, kb), lambda x, w, b: functional_conv.conv2d(x, w, b, padding=1),
                   conv_reference),
    }


@bf16_only
@pytest.mark.parametrize("name", ["linear", "matmul", "attention", "conv2d"])
def test_autocast_output_is_the_rounded_float32_product(name):
    arrays, fn, reference = _cases()[name]
    with amp.autocast("cpu", dtype=minipar.bfloat16):
        out = fn(*[minipar.tensor(a) for a in arrays])
    assert out.dtype == BF16
    expected = reference().astype(BF16)
    np.testing.assert_array_equal(bits(out).view(np.uint16), expected.view(np.uint16))


# --- against torch.autocast("cpu", dtype=torch.bfloat16) --------------------------------------
def ulps(ours, theirs, scale=None):
    """|ours − theirs| in bf16 units in the last place of ``scale`` (default: of the larger)."""
    ours, theirs = ours.astype("float64"), theirs.astype("float64")
    scale = np.maximum(abs(ours), abs(theirs)) if scale is None else scale
    tiny = float(backend.finfo(BF16).tiny)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(scale, tiny))) - 7)
    return float((abs(ours - theirs) / ulp).max())


@bf16_only
@pytest.mark.parametrize("name", ["linear", "matmul", "attention", "conv2d"])
def test_autocast_agrees_with_torch_within_one_bf16_ulp(name):
    torch = pytest.importorskip("torch")
    arrays, fn, _ = _cases()[name]
    torch_fn = {
        "linear": torch.nn.functional.linear,
        "matmul": torch.matmul,
        "attention": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True),
        "conv2d": lambda x, w, b: torch.nn.functional.conv2d(x, w, b, padding=1),
    }[name]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = torch_fn(*[torch.tensor(a) for a in arrays])
    with amp.autocast("cpu", dtype=minipar.bfloat16):
        ours = fn(*[minipar.tensor(a) for a in arrays])
    assert theirs.dtype == torch.bfloat16 and ours.dtype == BF16
    theirs, ours = theirs.float().numpy(), bits(ours).astype("float32")
    scale = None
    if name == "attention":
        # O = P v sums terms that cancel: a rounding of the weights moves O by ulps of the
        # terms' size, Σ_j P_ij |v_j|, not of the (perhaps tiny) sum: that is the ulp's scale
        q, k, v = arrays
        p = bits(F.causal_softmax(rounded(q) @ rounded(k).swapaxes(-1, -2), 0.25))
        scale = p @ abs(rounded(v))
    assert ulps(ours, theirs, scale) <= 1.0


# --- which ops run in which dtype (torch's CUDA lists, followed on every device) -----------------
@bf16_only
def test_output_dtypes_follow_torch_cuda_lists():
    x = minipar.tensor(randn(4, 8))
    lin = nn.Linear(8, 8)
    ln = nn.LayerNorm(8)
    target = np.array([1, 0, 3, 2])
    with amp.autocast("cpu", dtype=minipar.bfloat16):
        h = lin(x)
        outputs = {
            "linear": h, "softmax": F.softmax(h, dim=-1), "log_softmax": F.log_softmax(h),
            "layer_norm": ln(h), "cross_entropy": F.cross_entropy(h, target),
            "nll_loss": F.nll_loss(F.log_softmax(h), target), "sum": h.sum(),
            "causal_softmax": F.causal_softmax(h[:, :4]), "gelu": F.gelu(h), "add": h + x,
        }
    expected = {"linear": BF16, "softmax": FP32, "log_softmax": FP32, "layer_norm": FP32,
                "cross_entropy": FP32, "nll_loss": FP32, "sum": FP32, "causal_softmax": FP32,
                "gelu": BF16,  # on neither list: runs in its input's dtype
                "add": FP32}  # bf16 + fp32 promotes, as in torch
    assert {name: t.dtype for name, t in outputs.items()} == expected


@bf16_only
def test_sum_of_16bit_runs_in_float32_its_gradient_in_16bit():
    h = minipar.tensor(randn(64, 64)).bfloat16().requires_grad_()
    with amp.autocast(dtype=minipar.bfloat16):
        total = h.sum()
    assert total.dtype == FP32 and total.item() == bits(h).astype("float32").sum()
    total.backward()
    assert h.grad.dtype == BF16


def test_float16_on_the_16bit_list_too():
    with amp.autocast(dtype="half"):
        out = minipar.tensor(randn(2, 3)) @ minipar.tensor(randn(3, 4))
    assert out.dtype == FP16


# --- gradients: float32 parameters get float32 gradients, the 16-bit products' -------------------
@bf16_only
def test_float32_parameters_get_float32_gradients():
    lin, conv = nn.Linear(6, 6), nn.Conv2d(2, 3, 3, padding=1)
    x, img = minipar.tensor(randn(4, 6), requires_grad=True), minipar.tensor(randn(2, 2, 5, 5))
    m = minipar.tensor(randn(6, 6), requires_grad=True)
    with amp.autocast("cpu", dtype=minipar.bfloat16):
        h = lin(x)
        q = h.reshape(1, 2, 4, 3)
        loss = causal_attention(q, q, q).sum() + conv(img).sum() + (x @ m).sum()
    loss.backward()
    grads = {"x": x.grad, "m": m.grad, **{n: p.grad for n, p in lin.named_parameters()},
             **{"conv." + n: p.grad for n, p in conv.named_parameters()}}
    assert all(g.dtype == FP32 for g in grads.values()), {n: g.dtype for n, g in grads.items()}
    # the same step in float32: the gradients agree to bf16's precision
    x32 = minipar.tensor(x.data, requires_grad=True)
    h = F.linear(x32, lin.weight, lin.bias)
    q = h.reshape(1, 2, 4, 3)
    (causal_attention(q, q, q).sum() + (x32 @ m).sum()).backward()
    np.testing.assert_allclose(bits(x.grad), bits(x32.grad), rtol=0.05, atol=0.05)


@bf16_only
def test_linear_backward_products_take_16bit_inputs():
    """dW under autocast: the float32 product of the 16-bit g and x, rounded to bf16, then
    widened for the float32 weight (torch's order: bf16 gradient, then the cast's backward)."""
    x, w = randn(5, 8), randn(3, 8)
    weight = minipar.tensor(w, requires_grad=True)
    g = randn(5, 3)
    with amp.autocast(dtype=minipar.bfloat16):
        y = F.linear(minipar.tensor(x), weight)
    y.backward(minipar.tensor(g).bfloat16())
    expected = (rounded(g).T @ rounded(x)).astype(BF16).astype("float32")
    np.testing.assert_array_equal(bits(weight.grad), expected)


# --- the context: nesting, disabling, decorating, asking ---------------------------------------
@bf16_only
def test_nesting_and_disabling_restore_the_outer_state():
    assert not amp.is_autocast_enabled()
    a = minipar.tensor(randn(2, 2))
    with amp.autocast("cpu", dtype=minipar.bfloat16):
        assert amp.is_autocast_enabled() and amp.get_autocast_dtype("cpu") == BF16
        with amp.autocast("cpu", enabled=False):
            assert not amp.is_autocast_enabled()
            assert (a @ a).dtype == FP32
            with amp.autocast("cuda"):  # torch's default for a GPU: float16
                assert (a @ a).dtype == FP16
        assert amp.is_autocast_enabled() and (a @ a).dtype == BF16
    assert not amp.is_autocast_enabled() and (a @ a).dtype == FP32


def test_state_restored_after_an_exception():
    with pytest.raises(RuntimeError):
        with amp.autocast(dtype="bf16"):
            raise RuntimeError("boom")
    assert not amp.is_autocast_enabled()


def test_autocast_as_a_decorator():
    @amp.autocast("cpu", dtype=minipar.float16)
    def product(a, b):
        assert amp.is_autocast_enabled()
        return a @ b

    a = minipar.tensor(randn(2, 2))
    assert product(a, a).dtype == FP16 and not amp.is_autocast_enabled()


def test_defaults_and_bad_arguments():
    assert amp.get_autocast_dtype("cpu") == BF16 and amp.get_autocast_dtype("cuda") == FP16
    # None: minipar's device, torch's default for it
    assert amp.autocast().fast_dtype == (BF16 if backend.device() == "cpu" else FP16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        amp.autocast("cpu", dtype="float32")
    with pytest.raises(ValueError, match="device_type"):
        amp.autocast("tpu")


# --- a tiny GPT, forward and backward under autocast --------------------------------------------
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=bf16_only), "float16"])
def test_tiny_gpt_runs_under_autocast(dtype):
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16))
    ids = rng.integers(0, 17, (2, 8))
    with amp.autocast(dtype=dtype):
        logits, loss = model(ids, ids)
    assert logits.dtype == backend.dtype(dtype) and loss.dtype == FP32
    loss.backward()
    assert all(p.grad.dtype == FP32 and np.isfinite(bits(p.grad)).all()
               for p in model.parameters())
    _, loss32 = model(ids, ids)
    assert abs(loss.item() - loss32.item()) < 0.02
