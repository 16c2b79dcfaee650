"""minipar.functional takes torch.nn.functional's argument forms as well as its own: each torch
form gives what minipar's own form gives (and, where PyTorch is installed, what torch gives)."""
import numpy as np
import pytest

import minipar.functional as F
from minipar import to_numpy
from minipar.autograd import Tensor

rng = np.random.default_rng(0)


def leaf(*shape):
    return Tensor(rng.standard_normal(shape), requires_grad=True)


def same(a, b, tol=1e-12):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=tol)


def test_layer_norm_torch_form_equals_minipar_form():
    x, w, b = leaf(2, 4, 6), leaf(6), leaf(6)
    want = F.layer_norm(x, w, b, 1e-3)
    for got in (F.layer_norm(x, (6,), w, b, 1e-3), F.layer_norm(x, 6, w, b, eps=1e-3),
                F.layer_norm(x, [6], weight=w, bias=b, eps=1e-3),
                F.layer_norm(x, normalized_shape=(6,), weight=w, bias=b, eps=1e-3),
                F.layer_norm(x, weight=w, bias=b, eps=1e-3), F.layer_norm(x, w, b, eps=1e-3)):
        same(got, want)
    same(F.layer_norm(x, w, bias=b), F.layer_norm(x, (6,), w, b))
    same(F.layer_norm(x, None, None, 1e-3), F.layer_norm(x, (6,), eps=1e-3))
    same(F.layer_norm(x, w, None, 1e-3), F.layer_norm(x, (6,), w, None, 1e-3))
    with pytest.raises(ValueError, match="trailing shape"):
        F.layer_norm(x, (5,), w, b)


def test_layer_norm_over_several_trailing_axes():
    x, w, b = leaf(2, 4, 6), leaf(4, 6), leaf(4, 6)
    y = F.layer_norm(x, (4, 6), w, b)
    a = x.numpy().reshape(2, -1)
    xhat = (a - a.mean(1, keepdims=True)) / np.sqrt(a.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.numpy(), xhat.reshape(2, 4, 6) * w.numpy() + b.numpy(), atol=1e-12)
    y.sum().backward()
    assert w.grad.shape == (4, 6) and x.grad.shape == (2, 4, 6)


def test_softmax_dim_and_dtype():
    x = leaf(3, 4)
    for f in (F.softmax, F.log_softmax):
        same(f(x, dim=0), f(x, 0))
        same(f(x, dim=0), f(x, axis=0))
    assert F.softmax(x.astype("float32"), dim=-1, dtype="float64").dtype == np.float64


def test_cross_entropy_torch_forms():
    z, t = leaf(6, 5), rng.integers(0, 5, 6)
    t[2] = -100
    want = F.cross_entropy(z, t, reduction="sum")
    same(F.cross_entropy(z, t, None, None, -100, None, "sum"), want)
    same(F.cross_entropy(z, t, -100, "sum"), want)  # minipar's own positional form
    same(F.cross_entropy(z, t, size_average=False), want)  # torch's deprecated pair
    same(F.cross_entropy(z, t, reduce=False), F.cross_entropy(z, t, reduction="none"))
    same(F.cross_entropy(z, t, np.ones(5), reduction="sum"), want)  # unit weights change nothing
    with pytest.raises(ValueError, match="one value per class"):
        F.cross_entropy(z, t, weight=np.ones(4))
    with pytest.raises(ValueError, match="label_smoothing must lie in"):
        F.cross_entropy(z, t, label_smoothing=1.5)


def test_cross_entropy_classes_on_axis_1():
    z, t = leaf(3, 5, 4), rng.integers(0, 5, (3, 4))  # torch's (N, C, d) layout
    zt = Tensor(z.data.transpose(0, 2, 1).copy(), requires_grad=True)  # minipar's (N, d, C)
    for reduction in ("mean", "none"):
        got = F.cross_entropy(z, t, reduction=reduction)
        want = F.cross_entropy(zt, t, reduction=reduction)
        same(got, want)
        assert got.shape == t.shape or reduction == "mean"
    F.cross_entropy(z, t).backward()
    F.cross_entropy(zt, t).backward()
    np.testing.assert_allclose(to_numpy(z.grad), to_numpy(zt.grad).transpose(0, 2, 1), atol=1e-12)


def test_dropout_and_attention_torch_forms():
    x = leaf(4, 3)
    assert F.dropout(x, 0.5, False) is x
    with pytest.raises(ValueError, match="inplace"):
        F.dropout(x, 0.5, True, True)
    q, k, v = leaf(1, 2, 3, 4), leaf(1, 2, 3, 4), leaf(1, 2, 3, 4)
    same(F.scaled_dot_product_attention(q, k, v, is_causal=True),
         F.causal_self_attention(q, k, v))
    with pytest.raises(NotImplementedError, match="is_causal"):
        F.scaled_dot_product_attention(q, k, v)


def test_torch_calls_give_torch_values():
    """The same call text, run by torch.nn.functional and by minipar.functional."""
    torch = pytest.importorskip("torch")
    TF = torch.nn.functional
    x, w, b = rng.standard_normal((2, 4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    z, t = rng.standard_normal((3, 5, 4)), rng.integers(0, 5, (3, 4))
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    calls = [
        lambda f, T: f.layer_norm(T(x), (6,), T(w), T(b), 1e-5),
        lambda f, T: f.layer_norm(T(x), (4, 6)),
        lambda f, T: f.softmax(T(x), dim=1),
        lambda f, T: f.log_softmax(T(x), dim=-1),
        lambda f, T: f.cross_entropy(T(z), T(t)),
        lambda f, T: f.cross_entropy(T(z), T(t), reduction="none"),
        lambda f, T: f.gelu(T(x), approximate="tanh"),
        lambda f, T: f.dropout(T(x), 0.3, False),
        lambda f, T: f.linear(T(x), T(rng.standard_normal((3, 6)))),
        lambda f, T: f.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=True),
    ]
    for i, call in enumerate(calls):
        state = rng.bit_generator.state
        theirs = call(TF, torch.tensor).numpy()
        rng.bit_generator.state = state  # the same random weights for both
        ours = call(F, Tensor).numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-10, err_msg=f"call {i}")


def test_torch_signatures_of_relu_nll_loss_and_max_pool2d():
    """torch's argument forms: relu(input, inplace), nll_loss(input, target, weight,
    size_average, ignore_index, reduce, reduction), max_pool2d(input, kernel_size, stride,
    padding, dilation, ceil_mode, return_indices); what is not implemented says so (weights are:
    tests/test_torch_losses.py compares them with torch)."""
    x, t = leaf(6, 5), rng.integers(0, 5, 6)
    same(F.relu(x, False), x.relu())
    with pytest.raises(ValueError, match="inplace"):
        F.relu(x, inplace=True)
    logp = F.log_softmax(x, dim=1)
    same(F.nll_loss(logp, t, None, None, -100, None, "sum"), F.nll_loss(logp, t, reduction="sum"))
    same(F.nll_loss(logp, t, size_average=False), F.nll_loss(logp, t, reduction="sum"))
    same(F.nll_loss(logp, t), F.cross_entropy(x, t))  # cross-entropy is log-softmax then nll
    same(F.nll_loss(logp, t, weight=np.ones(5)), F.nll_loss(logp, t))
    with pytest.raises(ValueError, match=r"needs a target of shape \(6,\)"):
        F.nll_loss(logp, t[:4])
    with pytest.raises(IndexError, match=r"target values must lie in \[0, 5\)"):
        F.nll_loss(logp, np.array([0, 1, 2, 3, 4, 5]))
    img = leaf(1, 2, 6, 6)
    same(F.max_pool2d(img, 2, None, 0, 1, False, False), F.max_pool2d(img, kernel_size=2))
    for bad in (dict(dilation=2), dict(ceil_mode=True)):
        with pytest.raises(NotImplementedError, match="not implemented"):
            F.max_pool2d(img, 2, **bad)
