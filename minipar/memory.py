"""Bytes of activations held for backward, live and peak: the quantity checkpointing trades away.

What a graph node holds for backward is exactly what its ``backward`` closure captures: arrays,
tensors whose arrays it will read, and the gradient functions it will call, with what they
capture. While an ``ActivationMemory`` tracker is active, every node that records a graph is
inspected when it is made and counted until backward releases it (or it is garbage collected).
Each distinct buffer counts once (views share their base), and leaves are not counted:
parameters and input batches exist whether or not backward will run.

    with ActivationMemory() as mem:
        loss = model(x).sum()
        loss.backward()
    print(mem.peak_bytes)
"""
import weakref

_active = []  # the trackers currently counting (nested trackers all count)


class ActivationMemory:
    """Context manager: ``live_bytes`` now, ``peak_bytes`` since entering (or ``reset_peak``)."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0
        self._buffers = {}  # id(buffer) -> [nbytes, number of live nodes holding it]

    def __enter__(self):
        _active.append(self)
        return self

    def __exit__(self, *exc):
        _active.remove(self)
        return False

    def reset_peak(self):
        self.peak_bytes = self.live_bytes

    def _add(self, buffers):
        for key, nbytes in buffers:
            entry = self._buffers.get(key)
            if entry is None:
                self._buffers[key] = [nbytes, 1]
                self.live_bytes += nbytes
            else:
                entry[1] += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _remove(self, buffers):
        for key, _ in buffers:
            entry = self._buffers.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._buffers[key]
                self.live_bytes -= entry[0]


def _base(array):
    while getattr(array, "base", None) is not None and hasattr(array.base, "nbytes"):
        array = array.base
    return array


def saved_buffers(fn):
    """(id, nbytes) of each distinct non-leaf buffer captured by a backward closure.

    A function found there (``apply`` keeps one gradient function per input) holds what its own
    closure captures, so it is walked in the same way."""
    found, walked = {}, set()

    def visit(obj, depth=0):
        if hasattr(obj, "_backward") and hasattr(obj, "data"):  # a Tensor
            if obj._backward is not None or obj._parents:  # leaves are not activations
                visit(obj.data, depth)
        elif hasattr(obj, "nbytes") and hasattr(obj, "dtype"):  # an array
            base = _base(obj)
            found[id(base)] = int(base.nbytes)
        elif isinstance(obj, (tuple, list)) and depth < 2:
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict) and depth < 2:
            for item in obj.values():
                visit(item, depth + 1)
        elif getattr(obj, "__closure__", None) and id(obj) not in walked:  # a function
            walk(obj)

    def walk(function):
        walked.add(id(function))
        for cell in function.__closure__ or ():
            try:
                visit(cell.cell_contents)
            except ValueError:  # an empty cell
                pass

    walk(fn)
    return tuple(found.items())


def remember(node):
    """Called by the engine when ``node`` records a graph (no-op unless a tracker is active)."""
    # Inspecting a node costs a few microseconds per op, so it is off unless a tracker is active.
    if not _active:
        return
    # A closure may keep a leaf's raw array (``linear`` keeps ``weight.data``): not an activation.
    leaves = {id(_base(p.data)) for p in node._parents if p._backward is None and not p._parents}
    buffers = tuple(b for b in saved_buffers(node._backward) if b[0] not in leaves)
    if not buffers:
        return
    trackers = tuple(_active)
    for tracker in trackers:
        tracker._add(buffers)
    # Count the node out when backward releases it, or when it dies unreleased.
    _finalizers[id(node)] = weakref.finalize(node, _forget_buffers, id(node), trackers, buffers)


_finalizers = {}  # id(node) -> its finalizer, while the node holds counted buffers


def _forget_buffers(key, trackers, buffers):
    _finalizers.pop(key, None)
    for tracker in trackers:
        tracker._remove(buffers)


def forget(node):
    """Called by the engine when backward releases ``node``'s saved arrays."""
    finalizer = _finalizers.get(id(node))
    if finalizer is not None:
        finalizer()  # runs _forget_buffers once; the node's later collection does nothing
