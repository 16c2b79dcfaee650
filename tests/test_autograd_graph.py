"""The graph's rules (accumulation, no_grad, detach, release, hooks) and clear errors on bad input."""
import numpy as np
import pytest

import minipar
from minipar import backend, to_numpy


def leaf(*shape, seed=0):
    return minipar.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def test_tensor_defaults_like_pytorch():
    assert minipar.tensor([1.0, 2.0]).dtype == np.float32
    assert minipar.tensor([1, 2]).dtype.kind == "i"
    assert minipar.tensor(np.zeros(2)).dtype == np.float64
    x = minipar.tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()
    np.testing.assert_array_equal(to_numpy(x.grad), [[2.0, 4.0]])
    assert x.grad.dtype == np.float32
    assert (x * 2.0).dtype == np.float32  # Python scalars do not up-cast


def test_gradients_accumulate_across_backward_calls():
    x = leaf(3)
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), np.full(3, 5.0))
    x.zero_grad()
    assert x.grad is None


def test_no_grad_detach_and_requires_grad_flags():
    x = leaf(2, 2)
    with minipar.no_grad():
        y = x * 2
    assert not y.requires_grad and y.is_leaf
    assert minipar.is_grad_enabled()
    w = x * 2
    d = w.detach()
    assert not d.requires_grad and d.is_leaf
    assert d.data is w.data  # detach shares the array, it does not copy


def test_backward_with_explicit_gradient():
    x = leaf(2, 3)
    y = x * 3
    g = np.arange(6.0).reshape(2, 3)
    y.backward(g)
    np.testing.assert_allclose(to_numpy(x.grad), 3 * g)


def test_graph_released_after_backward():
    x = leaf(3)
    y = (x.exp() * 2).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_shared_subgraph_released_by_first_backward():
    x = leaf(3)
    h = x.tanh()
    (h * 2).sum().backward()
    with pytest.raises(RuntimeError, match="second time.*retain_graph=True"):
        (h * 3).sum().backward()


def test_retain_graph_allows_second_backward():
    x = leaf(3)
    y = (x.exp() * 2).sum()
    y.backward(retain_graph=True)
    first = x.grad.copy()
    y.backward()
    np.testing.assert_allclose(to_numpy(x.grad), 2 * to_numpy(first))


def test_retain_grad_and_hooks():
    x = leaf(3)
    h = (x * 2).retain_grad()
    h.register_hook(lambda g: g * 10)
    seen = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.copy()))
    (h * h).sum().backward()
    np.testing.assert_allclose(to_numpy(h.grad), 10 * 2 * h.numpy())
    np.testing.assert_allclose(to_numpy(x.grad), 2 * 10 * 2 * h.numpy())
    assert len(seen) == 1 and np.allclose(to_numpy(seen[0]), to_numpy(x.grad))


def test_post_accumulate_hook_sees_the_full_gradient_of_a_reused_leaf():
    x = leaf(2)
    seen = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.copy()))
    (x * 2 + x * 3 + x.exp()).sum().backward()
    assert len(seen) == 1
    np.testing.assert_allclose(to_numpy(seen[0]), 5 + np.exp(x.numpy()))


def test_deep_graph_needs_no_recursion():
    x = leaf(2)
    y = x
    for _ in range(5000):
        y = y * 1.0001
    y.sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), np.full(2, 1.0001 ** 5000))


# --- bad input: each gets a clear error naming the problem -------------------------------------
def test_matmul_shape_mismatch():
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 3\) @ \(4, 5\).*inner dimensions 3"):
        leaf(2, 3) @ leaf(4, 5)
    with pytest.raises(ValueError, match="batch shapes"):
        leaf(2, 2, 3) @ leaf(3, 3, 4)


def test_broadcast_mismatch():
    with pytest.raises(ValueError, match=r"add: cannot broadcast shapes \(2, 3\) and \(4,\)"):
        leaf(2, 3) + leaf(4)
    with pytest.raises(ValueError, match=r"mul: cannot broadcast"):
        leaf(2, 3) * leaf(3, 2)


def test_backward_on_non_scalar_without_gradient():
    y = leaf(2, 3) * 2
    with pytest.raises(RuntimeError, match=r"needs a scalar output, got shape \(2, 3\)"):
        y.backward()
    with pytest.raises(ValueError, match=r"grad has shape \(3,\) but the tensor has shape \(2, 3\)"):
        y.backward(np.ones(3))


def test_backward_without_requires_grad():
    with pytest.raises(RuntimeError, match="does not require grad"):
        minipar.tensor([1.0, 2.0]).sum().backward()


def test_integer_tensors_cannot_require_grad():
    with pytest.raises(TypeError, match="only floating-point tensors can require gradients.*int"):
        minipar.tensor([1, 2, 3], requires_grad=True)
    with pytest.raises(TypeError, match="floating-point"):
        minipar.tensor([1, 2]).requires_grad_()


def test_other_shape_errors():
    with pytest.raises(ValueError, match=r"reshape: cannot reshape \(2, 3\)"):
        leaf(2, 3).reshape(4, 2)
    with pytest.raises(ValueError, match="not a permutation"):
        leaf(2, 3).permute(0, 0)
    with pytest.raises(ValueError, match="concat"):
        minipar.concat([leaf(2, 3), leaf(3, 3)], axis=1)
    with pytest.raises(ValueError, match="stack: all tensors need the same shape"):
        minipar.stack([leaf(2, 3), leaf(3, 3)])
    with pytest.raises(ValueError, match="add up to 4, not to the axis length 5"):
        leaf(5).split([1, 3])
    with pytest.raises(ValueError, match="item"):
        leaf(2).item()


def test_embedding_and_cross_entropy_errors():
    from minipar import functional as F
    w = leaf(4, 3)
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 4\)"):
        minipar.embedding(w, np.array([0, 4]))
    with pytest.raises(TypeError, match="ids must be integers"):
        minipar.embedding(w, np.array([0.0]))
    with pytest.raises(ValueError, match=r"target of shape \(2,\)"):
        F.cross_entropy(leaf(2, 5), np.array([1, 2, 3]))
    with pytest.raises(IndexError, match=r"target values must lie in \[0, 5\)"):
        F.cross_entropy(leaf(2, 5), np.array([1, 7]))
    with pytest.raises(TypeError, match="integer class indices"):
        F.cross_entropy(leaf(2, 5), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout(leaf(2), 1.0)


def test_backend_device_choice(monkeypatch):
    assert backend.set_device("cpu") == "cpu"
    assert backend.xp() is np
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.set_device("tpu")
    if backend._cupy_or_none() is None:
        with pytest.raises(RuntimeError, match="CuPy or a CUDA device is not available"):
            backend.set_device("gpu")
    backend.set_device("auto")
    a = np.arange(3)
    assert backend.to_numpy(a) is a
    assert backend.get_array_module(a) is np


def test_sums_of_gradients_never_write_into_a_shared_array():
    """add hands both inputs one array; a node summing several uses adds into its own array
    only, so the other input's gradient stays as it was."""
    x = leaf(4)
    a, b = x * 2, x * 5
    ((a + b) + a * 3 + a * 4).sum().backward()  # a gets g three times, the first one b's too
    np.testing.assert_allclose(to_numpy(x.grad), np.full(4, 2 * (1 + 3 + 4) + 5))


def test_leaf_gradients_accumulate_in_place_after_the_first_sum():
    """Like torch: the first backward's array is kept as it is (it may be another leaf's too),
    the second makes the leaf its own sum, later ones add into that array."""
    a, b = leaf(3), leaf(3, seed=1)
    (a + b).sum().backward()
    first = a.grad
    assert b.grad is first  # one array for both leaves
    (a + b).sum().backward()
    own = a.grad
    assert own is not first and b.grad is not own
    (a + b).sum().backward()
    assert a.grad is own  # added in place
    np.testing.assert_array_equal(to_numpy(first), np.ones(3))
    np.testing.assert_array_equal(to_numpy(a.grad), np.full(3, 3.0))
    np.testing.assert_array_equal(to_numpy(b.grad), np.full(3, 3.0))
    a.grad = first  # a gradient set from outside is not the engine's to change
    (a + b).sum().backward()
    np.testing.assert_array_equal(to_numpy(first), np.ones(3))
    np.testing.assert_array_equal(to_numpy(a.grad), np.full(3, 2.0))


def test_scalar_gradients_accumulate_too():
    """0-d arithmetic gives NumPy scalars, which take no weak reference: summed all the same."""
    x = minipar.tensor(np.float32(2.0), requires_grad=True)
    for _ in range(3):
        (x * x + x).backward()
    assert float(to_numpy(x.grad)) == 15.0
