"""Tensor habits a PyTorch user brings (issue 40), each against torch 2.x: comparisons, dtype
casts, shape methods, clone/detach, item assignment, argmax, and the factory functions, with
the gradients torch gives where torch has one."""
import numpy as np
import pytest

import minipar
from minipar import Tensor

torch = pytest.importorskip("torch")
rng = np.random.default_rng(0)


def pair(*shape):
    data = rng.standard_normal(shape)
    return Tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons_are_bool_tensors_without_gradient(op):
    (a, ta), other = pair(3, 4), rng.standard_normal(4).round()
    a.data[0, :] = other  # some equal elements
    ta.data[0, :] = torch.tensor(other)
    for right, tright in ((Tensor(other), torch.tensor(other)), (0.0, 0.0)):
        got, want = eval(f"a {op} right"), eval(f"ta {op} tright")
        assert got.dtype == np.bool_ and not got.requires_grad
        assert (got.numpy() == want.numpy()).all()
    assert not (a == None) and (a != None)  # noqa: E711 (identity, as Python's fallback)


def test_tensors_keep_identity_hashing_and_bool_is_torchs():
    a, b = Tensor([1.0, 2.0]), Tensor([1.0, 2.0])
    assert len({a, b}) == 2 and {a: 1}[a] == 1
    assert bool(Tensor(3.0)) and not bool(Tensor([0.0]))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        bool(a == b)


def test_casts():
    x = Tensor([1.7, -2.2, 0.0])
    for name in ("long", "int", "bool", "float", "double"):
        got, want = getattr(x, name)(), getattr(torch.tensor([1.7, -2.2, 0.0]), name)()
        assert got.numpy().tolist() == want.numpy().tolist()
        assert got.dtype == want.numpy().dtype, name


@pytest.mark.parametrize("method, args", [
    ("squeeze", ()), ("squeeze", (1,)), ("squeeze", (0,)), ("unsqueeze", (0,)),
    ("unsqueeze", (-1,)), ("unsqueeze", (2,)), ("flatten", ()), ("flatten", (1,)),
    ("flatten", (0, 1)), ("view", (-1, 2)), ("view", (4, 2, 1)), ("permute", (2, 0, 1)),
    ("clone", ()),
])
def test_shape_methods_and_their_gradients(method, args):
    a, ta = pair(4, 1, 2)
    got, want = getattr(a, method)(*args), getattr(ta, method)(*args)
    assert got.shape == tuple(want.shape)
    np.testing.assert_array_equal(got.numpy(), want.detach().numpy())
    g = rng.standard_normal(got.shape)
    got.backward(g)
    want.backward(torch.tensor(g))
    np.testing.assert_array_equal(a.grad, ta.grad.numpy())


def test_unsqueeze_refuses_a_dimension_out_of_range():
    with pytest.raises(IndexError, match=r"\[-3, 2\], but got 3"):
        Tensor(np.ones((2, 2))).unsqueeze(3)


def test_detach_shares_memory_and_leaves_the_graph():
    a, _ = pair(3)
    d = a.detach()
    d[0] = 5.0
    assert a.data[0] == 5.0 and not d.requires_grad


def test_item_assignment_on_a_leaf_as_torch_allows_it():
    free = Tensor(np.zeros(3))
    free[1] = 2.0
    assert free.tolist() == [0.0, 2.0, 0.0]
    a, ta = pair(3)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in "
                                           "an in-place operation"):
        a[0] = 1.0
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ta[0] = 1.0
    with minipar.no_grad():
        a.copy_(np.arange(3.0))
    assert a.tolist() == [0.0, 1.0, 2.0]


def test_argmax_as_torch():
    x = rng.integers(0, 3, (4, 5)).astype(float)  # ties: the first wins, as in torch
    for kw in ({}, {"dim": 0}, {"dim": 1}, {"dim": 1, "keepdim": True}):
        got, want = Tensor(x).argmax(**kw), torch.tensor(x).argmax(**kw)
        assert got.shape == tuple(want.shape) and got.tolist() == want.tolist()
        assert got.dtype == np.int64


def test_factories_as_torch():
    assert minipar.arange(5).tolist() == torch.arange(5).tolist()
    assert minipar.arange(5).dtype == np.int64 and minipar.arange(0.0, 1.0, 0.25).dtype == np.float32
    np.testing.assert_array_equal(minipar.arange(1, 2, 0.25).numpy(), torch.arange(1, 2, 0.25))
    assert minipar.zeros(2, 3).shape == minipar.ones((2, 3)).shape == minipar.randn(2, 3).shape
    minipar.manual_seed(3)
    r = minipar.randint(2, 5, (100,))
    assert r.dtype == np.int64 and r.shape == (100,) and set(r.tolist()) == {2, 3, 4}
    assert minipar.randint(3, (4,)).shape == (4,)
    minipar.manual_seed(3)
    assert minipar.randint(2, 5, (100,)).tolist() == r.tolist()  # the seeded stream replays
    with pytest.raises(TypeError, match="size is required"):
        minipar.randint(3)
    for seed in (0, 7, 2**40 + 1):
        assert minipar.randperm(50, minipar.Generator().manual_seed(seed)).tolist() == \
            torch.randperm(50, generator=torch.Generator().manual_seed(seed)).tolist()


def test_cat_and_stack_with_their_gradients():
    (a, ta), (b, tb) = pair(2, 3), pair(2, 3)
    for ours, theirs in ((minipar.cat([a, b], dim=1), torch.cat([ta, tb], dim=1)),
                         (minipar.stack([a, b], dim=1), torch.stack([ta, tb], dim=1))):
        np.testing.assert_array_equal(ours.numpy(), theirs.detach().numpy())
        g = rng.standard_normal(ours.shape)
        ours.backward(g)
        theirs.backward(torch.tensor(g))
    np.testing.assert_array_equal(a.grad, ta.grad.numpy())
    np.testing.assert_array_equal(b.grad, tb.grad.numpy())


def test_torchs_namespace_from_import_minipar():
    import minipar as m
    assert m.nn.Linear and m.optim.SGD and m.distributed.all_reduce and m.long == np.int64
    assert m.nn.functional.cross_entropy is m.functional.cross_entropy
    assert m.utils.data.DataLoader and m.nn.parallel.DistributedDataParallel
    assert m.utils.data.distributed.DistributedSampler is m.parallel.data.DistributedSampler
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        m.nope


def test_size_numel_and_dim_as_torch_while_size_stays_a_count():
    (a, ta) = pair(3, 4, 5)
    assert a.size() == tuple(ta.size()) and a.size(1) == ta.size(1) and a.size(-1) == 5
    assert a.numel() == ta.numel() == 60 and a.dim() == ta.dim() == 3
    # uncalled, NumPy's element count: the library's own arithmetic keeps working
    assert a.size == 60 and a.size * 8 == 480 and isinstance(a.size, int)
    with pytest.raises(IndexError):
        a.size(3)
