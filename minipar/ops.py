"""Differentiable ops: each computes its forward and defines its backward right beside it.

Every op has the same shape (micrograd's): unwrap the inputs, compute the output array, and give
``make_result`` a ``backward(g)`` that returns one gradient per input tensor. The bottom of this
file installs them as ``Tensor`` methods and operators (``+ - * / ** @``, indexing, ``.sum()`` ...).

Broadcasting: NumPy stretches size-1 and missing leading axes in the forward pass; in the backward
pass each input's gradient is the output gradient summed back over the axes it was stretched along
(``unbroadcast``).
"""
import numbers

from . import backend
from .autograd import Tensor, as_tensor, make_result


# --- helpers ------------------------------------------------------------------------------------
def unbroadcast(g, shape):
    """Sum ``g`` down to ``shape``: over added leading axes, then over axes that were size 1."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g


def _operands(a, b):
    """Tensor inputs stay tensors; Python numbers stay numbers (NumPy's weak scalar typing)."""
    a = a if isinstance(a, (Tensor, numbers.Number)) else as_tensor(a)
    b = b if isinstance(b, (Tensor, numbers.Number)) else as_tensor(b)
    return a, b


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def _binary(name, fn, a, b, backward_a, backward_b):
    """out = fn(a, b) with broadcasting; ``backward_x(g)`` is dL/dx before un-broadcasting.

    The closure keeps only shapes and flags of the inputs: an input's array stays alive for
    backward only if ``backward_a``/``backward_b`` reads it (``mul`` does, ``add`` does not).
    """
    a, b = _operands(a, b)
    try:
        out = fn(_data(a), _data(b))
    except ValueError as e:
        raise ValueError(f"{name}: cannot broadcast shapes {_shape(a)} and {_shape(b)} ({e})") \
            from None
    tensors = [x for x in (a, b) if isinstance(x, Tensor)]
    needs = [(grad_fn, x.shape, x.requires_grad)
             for x, grad_fn in ((a, backward_a), (b, backward_b)) if isinstance(x, Tensor)]

    def backward(g):
        return [unbroadcast(grad_fn(g), shape) if wanted else None
                for grad_fn, shape, wanted in needs]

    return make_result(out, tensors, backward, name)


def _shape(x):
    return x.shape if isinstance(x, Tensor) else "scalar"


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, tuple) else (axis,)
    return tuple(ax % ndim if ndim else ax for ax in axes)


def _expand_reduced(g, shape, axis, keepdims):
    """Re-insert the reduced axes of ``g`` (size 1) so it broadcasts against the input."""
    if keepdims or not shape:
        return g
    for ax in sorted(_axes(axis, len(shape))):
        g = backend.get_array_module(g).expand_dims(g, ax)
    return g


# --- arithmetic ---------------------------------------------------------------------------------
def add(a, b):
    return _binary("add", lambda x, y: x + y, a, b, lambda g: g, lambda g: g)


def sub(a, b):
    return _binary("sub", lambda x, y: x - y, a, b, lambda g: g, lambda g: -g)


def mul(a, b):
    return _binary("mul", lambda x, y: x * y, a, b,
                   lambda g: g * _data(b), lambda g: g * _data(a))


def div(a, b):
    return _binary("div", lambda x, y: x / y, a, b,
                   lambda g: g / _data(b), lambda g: -g * _data(a) / (_data(b) * _data(b)))


def power(a, b):
    """a ** b; d/da = b·a^(b−1), d/db = a^b·ln a (defined for a > 0)."""
    def grad_b(g):
        xp = backend.get_array_module(_data(a))
        return g * (_data(a) ** _data(b)) * xp.log(_data(a))
    return _binary("pow", lambda x, y: x ** y, a, b,
                   lambda g: g * _data(b) * _data(a) ** (_data(b) - 1), grad_b)


def neg(a):
    return make_result(-a.data, (a,), lambda g: (-g,), "neg")


def matmul(a, b):
    """a @ b over the last two axes, batch axes broadcast; 1-D operands as in NumPy.

    dL/da = g @ bᵀ, dL/db = aᵀ @ g (summed over broadcast batch axes).
    """
    a, b = as_tensor(a), as_tensor(b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: both operands need at least one axis, got shapes "
                         f"{a.shape} and {b.shape} (use * for scalars)")
    if a.ndim == 1 and b.ndim == 1:
        if a.shape != b.shape:
            raise ValueError(f"matmul: vectors of lengths {a.shape[0]} and {b.shape[0]} differ")
        return sum_(mul(a, b))
    if a.ndim == 1:
        return matmul(a.reshape(1, -1), b).reshape(b.shape[:-2] + b.shape[-1:])
    if b.ndim == 1:
        return matmul(a, b.reshape(-1, 1)).reshape(a.shape[:-1])
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: shapes {a.shape} @ {b.shape} do not fit: the inner dimensions "
                         f"{a.shape[-1]} (last of the left) and {b.shape[-2]} (second-last of the "
                         f"right) differ")
    try:
        out = a.data @ b.data
    except ValueError as e:
        raise ValueError(f"matmul: batch shapes of {a.shape} and {b.shape} do not broadcast "
                         f"({e})") from None
    ad, bd = a.data, b.data
    (sa, need_a), (sb, need_b) = (a.shape, a.requires_grad), (b.shape, b.requires_grad)

    def backward(g):
        ga = unbroadcast(g @ bd.swapaxes(-1, -2), sa) if need_a else None
        gb = unbroadcast(ad.swapaxes(-1, -2) @ g, sb) if need_b else None
        return ga, gb

    return make_result(out, (a, b), backward, "matmul")


# --- elementwise functions ----------------------------------------------------------------------
def exp(a):
    out = backend.get_array_module(a.data).exp(a.data)
    return make_result(out, (a,), lambda g: (g * out,), "exp")


def log(a):
    xp = backend.get_array_module(a.data)
    x = a.data
    return make_result(xp.log(x), (a,), lambda g: (g / x,), "log")


def sqrt(a):
    out = backend.get_array_module(a.data).sqrt(a.data)
    return make_result(out, (a,), lambda g: (g * 0.5 / out,), "sqrt")


def tanh(a):
    out = backend.get_array_module(a.data).tanh(a.data)
    return make_result(out, (a,), lambda g: (g * (1 - out * out),), "tanh")


def sigmoid(a):
    xp = backend.get_array_module(a.data)
    out = 0.5 * (xp.tanh(0.5 * a.data) + 1)  # = 1/(1+e^-x) without overflow
    return make_result(out, (a,), lambda g: (g * out * (1 - out),), "sigmoid")


def relu(a):
    positive = a.data > 0
    return make_result(a.data * positive, (a,), lambda g: (g * positive,), "relu")


def abs_(a):
    xp = backend.get_array_module(a.data)
    sign = xp.sign(a.data)
    return make_result(xp.abs(a.data), (a,), lambda g: (g * sign,), "abs")


def where(condition, a, b):
    """Elementwise choice: a where condition holds, else b (both broadcast)."""
    cond = _data(condition)
    xp = backend.get_array_module(cond)
    return _binary("where", lambda x, y: xp.where(cond, x, y), a, b,
                   lambda g: xp.where(cond, g, 0), lambda g: xp.where(cond, 0, g))


def masked_fill(a, mask, value):
    """Copy of ``a`` with ``value`` where ``mask`` is true; no gradient flows to filled places."""
    mask = _data(mask)
    xp = backend.get_array_module(a.data)
    try:
        out = xp.where(mask, xp.asarray(value, dtype=a.dtype), a.data)
    except ValueError:
        raise ValueError(f"masked_fill: mask of shape {mask.shape} does not broadcast to "
                         f"{a.shape}") from None
    if out.shape != a.shape:
        raise ValueError(f"masked_fill: mask of shape {mask.shape} would change the shape "
                         f"{a.shape} to {out.shape}")
    return make_result(out, (a,), lambda g: (xp.where(mask, 0, g),), "masked_fill")


# --- reductions ---------------------------------------------------------------------------------
def sum_(a, axis=None, keepdims=False):
    xp = backend.get_array_module(a.data)
    shape = a.shape  # sum needs only the input's shape, not its values

    def backward(g):
        return (xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims), shape),)

    out = xp.asarray(a.data.sum(axis=axis, keepdims=keepdims))  # 0-d array, not a NumPy scalar
    return make_result(out, (a,), backward, "sum")


def mean(a, axis=None, keepdims=False):
    n = 1
    for ax in _axes(axis, a.ndim):
        n *= a.shape[ax]
    xp = backend.get_array_module(a.data)
    shape = a.shape

    def backward(g):
        return (xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims) / n, shape),)

    out = xp.asarray(a.data.mean(axis=axis, keepdims=keepdims))
    return make_result(out, (a,), backward, "mean")


def _extremum(name, reduce_fn, a, axis, keepdims):
    """max/min: the gradient goes to the extreme elements, split evenly among ties."""
    out = reduce_fn(a.data, axis=axis, keepdims=True)
    x = a.data

    def backward(g):
        hit = x == out
        count = hit.sum(axis=axis, keepdims=True)
        return (hit * (_expand_reduced(g, a.shape, axis, keepdims) / count),)

    result = out if keepdims else out.reshape(tuple(
        n for i, n in enumerate(a.shape) if i not in _axes(axis, a.ndim)))
    return make_result(result, (a,), backward, name)


def max_(a, axis=None, keepdims=False):
    return _extremum("max", lambda x, **kw: x.max(**kw), a, axis, keepdims)


def min_(a, axis=None, keepdims=False):
    return _extremum("min", lambda x, **kw: x.min(**kw), a, axis, keepdims)


# --- shapes -------------------------------------------------------------------------------------
def reshape(a, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    try:
        out = a.data.reshape(shape)
    except ValueError:
        raise ValueError(f"reshape: cannot reshape {a.shape} ({a.size} elements) into "
                         f"{tuple(shape)}") from None
    shape_in = a.shape
    return make_result(out, (a,), lambda g: (g.reshape(shape_in),), "reshape")


def permute(a, *axes):
    axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    if sorted(ax % a.ndim for ax in axes) != list(range(a.ndim)):
        raise ValueError(f"permute: {tuple(axes)} is not a permutation of the {a.ndim} axes "
                         f"of a tensor of shape {a.shape}")
    inverse = backend.get_array_module(a.data).argsort(
        backend.get_array_module(a.data).asarray([ax % a.ndim for ax in axes])).tolist()
    return make_result(a.data.transpose(axes), (a,), lambda g: (g.transpose(inverse),), "permute")


def transpose(a, dim0=-2, dim1=-1):
    """Swap two axes (the last two by default, a matrix transpose)."""
    return make_result(a.data.swapaxes(dim0, dim1), (a,), lambda g: (g.swapaxes(dim0, dim1),),
                       "transpose")


def getitem(a, index):
    """Indexing and slicing, basic or advanced; repeated indices accumulate their gradients."""
    index = _data(index) if isinstance(index, Tensor) else index
    if isinstance(index, tuple):
        index = tuple(_data(i) if isinstance(i, Tensor) else i for i in index)
    xp = backend.get_array_module(a.data)
    out = a.data[index]
    shape, dtype = a.shape, a.dtype

    def backward(g):
        grad = xp.zeros(shape, dtype)
        xp.add.at(grad, index, g)
        return (grad,)

    return make_result(out, (a,), backward, "getitem")


def embedding(weight, ids):
    """Rows of ``weight`` picked by integer ``ids`` (any shape): out[..., :] = weight[ids[...]].

    Backward scatters-adds each output row's gradient into the row it came from.
    """
    ids = _data(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        raise IndexError(f"embedding: ids must lie in [0, {weight.shape[0]}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    xp = backend.get_array_module(weight.data)
    shape, dtype = weight.shape, weight.dtype

    def backward(g):
        grad = xp.zeros(shape, dtype)
        xp.add.at(grad, ids.reshape(-1), g.reshape(-1, shape[1]))
        return (grad,)

    return make_result(weight.data[ids], (weight,), backward, "embedding")


def gather(a, dim, index):
    """torch.gather: out[i][j] = a[i][index[i][j]] for dim=1 (likewise for any dim)."""
    index = _data(index)
    xp = backend.get_array_module(a.data)
    dim = dim % a.ndim
    out = xp.take_along_axis(a.data, index, axis=dim)
    shape, dtype = a.shape, a.dtype

    def backward(g):
        grad = xp.zeros(shape, dtype)
        where = list(xp.indices(index.shape, sparse=True))
        where[dim] = index
        xp.add.at(grad, tuple(where), g)
        return (grad,)

    return make_result(out, (a,), backward, "gather")


def concat(tensors, axis=0):
    tensors = [as_tensor(t) for t in tensors]
    xp = backend.get_array_module(tensors[0].data)
    try:
        out = xp.concatenate([t.data for t in tensors], axis=axis)
    except ValueError as e:
        raise ValueError(f"concat: shapes {[t.shape for t in tensors]} do not fit along axis "
                         f"{axis} ({e})") from None
    bounds = [0]
    for t in tensors:
        bounds.append(bounds[-1] + t.shape[axis])

    def backward(g):
        return [xp.take(g, xp.arange(lo, hi), axis=axis) for lo, hi in zip(bounds, bounds[1:])]

    return make_result(out, tensors, backward, "concat")


def stack(tensors, axis=0):
    tensors = [as_tensor(t) for t in tensors]
    xp = backend.get_array_module(tensors[0].data)
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"stack: all tensors need the same shape, got {[t.shape for t in tensors]}")
    out = xp.stack([t.data for t in tensors], axis=axis)

    def backward(g):
        return [xp.take(g, i, axis=axis) for i in range(len(tensors))]

    return make_result(out, tensors, backward, "stack")


def split(a, split_size_or_sections, axis=0):
    """torch.split: pieces of ``split_size`` along ``axis`` (the last may be shorter), or of the
    listed sizes. Each piece is its own op, so unused pieces cost nothing in backward."""
    n = a.shape[axis]
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split: size must be positive, got {split_size_or_sections}")
        sizes = [min(split_size_or_sections, n - lo) for lo in range(0, n, split_size_or_sections)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} add up to {sum(sizes)}, not to the axis "
                             f"length {n}")
    pieces, lo = [], 0
    for size in sizes:
        index = [slice(None)] * a.ndim
        index[axis] = slice(lo, lo + size)
        pieces.append(getitem_slice(a, tuple(index)))
        lo += size
    return pieces


def getitem_slice(a, index):
    """Basic slicing only (no repeated elements), so backward is a plain slice assignment."""
    xp = backend.get_array_module(a.data)
    shape, dtype = a.shape, a.dtype

    def backward(g):
        grad = xp.zeros(shape, dtype)
        grad[index] = g
        return (grad,)

    return make_result(a.data[index], (a,), backward, "slice")


def astype(a, dtype):
    """A copy in another dtype; the gradient is cast back to the input's dtype."""
    src = a.dtype
    out = a.data.astype(dtype)
    if out.dtype.kind not in "fc":
        return Tensor(out)
    return make_result(out, (a,), lambda g: (g.astype(src),), "astype")


# --- Tensor methods and operators ---------------------------------------------------------------
def _is_basic_index(index):
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (slice, int, type(None), type(Ellipsis))) for p in parts)


def _getitem(a, index):
    return getitem_slice(a, index) if _is_basic_index(index) else getitem(a, index)


Tensor.__add__ = add
Tensor.__radd__ = lambda a, b: add(b, a)
Tensor.__sub__ = sub
Tensor.__rsub__ = lambda a, b: sub(b, a)
Tensor.__mul__ = mul
Tensor.__rmul__ = lambda a, b: mul(b, a)
Tensor.__truediv__ = div
Tensor.__rtruediv__ = lambda a, b: div(b, a)
Tensor.__pow__ = power
Tensor.__rpow__ = lambda a, b: power(b, a)
Tensor.__matmul__ = matmul
Tensor.__rmatmul__ = lambda a, b: matmul(b, a)
Tensor.__neg__ = neg
Tensor.__getitem__ = _getitem
Tensor.exp = exp
Tensor.log = log
Tensor.sqrt = sqrt
Tensor.tanh = tanh
Tensor.sigmoid = sigmoid
Tensor.relu = relu
Tensor.abs = abs_
Tensor.sum = sum_
Tensor.mean = mean
Tensor.max = max_
Tensor.min = min_
Tensor.reshape = reshape
Tensor.view = reshape
Tensor.permute = permute
Tensor.transpose = transpose
Tensor.T = property(lambda a: permute(a, tuple(reversed(range(a.ndim)))))
Tensor.masked_fill = masked_fill
Tensor.gather = gather
Tensor.astype = astype
Tensor.split = split
Tensor.float = lambda a: astype(a, "float32")
Tensor.double = lambda a: astype(a, "float64")
