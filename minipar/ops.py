"""Differentiable ops on backend arrays: each forward and its backward side by side.

Every op has one shape (torch.autograd.Function's, written as micrograd writes its ops): it takes
arrays (Python numbers where an operand may be one, options by keyword) and returns its output
array and, right beside it, one gradient function per array input, ``g -> dL/d(input)``:

    def mul(a, b):
        return a * b, (lambda g: g * b, lambda g: g * a)

Ops know nothing of tensors or graphs: ``autograd.apply`` unwraps the tensors, runs the op, and in
backward calls only the gradient functions of inputs that require grad. A gradient function keeps
alive exactly the arrays it reads (``add``'s keep none): what ``memory.ActivationMemory`` counts.
A trailing underscore (``sum_``) only avoids a builtin's name; the graph records it as ``sum``.
"""
import functools
import itertools

from . import backend


# --- helpers ------------------------------------------------------------------------------------
# Broadcasting: NumPy stretches size-1 and missing leading axes in the forward pass; in the
# backward pass each input's gradient is the output gradient summed back over the axes it was
# stretched along. ``apply`` calls this, so a gradient function may return the broadcast shape.
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


def _broadcast(name, fn, a, b):
    """fn(a, b), naming the op and both shapes if they do not broadcast."""
    # A Python number with a bfloat16 array: torch computes in float32 ("opmath") and rounds
    # back to bfloat16 once, so a number never widens a tensor. NumPy widens to float32, or
    # (NumPy 2 with ml_dtypes 0.7) rounds the number to bfloat16 first: float32 here gives
    # torch's bits under either
    array, other = (a, b) if hasattr(a, "dtype") else (b, a)
    opmath = array.dtype == backend.bfloat16 and not hasattr(other, "dtype")
    if opmath:
        a, b = (x.astype("float32") if x is array else x for x in (a, b))
    try:
        out = fn(a, b)
    except ValueError as e:
        raise ValueError(f"{name}: cannot broadcast shapes {_shape(a)} and {_shape(b)} ({e})") \
            from None
    return out.astype(backend.bfloat16) if opmath else out


def _shape(x):
    return x.shape if hasattr(x, "shape") else "scalar"


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, tuple) else (axis,)
    return tuple(ax % ndim if ndim else ax for ax in axes)


def _expand_reduced(g, shape, axis, keepdims):
    """Re-insert the reduced axes of ``g`` (size 1) so it broadcasts against the input."""
    if keepdims or not shape:
        return g
    axes = _axes(axis, len(shape))  # one reshape, not an expand_dims per axis
    return g.reshape(tuple(1 if i in axes else n for i, n in enumerate(shape)))


# --- 16-bit products and autocast ---------------------------------------------------------------
# Tensor cores multiply 16-bit operands exactly, add the products in float32 and round the result
# once. NumPy has no 16-bit GEMM (its float16 @ sums in float16, ml_dtypes' bf16 @ gives
# float32), so minipar does the same sums as a float32 GEMM of the upcasts (which are exact).
def upcast(a):
    """A 16-bit array as float32 (exactly), any other as it is."""
    return a.astype("float32") if backend.is_low_precision(a.dtype) else a


def low_precision(product, *arrays, out=None):
    """``product(*arrays)`` (None entries passed through) with 16-bit operands multiplied as
    tensor cores do: upcast to float32, and when all are of one 16-bit dtype the result rounded
    once to it (into ``out`` if given); a 16-bit operand beside a wider one gives the wider."""
    # (the size first: float32 operands, the common case, skip the call; every GEMM comes here)
    low = {a.dtype for a in arrays
           if a is not None and a.dtype.itemsize == 2 and backend.is_low_precision(a.dtype)}
    if not low:
        return product(*arrays) if out is None else product(*arrays, out=out)
    if len(low) > 1:
        raise TypeError(f"a product of {' and '.join(map(str, low))} operands: cast them to one "
                        f"16-bit dtype first")
    (low,) = low
    operands = [None if a is None else upcast(a) for a in arrays]
    if any(a is not None and a.dtype != low for a in arrays):  # beside a wider one: the wider
        return product(*operands) if out is None else product(*operands, out=out)
    result = product(*operands).astype(low)
    if out is None:
        return result
    out[...] = result
    return out


@functools.cache
def _autocast():
    # imported at the first call: minipar.amp imports autograd, which imports this module
    from .amp import autocast_mode
    return autocast_mode


def autocast_op(op, dtype, *arrays, **options):
    """``op`` on its arrays cast to ``dtype`` where autocast casts them, each gradient cast back
    to its input's dtype: what a cast node in the graph does, inside one op (ops see arrays)."""
    casts = _autocast().casts
    sources = [a.dtype for a in arrays]
    out, grad_fns = op(*(a.astype(dtype) if casts(a, dtype) else a for a in arrays), **options)

    def back(grad_fn, source):
        return lambda g: grad_fn(g).astype(source, copy=False)

    return out, tuple(back(fn, source) for fn, source in zip(grad_fns, sources))


# --- arithmetic ---------------------------------------------------------------------------------
def add(a, b):
    return _broadcast("add", lambda x, y: x + y, a, b), (lambda g: g, lambda g: g)


def sub(a, b):
    return _broadcast("sub", lambda x, y: x - y, a, b), (lambda g: g, lambda g: -g)


def mul(a, b):
    return _broadcast("mul", lambda x, y: x * y, a, b), (lambda g: g * b, lambda g: g * a)


def div(a, b):
    return (_broadcast("div", lambda x, y: x / y, a, b),
            (lambda g: g / b, lambda g: -g * a / (b * b)))


def pow_(a, b):
    """a ** b; d/da = b·a^(b−1), d/db = a^b·ln a (defined for a > 0)."""
    def grad_b(g):
        return g * (a ** b) * backend.get_array_module(a).log(a)
    return _broadcast("pow", lambda x, y: x ** y, a, b), (lambda g: g * b * a ** (b - 1), grad_b)


def neg(a):
    return -a, (lambda g: -g,)


def matmul(a, b):
    """a @ b over the last two axes, batch axes broadcast; 1-D operands as in NumPy.

    dL/da = g @ bᵀ, dL/db = aᵀ @ g (summed over broadcast batch axes). A 1-D operand works as a
    matrix of one row (left) or one column (right), an axis the output and the gradient drop.
    16-bit operands give a 16-bit product, forward and backward (``low_precision``); under
    autocast, floating operands are cast to its dtype first.
    """
    amp = _autocast()
    fast = amp.active_dtype()
    if fast is not None and (amp.casts(a, fast) or amp.casts(b, fast)):
        return autocast_op(matmul, fast, a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: both operands need at least one axis, got shapes "
                         f"{a.shape} and {b.shape} (use * for scalars)")
    if a.ndim == 1 and b.ndim == 1:
        if a.shape != b.shape:
            raise ValueError(f"matmul: vectors of lengths {a.shape[0]} and {b.shape[0]} differ")
        dot = low_precision(lambda x, y: backend.get_array_module(x).asarray((x * y).sum()), a, b)
        return dot, (lambda g: g * b, lambda g: g * a)
    a_vec, b_vec = a.ndim == 1, b.ndim == 1  # the gradient functions keep flags, not a and b
    a2 = a.reshape(1, -1) if a_vec else a
    b2 = b.reshape(-1, 1) if b_vec else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"matmul: shapes {a2.shape} @ {b2.shape} do not fit: the inner "
                         f"dimensions {a2.shape[-1]} (last of the left) and {b2.shape[-2]} "
                         f"(second-last of the right) differ")
    try:
        out = low_precision(lambda x, y: x @ y, a2, b2)
    except ValueError as e:
        raise ValueError(f"matmul: batch shapes of {a2.shape} and {b2.shape} do not broadcast "
                         f"({e})") from None

    def as_2d(g):  # the output gradient with the axes dropped for 1-D operands put back
        g = g.reshape(g.shape + (1,)) if b_vec else g
        return g.reshape(g.shape[:-1] + (1, g.shape[-1])) if a_vec else g

    def grad_a(g):
        ### BEGIN SOLUTION op-backward
        ga = as_2d(g) @ b2.swapaxes(-1, -2)
        return ga.reshape(ga.shape[:-2] + ga.shape[-1:]) if a_vec else ga
        ### END SOLUTION

    def grad_b(g):
        ### BEGIN SOLUTION op-backward
        gb = a2.swapaxes(-1, -2) @ as_2d(g)
        return gb.reshape(gb.shape[:-1]) if b_vec else gb
        ### END SOLUTION

    if a_vec:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if b_vec:
        out = out.reshape(out.shape[:-1])
    # g upcast, the 16-bit operand it meets is promoted by NumPy: a float32 GEMM, rounded once
    return out, (lambda g: low_precision(grad_a, g), lambda g: low_precision(grad_b, g))


# --- elementwise functions ----------------------------------------------------------------------
def exp(a):
    out = backend.get_array_module(a).exp(a)
    return out, (lambda g: g * out,)


def log(a):
    return backend.get_array_module(a).log(a), (lambda g: g / a,)


def sqrt(a):
    out = backend.get_array_module(a).sqrt(a)
    return out, (lambda g: g * 0.5 / out,)


def tanh(a):
    out = backend.get_array_module(a).tanh(a)
    return out, (lambda g: g * (1 - out * out),)


def sigmoid(a):
    out = 0.5 * (backend.get_array_module(a).tanh(0.5 * a) + 1)  # = 1/(1+e^-x) without overflow
    return out, (lambda g: g * out * (1 - out),)


def relu(a):
    positive = a > 0
    return a * positive, (lambda g: g * positive,)


def abs_(a):
    xp = backend.get_array_module(a)
    sign = xp.sign(a)
    return xp.abs(a), (lambda g: g * sign,)


def where(a, b, condition):
    """Elementwise choice: a where condition holds, else b (both broadcast)."""
    xp = backend.get_array_module(condition, a, b)
    return (_broadcast("where", lambda x, y: xp.where(condition, x, y), a, b),
            (lambda g: xp.where(condition, g, 0), lambda g: xp.where(condition, 0, g)))


def masked_fill(a, mask, value):
    """Copy of ``a`` with ``value`` where ``mask`` is true; no gradient flows to filled places."""
    xp = backend.get_array_module(a)
    try:
        out = xp.where(mask, xp.asarray(value, dtype=a.dtype), a)
    except ValueError:
        raise ValueError(f"masked_fill: mask of shape {mask.shape} does not broadcast to "
                         f"{a.shape}") from None
    if out.shape != a.shape:
        raise ValueError(f"masked_fill: mask of shape {mask.shape} would change the shape "
                         f"{a.shape} to {out.shape}")
    return out, (lambda g: xp.where(mask, 0, g),)


def compare(a, b, fn):
    """``fn(a, b)`` for one of ``operator``'s comparisons: a bool array, which carries no
    gradient (``apply`` records none for a non-floating output), as torch's comparisons."""
    return _broadcast(fn.__name__, fn, a, b), (None, None)


# --- reductions ---------------------------------------------------------------------------------
def sum_(a, axis=None, keepdims=False):
    """Σ over ``axis``; the gradient is g copied back along the summed axes (no values kept).
    Under autocast a 16-bit input is summed in float32 (torch's CUDA float32 list)."""
    amp, float32 = _autocast(), backend.dtypes.float32
    if amp.active_dtype() is not None and amp.casts(a, float32):
        return autocast_op(sum_, float32, a, axis=axis, keepdims=keepdims)
    xp = backend.get_array_module(a)
    shape = a.shape
    out = xp.asarray(a.sum(axis=axis, keepdims=keepdims))  # 0-d array, not a NumPy scalar
    return out, (lambda g: xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims), shape),)


def mean(a, axis=None, keepdims=False):
    """Σ / n over ``axis``; the gradient is g / n copied back along the averaged axes."""
    n = 1
    for ax in _axes(axis, a.ndim):
        n *= a.shape[ax]
    xp = backend.get_array_module(a)
    shape = a.shape
    out = xp.asarray(a.mean(axis=axis, keepdims=keepdims))
    return out, (lambda g: xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims) / n, shape),)


def _extremum(reduce_fn, a, axis, keepdims):
    """max/min: the gradient goes to the extreme elements, split evenly among ties."""
    out = reduce_fn(axis=axis, keepdims=True)
    shape = a.shape

    def grad(g):
        hit = a == out
        count = hit.sum(axis=axis, keepdims=True)
        return hit * (_expand_reduced(g, shape, axis, keepdims) / count)

    result = out if keepdims else out.reshape(tuple(
        n for i, n in enumerate(shape) if i not in _axes(axis, a.ndim)))
    return result, (grad,)


def argmax(a, axis=None, keepdims=False):
    """The index of the largest element (of the flattened array when ``axis`` is None), the
    first among ties, as torch.argmax; integers, so no gradient."""
    xp = backend.get_array_module(a)
    return xp.asarray(a.argmax(axis=axis, keepdims=keepdims)), (None,)


def max_(a, axis=None, keepdims=False):
    return _extremum(a.max, a, axis, keepdims)


def min_(a, axis=None, keepdims=False):
    return _extremum(a.min, a, axis, keepdims)


# --- shapes -------------------------------------------------------------------------------------
def reshape(a, shape):
    try:
        out = a.reshape(shape)
    except ValueError:
        raise ValueError(f"reshape: cannot reshape {a.shape} ({a.size} elements) into "
                         f"{tuple(shape)}") from None
    shape_in = a.shape
    return out, (lambda g: g.reshape(shape_in),)


def permute(a, axes):
    if sorted(ax % a.ndim for ax in axes) != list(range(a.ndim)):
        raise ValueError(f"permute: {tuple(axes)} is not a permutation of the {a.ndim} axes "
                         f"of a tensor of shape {a.shape}")
    inverse = sorted(range(a.ndim), key=lambda i: axes[i] % a.ndim)  # on the host: axes are ints
    return a.transpose(axes), (lambda g: g.transpose(inverse),)


def transpose(a, dim0=-2, dim1=-1):
    """Swap two axes (the last two by default, a matrix transpose)."""
    return a.swapaxes(dim0, dim1), (lambda g: g.swapaxes(dim0, dim1),)


def is_basic_index(index):
    """Only slices, integers, None and ``...``: a view without repeated elements."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (slice, int, type(None), type(Ellipsis))) for p in parts)


def getitem(a, index):
    """Advanced indexing (integer or boolean arrays); repeated indices accumulate gradients."""
    xp = backend.get_array_module(a)
    shape, dtype = a.shape, a.dtype

    def grad(g):
        out = xp.zeros(shape, dtype)
        xp.add.at(out, index, g)
        return out

    return a[index], (grad,)


def slice_(a, index):
    """Basic slicing only (no repeated elements), so backward is a plain slice assignment."""
    xp = backend.get_array_module(a)
    shape, dtype = a.shape, a.dtype

    def grad(g):
        out = xp.zeros(shape, dtype)
        out[index] = g
        return out

    return a[index], (grad,)


def split_slices(shape, split_size_or_sections, axis=0):
    """torch.split's pieces as basic indices: pieces of ``split_size`` along ``axis`` (the last
    may be shorter), or of the listed sizes."""
    n = shape[axis]
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split: size must be positive, got {split_size_or_sections}")
        sizes = [min(split_size_or_sections, n - lo) for lo in range(0, n, split_size_or_sections)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} add up to {sum(sizes)}, not to the axis "
                             f"length {n}")
    slices, lo = [], 0
    for size in sizes:
        index = [slice(None)] * len(shape)
        index[axis] = slice(lo, lo + size)
        slices.append(tuple(index))
        lo += size
    return slices


def check_ids(ids, n, values=True):
    """TypeError unless ``ids`` are integers; with ``values``, IndexError unless every id lies in
    [0, n) (reading them is a host sync for device ids: see ``backend.check_values``)."""
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
    lo, hi = (int(ids.min()), int(ids.max())) if values and ids.size else (0, -1)
    if lo < 0 or hi >= n:
        raise IndexError(f"embedding: ids must lie in [0, {n}), got [{lo}, {hi}]")


def embedding(weight, ids):
    """Rows of ``weight`` picked by integer ``ids`` (any shape): out[..., :] = weight[ids[...]].

    Backward scatters-adds each output row's gradient into the row it came from. The caller
    checks the ids (``check_ids``) where it still knows whether they were on the host.
    """
    xp, shape, dtype = backend.get_array_module(weight), weight.shape, weight.dtype

    def grad(g):
        out = xp.zeros(shape, dtype)
        xp.add.at(out, ids.reshape(-1), g.reshape(-1, shape[1]))
        return out

    return weight[ids], (grad,)


def gather(a, dim, index):
    """torch.gather: out[i][j] = a[i][index[i][j]] for dim=1 (likewise for any dim)."""
    xp = backend.get_array_module(a)
    dim, shape, dtype = dim % a.ndim, a.shape, a.dtype

    def grad(g):
        out = xp.zeros(shape, dtype)
        where = [xp.arange(n).reshape([-1 if k == axis else 1 for k in range(index.ndim)])
                 for axis, n in enumerate(index.shape)]  # an open grid (CuPy has no sparse=)
        where[dim] = index
        xp.add.at(out, tuple(where), g)
        return out

    return xp.take_along_axis(a, index, axis=dim), (grad,)


def concat(*arrays, axis=0):
    """Join along ``axis``; each input's gradient is its own stretch of g."""
    xp = backend.get_array_module(*arrays)
    try:
        out = xp.concatenate(arrays, axis=axis)
    except ValueError as e:
        raise ValueError(f"concat: shapes {[a.shape for a in arrays]} do not fit along axis "
                         f"{axis} ({e})") from None
    bounds = [0, *itertools.accumulate(a.shape[axis] for a in arrays)]

    def piece(lo, hi):
        return lambda g: xp.take(g, xp.arange(lo, hi), axis=axis)

    return out, tuple(piece(lo, hi) for lo, hi in zip(bounds, bounds[1:]))


def stack(*arrays, axis=0):
    """Stack along a new ``axis``; input i's gradient is g's slice i along it."""
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"stack: all tensors need the same shape, got "
                         f"{[a.shape for a in arrays]}")
    xp = backend.get_array_module(*arrays)

    def piece(i):
        return lambda g: xp.take(g, i, axis=axis)

    return xp.stack(arrays, axis=axis), tuple(piece(i) for i in range(len(arrays)))


def clone(a):
    """A copy in its own memory (torch's clone); the gradient passes through unchanged."""
    return a.copy(), (lambda g: g,)


def astype(a, dtype):
    """A copy in another dtype (a name such as "bf16" too); the gradient is cast back to the
    input's dtype, so a float32 parameter used in float16 still gets a float32 gradient."""
    src = a.dtype
    # backend.cast rounds as torch's .to() does (float8_e4m3fn saturates, NumPy's gives NaN)
    return backend.cast(a, backend.check_dtype(dtype)), (lambda g: g.astype(src),)
