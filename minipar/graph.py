"""The recorded graph, and reverse-mode differentiation over it (micrograd's loop, with care).

A node is a ``Tensor`` (see ``autograd.py``), but nothing here needs the class: a node has
``requires_grad``, ``grad``, ``shape``, its ``_parents``, a ``_backward(g)`` that maps dL/d(node)
to one gradient per parent (None for a leaf) and ``_split``, how B may call it (WeightPass.split).

``run_backward`` does what micrograd does: sort the graph topologically, walk it once backwards,
and add each node's contribution into its parents (the chain rule, summed over uses). It can also
run in two passes, the split backward of Zero Bubble (Qi et al. 2023; docs/engine.md):

    B   run_backward(roots, grads, defer=w)   w = WeightPass(weights): every gradient but the
                                              weights', the one the previous stage waits for
    W   w.run()                               the weights' gradients, from what B kept
"""
import contextlib
import weakref

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


def as_array(data, dtype=None):
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
    if dtype is None:
        return arr
    dtype = backend.check_dtype(dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def released_backward(g):
    raise RuntimeError(
        "trying to backward through the graph a second time: its saved arrays were freed after "
        "the first backward(); pass retain_graph=True to the first call if you need to do this")


def run_backward(roots, grads, retain_graph=False, defer=None):
    """Propagate ``grads`` (arrays, one per root) back through the graph below ``roots``.

    A leaf's gradient is final once every node that uses it has run, so each leaf is finished
    (``.grad`` set, post-accumulate hooks called) right then, while backward goes on, not at its
    place in the topological order (which may be the very end).

    ``defer`` (a ``WeightPass``): the B of a split backward (module docstring)."""
    order, uses = _topological_order(roots)
    pending = {}
    for root, g in zip(roots, grads):
        _accumulate(pending, root, g)
    for node in reversed(order):
        g = pending.pop(id(node), None)
        if g is None:
            continue
        if node._hooks:
            g = _apply_hooks(node, g)
        if node._backward is None:  # a leaf not finished below (a root, or some use got no grad)
            _finish_leaf(node, g)
            continue
        if node._retain:
            node.grad = g if node.grad is None else node.grad + g
        # zero bubble's B asks the node for its gradients but the weights' (WeightPass.split)
        parent_grads = node._backward(g) if defer is None else defer.split(node, g)
        for parent, pg in zip(node._parents, parent_grads):
            if pg is not None and parent.requires_grad:
                _accumulate(pending, parent, pg)
            if parent in uses:  # a leaf: finished once its last use has delivered
                uses[parent] -= 1
                if uses[parent] == 0 and id(parent) in pending:
                    _finish_leaf(parent, _apply_hooks(parent, pending.pop(id(parent))))
        # Like PyTorch, the graph is released as it is consumed: a second backward through it is
        # an error unless the first one passed retain_graph=True. Only leaves keep .grad.
        if not retain_graph and (defer is None or id(node) not in defer.kept):
            release(node)


class WeightPass:
    """The W of a split backward: ``weights``' gradients, owed by the B that deferred them.

    B calls ``split`` on each node; ``run`` then finishes what it left (docs/engine.md)."""

    def __init__(self, weights):
        self.weights = {id(w): w for w in weights if w.requires_grad}  # frozen ones: no W
        self.work = []   # (node, g, only): a node's weight gradient functions still to call
        self.kept = set()  # ids of the nodes in work: B does not release them
        self.held = {}   # id(weight) -> gradient computed in B by a node that cannot split

    def split(self, node, g):
        """B's share of ``node``'s backward: its parents' gradients with the weights' left out
        (None); theirs kept for W, as (node, g), or as gradients held if it cannot split.

        The op that built the node declared how its backward may be called (``_split``):
            None      _backward(g)          every parent's gradient at once
            "only"    _backward(g, only)    just those of the parents ``only`` names (booleans)
            "defer"   _backward(g, defer)   it runs a backward of its own, deferring to ``defer``
        """
        weight = tuple(id(p) in self.weights for p in node._parents)
        # A node that can compute a chosen few of its parents' gradients (split "only") leaves
        # the weights' for W; one that cannot (a fused function that computes all at once, as
        # layer_norm) runs whole here, its weight gradients held for W.
        if node._split == "only" and any(weight):
            self.work.append((node, g, weight))
            self.kept.add(id(node))
            return node._backward(g, tuple(p.requires_grad and not w
                                           for p, w in zip(node._parents, weight)))
        # a checkpointed segment (split "defer"): the backward it runs inside defers here too
        grads = node._backward(g, self) if node._split == "defer" else node._backward(g)
        if not any(weight):
            return grads
        for parent, pg, w in zip(node._parents, grads, weight):
            if w and pg is not None:
                _accumulate(self.held, parent, pg)
        return [None if w else pg for pg, w in zip(grads, weight)]

    def run(self):
        """The weight gradients: each kept node's weight functions on its g, summed per weight,
        then set as ``.grad`` (hooks called) once per weight, as one whole backward would."""
        pending, work = self.held, self.work
        self.held, self.work, self.kept = {}, [], set()
        ### BEGIN SOLUTION zero-bubble-w
        for node, g, only in work:
            for parent, pg, w in zip(node._parents, node._backward(g, only), only):
                if w and pg is not None:
                    _accumulate(pending, parent, pg)
            release(node)
        for i, g in pending.items():
            _finish_leaf(self.weights[i], _apply_hooks(self.weights[i], g))
        ### END SOLUTION


def _apply_hooks(node, g):
    for hook in node._hooks or ():
        new = hook(g)
        g = g if new is None else as_array(getattr(new, "data", new), g.dtype)
    return g


def _finish_leaf(node, g):
    """Keep a leaf's gradient (added in place where it can be, see ``_sum``), then tell its
    post-accumulate hooks."""
    node.grad = g if node.grad is None else _sum(node, node.grad, g)
    for hook in node._post_hooks or ():
        hook(node)


def release(node):
    """Free what a node saved for backward; a later backward through it raises a clear error."""
    if node._backward is not None and node._backward is not released_backward:
        memory.forget(node)
        node._backward = released_backward
        node._parents = ()


def _accumulate(pending, node, g):
    if g.shape != node.data.shape:
        raise RuntimeError(f"internal error: op {node._op!r} produced a gradient of shape "
                           f"{g.shape} for a tensor of shape {node.shape}")
    # torch's rule, a gradient in its tensor's dtype: a backward that mixed a Python number or
    # a float32 statistic into a 16-bit tensor's gradient widened it, so it is rounded back
    if g.dtype != node.data.dtype and backend.is_low_precision(node.data.dtype):
        g = g.astype(node.data.dtype)
    key = id(node)
    pending[key] = g if key not in pending else _sum(node, pending[key], g)


def _sum(node, total, g):
    """total + g: a new array the first time (``total`` may be a gradient another node holds too:
    ``add`` hands both its inputs the same array), in place into that array the next times."""
    if _sums.get(id(node)) is total:
        total += g
        return total
    total = total + g
    try:
        _sums[id(node)] = total
    except TypeError:  # a NumPy scalar (what 0-d arithmetic gives) takes no weak reference
        pass
    return total


_sums = weakref.WeakValueDictionary()  # id(node) -> the array of sums its accumulation made


def _topological_order(roots):
    """Nodes that need gradients, each after all of its parents (iterative DFS, no recursion),
    and for each leaf among them the number of edges (node, leaf) that will deliver it a
    gradient, counted as the search passes them."""
    order, seen, uses = [], set(), {}
    stack = [(r, False) for r in roots if r.requires_grad]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:  # nodes hash by identity (as ``uses``' keys do)
            continue
        seen.add(node)
        if node._backward is released_backward:
            released_backward(None)
        stack.append((node, True))
        # the first input (the activation) is explored first, so a later one (a weight, or the
        # cast autocast put on it) ends up just before its op in the order: backward reaches it
        # right after the op, not at the very end (ZeRO-3 frees a unit's weights then)
        for parent in reversed(node._parents):
            if not parent.requires_grad:
                continue
            if parent._backward is None:
                uses[parent] = uses.get(parent, 0) + 1
            if parent not in seen:
                stack.append((parent, False))
    return order, uses
