"""Every op's forward and gradients against PyTorch (float64), when PyTorch is installed."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import minipar
import minipar.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional
rng = np.random.default_rng(1)


def rand(*shape, positive=False):
    a = rng.standard_normal(shape)
    return np.abs(a) + 0.5 if positive else a


def compare(mp_fn, torch_fn, *arrays, atol=1e-10):
    """Run both on the same float64 inputs; compare outputs and input gradients."""
    ours = [minipar.tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out_m, out_t = mp_fn(*ours), torch_fn(*theirs)
    np.testing.assert_allclose(out_m.numpy(), out_t.detach().numpy(), atol=atol, rtol=1e-9)
    g = rng.standard_normal(out_t.shape)
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    for k, (m, t) in enumerate(zip(ours, theirs)):
        expected = np.zeros(t.shape) if t.grad is None else t.grad.numpy()
        got = np.zeros(m.shape) if m.grad is None else minipar.to_numpy(m.grad)
        np.testing.assert_allclose(got, expected, atol=atol, rtol=1e-9,
                                   err_msg=f"gradient of input {k}")


@settings(max_examples=20, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       op=st.sampled_from(["add", "sub", "mul", "div", "pow"]))
def test_binary_broadcasting(shapes, op):
    sa, sb = shapes.input_shapes
    fn = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
          "div": lambda a, b: a / b, "pow": lambda a, b: a ** b}[op]
    compare(fn, fn, rand(*sa, positive=True), rand(*sb, positive=True))


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs"])
def test_unary(name):
    compare(lambda a: getattr(a, name)(), lambda a: getattr(a, name)(), rand(3, 4, positive=True)
            if name in ("log", "sqrt") else rand(3, 4))


@pytest.mark.parametrize("sa,sb", [((2, 3), (3, 4)), ((5, 2, 3), (3, 4)), ((2, 1, 2, 3), (4, 3, 2)),
                                   ((3,), (3, 2)), ((2, 3), (3,)), ((3,), (3,))])
def test_matmul(sa, sb):
    compare(lambda a, b: a @ b, lambda a, b: a @ b, rand(*sa), rand(*sb))


@pytest.mark.parametrize("axis", [None, 1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_sum_mean(axis, keepdims):
    dim = (0, 1, 2) if axis is None else axis
    compare(lambda a: a.sum(axis=axis, keepdims=keepdims),
            lambda a: a.sum(dim=dim, keepdim=keepdims), rand(2, 3, 4))
    compare(lambda a: a.mean(axis=axis, keepdims=keepdims),
            lambda a: a.mean(dim=dim, keepdim=keepdims), rand(2, 3, 4))


def test_max_min_along_axis():
    compare(lambda a: a.max(axis=1), lambda a: a.amax(dim=1), rand(3, 5))
    compare(lambda a: a.min(axis=0, keepdims=True), lambda a: a.amin(dim=0, keepdim=True), rand(3, 5))


def test_shapes_and_indexing():
    x = rand(2, 3, 4)
    compare(lambda a: a.reshape(6, 4), lambda a: a.reshape(6, 4), x)
    compare(lambda a: a.permute(1, 2, 0), lambda a: a.permute(1, 2, 0), x)
    compare(lambda a: a.transpose(0, 1), lambda a: a.transpose(0, 1), x)
    compare(lambda a: a[:, 1:, ::2], lambda a: a[:, 1:, ::2], x)
    idx = np.array([0, 2, 2])
    compare(lambda a: a[:, idx], lambda a: a[:, torch.tensor(idx)], x)
    index = rng.integers(0, 4, size=(2, 3, 5))
    compare(lambda a: a.gather(2, index), lambda a: a.gather(2, torch.tensor(index)), x)


def test_concat_stack_split_masked_fill():
    a, b = rand(2, 3), rand(2, 3)
    compare(lambda x, y: minipar.concat([x, y], axis=0), lambda x, y: torch.cat([x, y], 0), a, b)
    compare(lambda x, y: minipar.stack([x, y], axis=2), lambda x, y: torch.stack([x, y], 2), a, b)
    compare(lambda x: x.split(2, axis=1)[1], lambda x: x.split(2, dim=1)[1], rand(3, 5))
    mask = rand(2, 3) > 0
    compare(lambda x: x.masked_fill(mask, -1.5), lambda x: x.masked_fill(torch.tensor(mask), -1.5), a)


def test_embedding():
    ids = rng.integers(0, 7, size=(3, 4))
    compare(lambda w: minipar.embedding(w, ids), lambda w: TF.embedding(torch.tensor(ids), w),
            rand(7, 5))


def test_functional():
    x = rand(4, 6)
    compare(lambda a: F.softmax(a, -1), lambda a: TF.softmax(a, -1), x)
    compare(lambda a: F.log_softmax(a, 0), lambda a: TF.log_softmax(a, 0), x)
    compare(lambda a: F.gelu(a), lambda a: TF.gelu(a, approximate="tanh"), x)
    compare(lambda a, w, b: F.layer_norm(a, w, b), lambda a, w, b: TF.layer_norm(a, (6,), w, b),
            rand(2, 4, 6), rand(6), rand(6))
    compare(lambda a, w, b: F.linear(a, w, b), lambda a, w, b: TF.linear(a, w, b),
            rand(2, 4, 6), rand(3, 6), rand(3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction):
    target = rng.integers(0, 5, size=(3, 4))
    target[0, 1] = -100
    compare(lambda z: F.cross_entropy(z, target, reduction=reduction),
            lambda z: TF.cross_entropy(z.permute(0, 2, 1), torch.tensor(target),
                                       reduction=reduction), rand(3, 4, 5))


def test_causal_attention():
    q, k, v = rand(2, 3, 5, 4), rand(2, 3, 5, 4), rand(2, 3, 5, 4)
    compare(F.causal_self_attention,
            lambda a, b, c: TF.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)


def _causal(a, scale):
    T = a.shape[-1]
    return TF.softmax((a * scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                              float("-inf")), -1)


def test_causal_softmax_is_scale_mask_softmax():
    compare(lambda a: F.causal_softmax(a, 0.3), lambda a: _causal(a, 0.3), rand(2, 3, 5, 5))
    compare(F.causal_softmax, lambda a: _causal(a, 1.0), rand(4, 4))


def test_attention_heads_from_qkv():
    """attention_heads(qkv, H) is the reshape, permute, attention, permute, reshape of nanoGPT."""
    B, T, H, d = 2, 5, 3, 4

    def theirs(qkv):
        q, k, v = qkv.view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, H * d)
    compare(lambda qkv: F.attention_heads(qkv, H), theirs, rand(B, T, 3 * H * d))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_far_from_zero_stays_finite(dtype):
    """GeLU through e^(−2u): the exponent is clipped, so no overflow (warnings are errors here)."""
    import warnings
    x = np.array([-1e4, -60.0, -12.0, -3.0, 0.0, 3.0, 12.0, 1e4], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = minipar.tensor(x, requires_grad=True)
        y = F.gelu(ours)
        y.sum().backward()
    theirs = torch.tensor(x, requires_grad=True)
    y_t = TF.gelu(theirs, approximate="tanh")
    y_t.sum().backward()
    tol = 1e-6 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(y.numpy(), y_t.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(minipar.to_numpy(ours.grad), theirs.grad.numpy(), rtol=tol,
                               atol=tol)


def test_row_and_column_sums_above_the_blas_size():
    """Above sums.SMALL elements the sums run as products with ones, the max at the argmax:
    the same results."""
    from minipar import sums
    n = sums.SMALL  # 2·n rows of 64: both helpers take the BLAS path
    # a draw of its own: rand's stream depends on how many draws the tests before made
    # (hypothesis's examples vary), and a rare row that nearly cancels breaks rtol=1e-12
    x = np.random.default_rng(0).standard_normal((2, n // 64, 64))
    assert x.size >= sums.SMALL
    np.testing.assert_allclose(sums.sum_last(x), x.sum(axis=-1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(sums.sum_rows(x), x.reshape(-1, 64).sum(axis=0), rtol=1e-12)
    y = x.copy()  # the max read at the argmax: the same values, a NaN or all -inf row too
    y[0, 0, 5], y[1, 3] = np.nan, -np.inf
    np.testing.assert_array_equal(sums.max_last(y), y.max(axis=-1, keepdims=True))
    compare(lambda a, w, b: F.layer_norm(a, w, b), lambda a, w, b: TF.layer_norm(a, (64,), w, b),
            x, rand(64), rand(64))
    compare(lambda a, w, b: F.linear(a, w, b), lambda a, w, b: TF.linear(a, w, b),
            x, rand(3, 64), rand(3))
    B, T, H, d = 2, 48, 2, 4

    def theirs(qkv):
        q, k, v = qkv.view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
        return TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(
            B, T, H * d)
    compare(lambda qkv: F.attention_heads(qkv, H), theirs, rand(B, T, 3 * H * d))


def test_torch_tutorial_functions():
    """F.relu, F.log_softmax, F.nll_loss and F.max_pool2d in torch's own calls (the MNIST net of
    torch's tutorials): values and gradients equal torch's."""
    x, img = rand(6, 5), rand(2, 3, 9, 8)
    t = rng.integers(0, 5, 6)
    compare(F.relu, TF.relu, x)
    compare(lambda a: F.log_softmax(a, dim=1), lambda a: TF.log_softmax(a, dim=1), x)
    compare(lambda a: F.log_softmax(a, 0), lambda a: TF.log_softmax(a, 0), x)
    for reduction in ("mean", "sum", "none"):
        compare(lambda a: F.nll_loss(F.log_softmax(a, dim=1), t, reduction=reduction),
                lambda a: TF.nll_loss(TF.log_softmax(a, dim=1), torch.tensor(t),
                                      reduction=reduction), x)
    ignored = t.copy()
    ignored[[1, 4]] = -100
    compare(lambda a: F.nll_loss(a, ignored), lambda a: TF.nll_loss(a, torch.tensor(ignored)), x)
    dense = rng.integers(0, 3, (2, 9, 8))  # (N, C, d1, d2) against (N, d1, d2)
    compare(lambda a: F.nll_loss(a, dense, reduction="sum"),
            lambda a: TF.nll_loss(a, torch.tensor(dense), reduction="sum"), img)
    compare(lambda a: F.nll_loss(a[0, :, 0, 0], dense[0, 0, 0]),
            lambda a: TF.nll_loss(a[0, :, 0, 0], torch.tensor(dense[0, 0, 0])), img)
    compare(lambda a: F.max_pool2d(a, 2), lambda a: TF.max_pool2d(a, 2), img)
    compare(lambda a: F.max_pool2d(a, (3, 2), stride=(2, 1), padding=1),
            lambda a: TF.max_pool2d(a, (3, 2), stride=(2, 1), padding=1), img)
    y, idx = F.max_pool2d(minipar.tensor(img), 3, 2, 1, return_indices=True)
    y_t, idx_t = TF.max_pool2d(torch.tensor(img), 3, 2, 1, return_indices=True)
    np.testing.assert_array_equal(minipar.to_numpy(idx.data), idx_t.numpy())


def test_clone_is_a_copy_in_the_graph():
    """Tensor.clone(): its own memory, and the gradient flows through it, as torch's."""
    compare(lambda a: a.clone() * a, lambda a: a.clone() * a, rand(3, 4))
    x = minipar.tensor(rand(3), requires_grad=True)
    y = x.clone()
    y.data[0] = 100.0
    assert x.data[0] != 100.0 and y.requires_grad and not y.is_leaf


def test_item_assignment_where_torch_allows_it():
    """On a tensor that does not require grad, and on a leaf under no_grad(): as torch writes;
    on a leaf requiring grad outside no_grad() and on a tensor in the graph: a clear error."""
    a, b = rand(3, 4), rand(4)
    ours, theirs = minipar.tensor(a.copy()), torch.tensor(a.copy())
    for index, value in [(0, 5.0), ((1, slice(1, 3)), -1.0), (slice(None), b),
                         (np.array([2, 0]), minipar.tensor(b)), (ours.data > 1, 0.0)]:
        ours[index] = value
        t_index = torch.tensor(minipar.to_numpy(index)) if hasattr(index, "shape") else index
        theirs[t_index] = torch.tensor(value.numpy() if hasattr(value, "numpy") else value)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    w, w_t = minipar.tensor(a.copy(), requires_grad=True), torch.tensor(a.copy(), requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf that requires grad"):
        w[0, 0] = 1.0
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w_t[0, 0] = 1.0
    with minipar.no_grad():
        w[0] = 2.0
    with torch.no_grad():
        w_t[0] = 2.0
    compare_values = (w * w).sum()
    compare_values.backward()
    (w_t * w_t).sum().backward()
    np.testing.assert_array_equal(minipar.to_numpy(w.grad), w_t.grad.numpy())
    with pytest.raises(RuntimeError, match="tensor in the graph"):
        (w * 2)[0] = 1.0
