"""Tensors that remember how they were made, and reverse-mode differentiation over that record.

A ``Tensor`` wraps one backend array (NumPy or CuPy, see ``backend``). An op (in ``ops.py`` and
``functional.py``) computes its result and, when any input needs gradients, hands ``make_result``
a ``backward(g)`` closure that maps the gradient of the output to the gradients of its inputs:

    out = make_result(a.data * b.data, (a, b), lambda g: (g * b.data, g * a.data), "mul")

``Tensor.backward()`` hands the graph to ``graph.run_backward``: a topological sort, then one loop
backwards, the graph released as it is consumed.
"""
from . import backend, memory
from .graph import (as_array, enable_grad, is_grad_enabled, no_grad, release,  # noqa: F401
                    run_backward, set_grad_enabled)


class Tensor:
    """An n-dimensional array with an optional gradient and a link to the op that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_op", "_retain",
                 "_hooks", "_post_hooks", "name", "__weakref__")
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
        self.name = name
        if requires_grad:
            self.requires_grad_(True)

    # --- what it is ------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._backward is None and not self._parents)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        op = f", op={self._op}" if self._op else ""
        values = str(backend.to_numpy(self.data)).replace("\n", "\n       ")
        return f"tensor({values}, dtype={self.dtype}{grad}{op})"

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
        if mode and self.data.dtype.kind not in "fc":
            raise TypeError(f"only floating-point tensors can require gradients, got dtype "
                            f"{self.data.dtype}; convert first, e.g. tensor.astype('float32')")
        self.requires_grad = bool(mode)
        return self

    def detach(self):
        """The same values (shared memory) cut off from the graph."""
        return Tensor(self.data)

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
        run_backward([self], [grad], retain_graph=retain_graph)

    def _xp(self):
        return backend.get_array_module(self.data)


def make_result(data, parents, backward, op):
    """Wrap an op's output array; record the graph only if some parent needs a gradient.

    ``backward(g)`` returns one gradient (array or None) per parent, each of the parent's shape.
    """
    out = Tensor.__new__(Tensor)
    out.data = data
    out.grad = None
    out._retain = False
    out._hooks = None
    out._post_hooks = None
    out.name = None
    out._op = op
    if is_grad_enabled() and any(p.requires_grad for p in parents):
        out.requires_grad = True
        out._parents = tuple(parents)
        out._backward = backward
        memory.remember(out)
    else:
        out.requires_grad = False
        out._parents = ()
        out._backward = None
    return out


def tensor(data, requires_grad=False, dtype=None):
    """``minipar.tensor([[1., 2.]], requires_grad=True)``: a leaf tensor on the current device."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def as_tensor(x):
    """Tensors pass through; arrays and scalars become constant (no-grad) tensors."""
    return x if isinstance(x, Tensor) else Tensor(x)
