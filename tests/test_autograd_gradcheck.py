"""Every op's backward against central finite differences in float64, broadcasting included."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import minipar
import minipar.functional as F
from minipar.gradcheck import gradcheck

SETTINGS = settings(max_examples=25, deadline=None)
rng = np.random.default_rng(0)


def rand(*shape, positive=False):
    a = rng.standard_normal(shape)
    return np.abs(a) + 0.5 if positive else a


pair_shapes = mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3)


@SETTINGS
@given(shapes=pair_shapes, op=st.sampled_from(["add", "sub", "mul", "div", "pow"]))
def test_binary_ops_broadcast(shapes, op):
    sa, sb = shapes.input_shapes
    positive = op in ("div", "pow")
    fns = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a / b, "pow": lambda a, b: a ** b}
    gradcheck(fns[op], rand(*sa, positive=positive), rand(*sb, positive=positive))


@pytest.mark.parametrize("scalar_left", [False, True])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
def test_binary_ops_with_python_scalars(op, scalar_left):
    fns = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a / b, "pow": lambda a, b: a ** b}
    if scalar_left:
        gradcheck(lambda a: fns[op](1.7, a), rand(3, 2, positive=True))
    else:
        gradcheck(lambda a: fns[op](a, 1.7), rand(3, 2, positive=True))


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sigmoid", "relu", "neg", "abs"])
def test_unary_ops(name):
    positive = name in ("log", "sqrt")
    x = rand(2, 3, 4, positive=positive)
    if name in ("relu", "abs"):
        x = np.where(np.abs(x) < 1e-3, 0.5, x)  # keep away from the kink
    fn = (lambda a: -a) if name == "neg" else (lambda a: getattr(a, name)())
    gradcheck(fn, x)


@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, base_shape=(2, 3), min_dims=2,
                                            max_dims=4, max_side=3),
       k=st.integers(1, 3))
def test_matmul_batched_broadcast(shapes, k):
    sa, sb = shapes.input_shapes
    a = rand(*sa[:-2], 2, k)
    b = rand(*sb[:-2], k, 3)
    gradcheck(lambda x, y: x @ y, a, b)


@pytest.mark.parametrize("sa,sb", [((3,), (3,)), ((3,), (3, 2)), ((2, 3), (3,)),
                                   ((4, 2, 3), (3,))])
def test_matmul_vectors(sa, sb):
    gradcheck(lambda x, y: x @ y, rand(*sa), rand(*sb))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(op, axis, keepdims):
    gradcheck(lambda a: getattr(a, op)(axis=axis, keepdims=keepdims), rand(2, 3, 4))


def test_shape_ops():
    x = rand(2, 3, 4)
    gradcheck(lambda a: a.reshape(4, 6), x)
    gradcheck(lambda a: a.reshape(-1), x)
    gradcheck(lambda a: a.permute(2, 0, 1), x)
    gradcheck(lambda a: a.transpose(0, 2), x)
    gradcheck(lambda a: a.T, x)
    gradcheck(lambda a: a.astype("float64") * 2, x)


@pytest.mark.parametrize("index", [
    (slice(None), 1), (0,), (slice(0, 2), slice(None), slice(1, 4, 2)), (Ellipsis, -1),
    (None, 1), (np.array([0, 0, 1]),), (slice(None), np.array([2, 0, 2])),
    (np.array([1, 0]), np.array([2, 2])),
])
def test_indexing(index):
    gradcheck(lambda a: a[index], rand(2, 3, 4))


def test_boolean_mask_indexing():
    x = rand(3, 4)
    mask = x > 0
    gradcheck(lambda a: a[mask], x)


def test_embedding_and_gather():
    ids = np.array([[0, 2, 2], [1, 0, 3]])
    gradcheck(lambda w: minipar.embedding(w, ids), rand(4, 5))
    index = np.array([[0, 2, 2, 1], [1, 1, 0, 3]])
    gradcheck(lambda a: a.gather(1, index), rand(2, 4))
    gradcheck(lambda a: a.gather(0, np.array([[1, 0, 1, 1]])), rand(2, 4))


def test_concat_stack_split():
    a, b, c = rand(2, 3), rand(2, 1), rand(2, 2)
    gradcheck(lambda x, y, z: minipar.concat([x, y, z], axis=1), a, b, c)
    gradcheck(lambda x, y: minipar.stack([x, y], axis=1), rand(2, 3), rand(2, 3))
    gradcheck(lambda x: minipar.concat(x.split(2, axis=1)[::-1], axis=1) * 1.5, rand(3, 5))
    gradcheck(lambda x: x.split([1, 4], axis=1)[1], rand(3, 5))


def test_masked_fill_and_where():
    mask = rand(3, 4) > 0
    gradcheck(lambda a: a.masked_fill(mask, -3.0), rand(3, 4))
    gradcheck(lambda a, b: minipar.where(mask, a, b), rand(3, 4), rand(1, 4))


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_family(axis):
    x = rand(3, 5)
    gradcheck(lambda a: F.softmax(a, axis=axis), x)
    gradcheck(lambda a: F.log_softmax(a, axis=axis), x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction):
    target = np.array([[1, 0, 4], [2, -100, 3]])
    gradcheck(lambda z: F.cross_entropy(z, target, reduction=reduction), rand(2, 3, 5))


def test_gelu_layer_norm_linear_dropout():
    gradcheck(F.gelu, rand(3, 4))
    gradcheck(lambda x, w, b: F.layer_norm(x, w, b), rand(2, 3, 6), rand(6), rand(6))
    gradcheck(lambda x: F.layer_norm(x), rand(4, 6))
    gradcheck(lambda x, w, b: F.linear(x, w, b), rand(2, 3, 4), rand(5, 4), rand(5))
    gradcheck(lambda x, w: F.linear(x, w), rand(3, 4), rand(5, 4))

    def drop(x):
        minipar.manual_seed(3)  # the same mask on every call
        return F.dropout(x, 0.3)
    gradcheck(drop, rand(4, 5))


def test_causal_attention():
    q, k, v = rand(2, 2, 4, 3), rand(2, 2, 4, 3), rand(2, 2, 4, 3)
    gradcheck(F.causal_self_attention, q, k, v)

    def with_dropout(q, k, v):
        minipar.manual_seed(5)
        return F.causal_self_attention(q, k, v, dropout_p=0.25)
    gradcheck(with_dropout, q, k, v)


def test_composite_graph_with_reuse():
    """A value used several times: contributions add up (the multivariate chain rule)."""
    def f(x, w):
        h = (x @ w).tanh()
        return (h * h + h).sum(axis=1) / (1 + (x * x).mean())
    gradcheck(f, rand(3, 4), rand(4, 2))


def test_causal_softmax_and_attention_heads():
    gradcheck(lambda s: F.causal_softmax(s, 0.5), rand(2, 4, 4))
    gradcheck(lambda qkv: F.attention_heads(qkv, 2), rand(2, 4, 12))

    def with_dropout(qkv):
        minipar.manual_seed(5)
        return F.attention_heads(qkv, 2, dropout_p=0.25)
    gradcheck(with_dropout, rand(2, 4, 12))


def test_attention_heads_equals_attention_on_split_heads_with_dropout():
    """The same dropout mask is drawn either way: the two paths agree bit for bit in shape."""
    qkv = rand(2, 4, 12)
    minipar.manual_seed(7)
    fused = F.attention_heads(minipar.tensor(qkv), 2, dropout_p=0.5).numpy()
    q, k, v = qkv.reshape(2, 4, 3, 2, 2).transpose(2, 0, 3, 1, 4)
    minipar.manual_seed(7)
    split = F.causal_self_attention(q, k, v, dropout_p=0.5).numpy()
    np.testing.assert_allclose(fused, split.transpose(0, 2, 1, 3).reshape(2, 4, 4), rtol=1e-12)


def test_fused_attention_bad_shapes():
    with pytest.raises(ValueError, match=r"causal_softmax: .*square \(T, T\).*\(3, 4\)"):
        F.causal_softmax(rand(3, 4))
    with pytest.raises(ValueError, match=r"attention_heads: .*n_head=2, got \(2, 4, 9\)"):
        F.attention_heads(rand(2, 4, 9), 2)
