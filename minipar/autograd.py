"""Tensors that remember how they were made, and reverse-mode differentiation over that record.

A ``Tensor`` wraps one backend array (NumPy or CuPy, see ``backend``). An op (in ``ops.py`` and
``functional.py``) computes its result and, when any input needs gradients, hands ``make_result``
a ``backward(g)`` closure that maps the gradient of the output to the gradients of its inputs:

    out = make_result(a.data * b.data, (a, b), lambda g: (g * b.data, g * a.data), "mul")

``Tensor.backward()`` then does what micrograd does: sort the graph topologically, walk it once
backwards, and add each node's contribution into its parents (the chain rule, summed over uses).
Only leaves (tensors made by the user, e.g. parameters) keep ``.grad``; like PyTorch, the graph is
released as it is consumed, so a second ``backward()`` through it is an error unless the first
one passed ``retain_graph=True``.
"""
import contextlib

from . import backend, memory

_grad_enabled = [True]


def is_grad_enabled():
    return _grad_enabled[0]


@contextlib.contextmanager
def set_grad_enabled(mode):
    """Inside the block, ops record a graph only when ``mode`` is true."""
    previous = _grad_enabled[0]
    _grad_enabled[0] = bool(mode)
    try:
        yield
    finally:
        _grad_enabled[0] = previous


def no_grad():
    """Context: build no graph (inference, optimizer updates, checkpointed forwards)."""
    return set_grad_enabled(False)


def enable_grad():
    return set_grad_enabled(True)


def _released_backward(g):
    raise RuntimeError(
        "trying to backward through the graph a second time: its saved arrays were freed after "
        "the first backward(); pass retain_graph=True to the first call if you need to do this")


class Tensor:
    """An n-dimensional array with an optional gradient and a link to the op that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_op", "_retain",
                 "_hooks", "_post_hooks", "name", "__weakref__")
    __array_priority__ = 1000  # numpy_array * tensor -> Tensor.__rmul__, not an object array

    def __init__(self, data, requires_grad=False, dtype=None, name=None):
        if isinstance(data, Tensor):
            data = data.data
        self.data = _as_array(data, dtype)
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
            grad = _as_array(grad.data if isinstance(grad, Tensor) else grad, self.data.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward(grad): grad has shape {grad.shape} but the tensor has "
                                 f"shape {self.shape}")
        run_backward([self], [grad], retain_graph=retain_graph)

    def _xp(self):
        return backend.get_array_module(self.data)


def run_backward(roots, grads, retain_graph=False):
    """Propagate ``grads`` (arrays, one per root) back through the graph below ``roots``.

    A leaf's gradient is final once every node that uses it has run, so each leaf is finished
    (``.grad`` set, post-accumulate hooks called) right then, while backward goes on, not at its
    place in the topological order (which may be the very end)."""
    order = _topological_order(roots)
    uses = {}  # leaf id -> how many (node, parent) edges still have to deliver a gradient
    for node in order:
        for parent in node._parents:
            if parent.requires_grad and parent._backward is None:
                uses[id(parent)] = uses.get(id(parent), 0) + 1
    pending = {}
    for root, g in zip(roots, grads):
        _accumulate(pending, root, g)
    for node in reversed(order):
        g = pending.pop(id(node), None)
        if g is None:
            continue
        g = _apply_hooks(node, g)
        if node._backward is None:  # a leaf not finished below (a root, or some use got no grad)
            _finish_leaf(node, g)
            continue
        if node._retain:
            node.grad = g if node.grad is None else node.grad + g
        parent_grads = node._backward(g)
        for parent, pg in zip(node._parents, parent_grads):
            if pg is not None and parent.requires_grad:
                _accumulate(pending, parent, pg)
            if parent.requires_grad and parent._backward is None:
                uses[id(parent)] -= 1
                if uses[id(parent)] == 0 and id(parent) in pending:
                    _finish_leaf(parent, _apply_hooks(parent, pending.pop(id(parent))))
        if not retain_graph:
            release(node)


def _apply_hooks(node, g):
    for hook in node._hooks or ():
        new = hook(g)
        g = g if new is None else _as_array(getattr(new, "data", new), g.dtype)
    return g


def _finish_leaf(node, g):
    """Keep a leaf's gradient, then tell its post-accumulate hooks."""
    node.grad = g if node.grad is None else node.grad + g
    for hook in node._post_hooks or ():
        hook(node)


def release(node):
    """Free what a node saved for backward; a later backward through it raises a clear error."""
    if node._backward is not None and node._backward is not _released_backward:
        memory.forget(node)
        node._backward = _released_backward
        node._parents = ()


def _accumulate(pending, node, g):
    if g.shape != node.shape:
        raise RuntimeError(f"internal error: op {node._op!r} produced a gradient of shape "
                           f"{g.shape} for a tensor of shape {node.shape}")
    key = id(node)
    pending[key] = g if key not in pending else pending[key] + g


def _topological_order(roots):
    """Nodes that need gradients, each after all of its parents (iterative DFS, no recursion)."""
    order, seen = [], set()
    stack = [(r, False) for r in roots if r.requires_grad]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node._backward is _released_backward:
            _released_backward(None)
        stack.append((node, True))
        for parent in node._parents:
            if parent.requires_grad and id(parent) not in seen:
                stack.append((parent, False))
    return order


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
    if _grad_enabled[0] and any(p.requires_grad for p in parents):
        out.requires_grad = True
        out._parents = tuple(parents)
        out._backward = backward
        memory.remember(out)
    else:
        out.requires_grad = False
        out._parents = ()
        out._backward = None
    return out


def _as_array(data, dtype=None):
    """A backend array on the current device from arrays, scalars or nested lists.

    Python floats become float32 (as in PyTorch); arrays keep their dtype unless one is given.
    A CuPy array stays where it is; anything else goes to the current device.
    """
    if backend.is_gpu_array(data):
        arr = data
    else:
        arr = backend.xp().asarray(data)
        if arr.dtype.kind == "f" and arr.dtype.itemsize == 8 and not hasattr(data, "dtype"):
            arr = arr.astype("float32")
    return arr if dtype is None or arr.dtype == dtype else arr.astype(dtype)


def tensor(data, requires_grad=False, dtype=None):
    """``minipar.tensor([[1., 2.]], requires_grad=True)``: a leaf tensor on the current device."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def as_tensor(x):
    """Tensors pass through; arrays and scalars become constant (no-grad) tensors."""
    return x if isinstance(x, Tensor) else Tensor(x)
