"""Tensors that remember how they were made.

A ``Tensor`` wraps one backend array (NumPy or CuPy, see ``backend``), and its class body lists
its whole API. Each operator hands its arrays to an op of ``ops.py`` through ``apply``:

    def __mul__(self, other): return apply(ops.mul, self, other)

An op returns its output array and one gradient function per input; ``apply`` wraps the output
and records a graph node whose ``backward(g)`` calls only the gradient functions of the inputs
that require grad (``x @ W`` with a constant ``x`` never computes dL/dx). Fused functions
(``functional.py``) record their node directly with ``make_result``:

    out = make_result(y, (x,), lambda g: (g * mask,), "dropout")
"""
import numbers
import operator

from . import backend, memory, ops
from .graph import (as_array, enable_grad, is_grad_enabled, no_grad, release,  # noqa: F401
                    run_backward, set_grad_enabled)


class Tensor:
    """An n-dimensional array with an optional gradient and a link to the op that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_op", "_retain",
                 "_hooks", "_post_hooks", "_split", "name", "__weakref__")
    __array_priority__ = 1000  # numpy_array * tensor -> Tensor.__rmul__, not an object array

    def __init__(self, data, requires_grad=False, dtype=None, name=None):
        if isinstance(data, Tensor):
            data = data.data
        self.data = as_array(data, dtype)
        self.grad = None
        self.requires_grad = False
        self._parents = ()
        self._backward = None
        self._op = None
        self._retain = False
        self._hooks = None
        self._post_hooks = None
        self._split = None
        self.name = name
        if requires_grad:
            self.requires_grad_(True)

    # --- what it is ------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    # NumPy's element count, which the library reads as a number, and torch's t.size() and
    # t.size(dim), which ported scripts call: one int that can be called
    size = property(lambda self: _Size(self.data.size, self.data.shape))
    numel = lambda self: int(self.data.size)  # noqa: E731
    dim = lambda self: self.data.ndim  # noqa: E731
    is_leaf = property(lambda self: self._backward is None and not self._parents)

    def __len__(self):
        return len(self.data)

    def __bool__(self):
        if self.data.size != 1:
            raise RuntimeError(f"Boolean value of Tensor with more than one value is ambiguous "
                               f"(shape {self.shape}): use .any() or .all() on .numpy()")
        return bool(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        op = f", op={self._op}" if self._op else ""
        values = str(backend.to_numpy(self.data)).replace("\n", "\n       ")
        return f"tensor({values}, dtype={self.dtype}{grad}{op})"

    # --- arithmetic, each also reflected (2 * x); Python numbers stay weak scalars --------------
    def __add__(self, other): return apply(ops.add, self, other)
    def __radd__(self, other): return apply(ops.add, other, self)
    def __sub__(self, other): return apply(ops.sub, self, other)
    def __rsub__(self, other): return apply(ops.sub, other, self)
    def __mul__(self, other): return apply(ops.mul, self, other)
    def __rmul__(self, other): return apply(ops.mul, other, self)
    def __truediv__(self, other): return apply(ops.div, self, other)
    def __rtruediv__(self, other): return apply(ops.div, other, self)
    def __pow__(self, other): return apply(ops.pow_, self, other)
    def __rpow__(self, other): return apply(ops.pow_, other, self)
    def __matmul__(self, other): return apply(ops.matmul, self, as_tensor(other))
    def __rmatmul__(self, other): return apply(ops.matmul, as_tensor(other), self)
    def __neg__(self): return apply(ops.neg, self)

    # --- comparisons: bool tensors without gradient, as torch's -----------------------------------
    def __lt__(self, other): return apply(ops.compare, self, other, fn=operator.lt)
    def __le__(self, other): return apply(ops.compare, self, other, fn=operator.le)
    def __gt__(self, other): return apply(ops.compare, self, other, fn=operator.gt)
    def __ge__(self, other): return apply(ops.compare, self, other, fn=operator.ge)

    # ``t == None`` is False (Python's identity fallback), not an array of object comparisons
    def __eq__(self, other):
        return NotImplemented if other is None else apply(ops.compare, self, other, fn=operator.eq)

    def __ne__(self, other):
        return NotImplemented if other is None else apply(ops.compare, self, other, fn=operator.ne)

    # defining __eq__ would unset the hash: tensors stay dict keys and set members by identity
    __hash__ = object.__hash__

    # --- elementwise functions ---------------------------------------------------------------
    def exp(self): return apply(ops.exp, self)
    def log(self): return apply(ops.log, self)
    def sqrt(self): return apply(ops.sqrt, self)
    def tanh(self): return apply(ops.tanh, self)
    def sigmoid(self): return apply(ops.sigmoid, self)
    def relu(self): return apply(ops.relu, self)
    def abs(self): return apply(ops.abs_, self)

    def masked_fill(self, mask, value):
        """A copy with ``value`` where ``mask`` is true; no gradient flows to filled places."""
        return apply(ops.masked_fill, self, mask=_array(mask), value=value)

    # --- reductions --------------------------------------------------------------------------
    def sum(self, axis=None, keepdims=False):
        return apply(ops.sum_, self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return apply(ops.mean, self, axis=axis, keepdims=keepdims)

    def max(self, axis=None, keepdims=False):
        return apply(ops.max_, self, axis=axis, keepdims=keepdims)

    def min(self, axis=None, keepdims=False):
        return apply(ops.min_, self, axis=axis, keepdims=keepdims)

    def argmax(self, dim=None, keepdim=False):
        return apply(ops.argmax, self, axis=dim, keepdims=keepdim)

    # --- shapes and indexing -----------------------------------------------------------------
    def reshape(self, *shape): return apply(ops.reshape, self, shape=_varargs(shape))
    view = reshape
    def permute(self, *axes): return apply(ops.permute, self, axes=_varargs(axes))
    def transpose(self, dim0=-2, dim1=-1): return apply(ops.transpose, self, dim0=dim0, dim1=dim1)
    T = property(lambda self: self.permute(tuple(reversed(range(self.ndim)))))

    def squeeze(self, dim=None):
        """Drop the axes of size 1 (of those in ``dim`` only, if given: others stay, as torch)."""
        dims = range(self.ndim) if dim is None else {d % max(self.ndim, 1) for d in
                                                     (dim if isinstance(dim, tuple) else (dim,))}
        return self.reshape(tuple(n for i, n in enumerate(self.shape) if not (i in dims and n == 1)))

    def unsqueeze(self, dim):
        """A new axis of size 1 at ``dim`` (in [-ndim - 1, ndim], as torch)."""
        if not -self.ndim - 1 <= dim <= self.ndim:
            raise IndexError(f"unsqueeze: dimension out of range (expected to be in range of "
                             f"[{-self.ndim - 1}, {self.ndim}], but got {dim})")
        dim %= self.ndim + 1
        return self.reshape(self.shape[:dim] + (1,) + self.shape[dim:])

    def flatten(self, start_dim=0, end_dim=-1):
        """Axes ``start_dim`` to ``end_dim`` (both included) merged into one."""
        if self.ndim == 0:
            return self.reshape(1)
        lo, hi = start_dim % self.ndim, end_dim % self.ndim
        return self.reshape(self.shape[:lo] + (-1,) + self.shape[hi + 1:])

    def __getitem__(self, index):
        """Basic slicing (a view's gradient is a slice assignment) or advanced indexing (repeated
        indices accumulate their gradients)."""
        index = _index(index)
        return apply(ops.slice_ if ops.is_basic_index(index) else ops.getitem, self, index=index)

    def __setitem__(self, index, value):
        """``t[index] = value`` in place, where torch allows it: on a tensor that does not require
        grad, or on a leaf under ``no_grad()`` (setting weights). A tensor in the graph is
        refused: its backward may hold the array the write would change."""
        if self.requires_grad and self.is_leaf and is_grad_enabled():
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation (torch's refusal): item assignment on a leaf that "
                               "requires grad works under minipar.no_grad()")
        if self.requires_grad and not self.is_leaf:
            raise RuntimeError("item assignment on a tensor in the graph: minipar records no "
                               "in-place writes (its backward may hold this array); build the "
                               "new values with minipar.where() or masked_fill()")
        self.data[_index(index)] = _array(value)

    def copy_(self, src):
        """torch's ``p.copy_(src)``: ``src``'s values written into this tensor, as ``t[...] =``."""
        self[...] = src
        return self

    def gather(self, dim, index):
        """torch.gather: out[i][j] = self[i][index[i][j]] for dim=1 (likewise for any dim)."""
        return apply(ops.gather, self, dim=dim, index=_array(index))

    def split(self, split_size_or_sections, axis=0):
        """torch.split: pieces of ``split_size`` along ``axis`` (the last may be shorter), or of
        the listed sizes. Each piece is its own op, so unused pieces cost nothing in backward."""
        return [apply(ops.slice_, self, index=index)
                for index in ops.split_slices(self.shape, split_size_or_sections, axis)]

    # --- dtype -------------------------------------------------------------------------------
    def astype(self, dtype): return apply(ops.astype, self, dtype=dtype)
    def float(self): return self.astype("float32")
    def double(self): return self.astype("float64")
    def half(self): return self.astype("float16")
    def bfloat16(self): return self.astype("bfloat16")
    def to(self, dtype): return self.astype(dtype)
    def long(self): return self.astype("int64")
    def int(self): return self.astype("int32")
    def bool(self): return self.astype("bool")

    # --- values on the host ------------------------------------------------------------------
    def numpy(self):
        """The values as a NumPy array on the host (an explicit device-to-host copy on a GPU)."""
        return backend.to_numpy(self.data)

    def item(self):
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return self.data.reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    # --- gradient bookkeeping ---------------------------------------------------------------
    def requires_grad_(self, mode=True):
        if mode and not (backend.is_floating(self.data.dtype) or self.data.dtype.kind == "c"):
            raise TypeError(f"only floating-point tensors can require gradients, got dtype "
                            f"{self.data.dtype}; convert first, e.g. tensor.astype('float32')")
        self.requires_grad = bool(mode)
        return self

    def detach(self):
        """The same values (shared memory) cut off from the graph."""
        return Tensor(self.data)

    def clone(self):
        """A copy in its own memory, still in the graph (its gradient flows back to self)."""
        return apply(ops.clone, self)

    def retain_grad(self):
        """Keep ``.grad`` on this non-leaf tensor too (for inspection and tests)."""
        self._retain = True
        return self

    def register_hook(self, fn):
        """``fn(grad) -> grad or None`` runs on this tensor's gradient before it is used."""
        self._hooks = (self._hooks or []) + [fn]
        return fn

    def register_post_accumulate_grad_hook(self, fn):
        """``fn(tensor)`` runs on a leaf once its ``.grad`` holds this backward's full gradient
        (how data-parallel training starts reducing a bucket while backward goes on)."""
        if not self.is_leaf:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        self._post_hooks = (self._post_hooks or []) + [fn]
        return fn

    def zero_grad(self):
        self.grad = None

    def backward(self, grad=None, retain_graph=False):
        """Gradients of this tensor with respect to every leaf that requires them.

        ``grad`` is dL/d(self); it may be omitted only for a one-element tensor (then 1).
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad: no input of "
                               "the computation has requires_grad=True (or it ran under no_grad())")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward() without a gradient needs a scalar output, got shape {self.shape}; "
                    f"reduce it first (e.g. .sum()) or pass backward(grad) of shape {self.shape}")
            grad = self._xp().ones_like(self.data)
        else:
            grad = as_array(grad.data if isinstance(grad, Tensor) else grad, self.data.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward(grad): grad has shape {grad.shape} but the tensor has "
                                 f"shape {self.shape}")
        # graph.py: a topological sort, then one loop backwards, the graph released as consumed
        run_backward([self], [grad], retain_graph=retain_graph)

    def _xp(self):
        return backend.get_array_module(self.data)


class _Size(int):
    """A tensor's element count (an int, as NumPy's ``size``) that, called as torch's
    ``size()``, gives the shape, or ``size(dim)`` one dimension of it."""

    def __new__(cls, count, shape):
        size = super().__new__(cls, count)
        size.shape = tuple(shape)
        return size

    def __call__(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def __reduce__(self):  # pickled (an object collective) as the plain count
        return int, (int(self),)


def _varargs(args):
    """``t.reshape(2, 3)`` and ``t.reshape((2, 3))`` alike."""
    return args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args


def _array(x):
    """A tensor or array used as an index, mask or condition: its array, on the current device
    (it is not differentiated). A NumPy index goes to the device once here, where the ops and
    their backward can use it with the device's functions (CuPy's ``add.at`` and ``where`` take
    no host arrays)."""
    if isinstance(x, Tensor):
        return x.data
    return backend.asarray(x) if isinstance(x, backend.numpy.ndarray) else x


def _index(index):
    """An index (a tuple of them, too) with its tensors and NumPy arrays made device arrays."""
    return tuple(_array(i) for i in index) if isinstance(index, tuple) else _array(index)


def apply(op, *inputs, **options):
    """``op`` (from ``ops.py``) on the inputs' arrays, its result recorded for backward.

    Python numbers stay numbers (NumPy's weak scalar typing); arrays and lists become constant
    tensors. ``op(*arrays, **options)`` returns the output array and one gradient function per
    input; backward keeps and calls only those of inputs that require grad, each result summed
    down to its input's shape (``ops.unbroadcast``), or only those ``only`` names (the split
    backward of zero-bubble pipelines, graph.py). An output that is not floating point
    carries no gradient (``x.astype("int64")``).
    """
    arrays, parents, slots, needed = [], [], [], False  # (one loop: this runs for every op)
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            if isinstance(x, numbers.Number):
                arrays.append(x)
                continue
            x = Tensor(x)
        arrays.append(x.data)
        parents.append(x)
        slots.append(i)
        needed = needed or x.requires_grad
    out, grad_fns = op(*arrays, **options)
    name = op.__name__.rstrip("_")
    differentiable = out.dtype.kind == "c" or backend.is_floating(out.dtype)
    if not (needed and is_grad_enabled() and differentiable):
        return _result(out, (), None, name)
    wanted = [(grad_fns[i], p.data.shape) if p.requires_grad else None
              for i, p in zip(slots, parents)]

    def backward(g, only=None):  # only: which parents' gradients to compute (None: all wanted)
        if only is None:
            return [None if w is None else ops.unbroadcast(w[0](g), w[1]) for w in wanted]
        return [None if w is None or not o else ops.unbroadcast(w[0](g), w[1])
                for w, o in zip(wanted, only)]

    return _result(out, parents, backward, name, split="only")


def make_result(data, parents, backward, op, split=None):
    """Wrap an op's output array; record the graph only if some parent needs a gradient.

    ``backward(g)`` returns one gradient (array or None) per parent, each of the parent's shape.
    ``split``: how zero bubble's B may call it (graph.WeightPass.split); "only" declares that it
    is ``backward(g, only)`` and computes just the parents' gradients ``only`` names.
    """
    if is_grad_enabled() and any(p.requires_grad for p in parents):
        return _result(data, parents, backward, op, split)
    return _result(data, (), None, op)


def _result(data, parents, backward, op, split=None):
    """A new tensor holding ``data``; a graph node when ``backward`` is given."""
    out = Tensor.__new__(Tensor)
    out.data = data
    out.grad = None
    out._retain = False
    out._hooks = None
    out._post_hooks = None
    out.name = None
    out._op = op
    out.requires_grad = backward is not None
    out._parents = tuple(parents)
    out._backward = backward
    out._split = split
    if backward is not None:
        memory.remember(out)
    return out


def tensor(data, requires_grad=False, dtype=None):
    """``minipar.tensor([[1., 2.]], requires_grad=True)``: a leaf tensor on the current device."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def as_tensor(x):
    """Tensors pass through; arrays and scalars become constant (no-grad) tensors."""
    return x if isinstance(x, Tensor) else Tensor(x)


# --- functions of several tensors (``minipar.concat`` ...) and torch-style free forms -------------
def concat(tensors, axis=0):
    return apply(ops.concat, *tensors, axis=axis)


def stack(tensors, axis=0, *, dim=None):
    return apply(ops.stack, *tensors, axis=axis if dim is None else dim)


def where(condition, a, b):
    """Elementwise choice: a where condition holds, else b (both broadcast)."""
    return apply(ops.where, a, b, condition=_array(condition))


def embedding(weight, ids):
    """Rows of ``weight`` picked by integer ``ids`` (any shape): out[..., :] = weight[ids[...]]."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    # before _array moves host ids to the device: their range is read there for free, device
    # ids' only under MINIPAR_DEBUG=1
    ops.check_ids(ids, weight.shape[0], values=backend.check_values(ids))
    return apply(ops.embedding, weight, ids=_array(ids))


def gather(a, dim, index):
    return a.gather(dim, index)


def masked_fill(a, mask, value):
    return a.masked_fill(mask, value)


def split(a, split_size_or_sections, axis=0):
    return a.split(split_size_or_sections, axis)
