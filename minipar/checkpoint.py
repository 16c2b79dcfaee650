"""Gradient checkpointing (re-materialisation): keep a segment's inputs, recompute its insides.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") keep only the input of each of
k segments and re-run a segment's forward when backward reaches it: O(√n) memory for an n-layer
network at k = √n, for one extra forward pass (the arithmetic: docs/engine.md).

    y = checkpoint(block, x)                  # block's activations freed, recomputed in backward
    y = checkpoint_sequential(layers, 4, x)   # four segments, every one but the last checkpointed

Like ``torch.utils.checkpoint``, ``fn`` must receive every activation it reads as an argument.
"""
import contextlib

from . import memory, random
from .autograd import Tensor, make_result, release, run_backward

_recomputing = [0]


def is_recomputing():
    """True while a checkpointed segment is being re-run inside backward."""
    return _recomputing[0] > 0


@contextlib.contextmanager
def recomputing(rng_state=None):
    """Inside, a forward is a replay: ``is_recomputing()`` is true (BatchNorm leaves its running
    statistics alone) and, given the ``rng_state`` the first run started from, the random stream
    is rewound to it (dropout draws the same masks) and put back afterwards. Used by
    ``checkpoint`` and by the pipeline runtime's re-materialisation (R)."""
    now = random.get_rng_state()
    if rng_state is not None:
        random.set_rng_state(rng_state)
    _recomputing[0] += 1
    try:
        yield
    finally:
        _recomputing[0] -= 1
        random.set_rng_state(now)


def checkpoint(fn, *args):
    """``fn(*args)`` (one Tensor out) without keeping its intermediate activations for backward."""
    inputs = [a for a in args if isinstance(a, Tensor)]
    rng_state = random.get_rng_state()
    leaves = _detached(args)
    out = fn(*leaves)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: fn must return one Tensor, got {type(out).__name__}")
    if not out.requires_grad:
        return Tensor(out.data)
    _release_graph(out)  # frees every array the segment saved; only its inputs stay alive

    # Backward re-runs fn on the saved inputs and back-propagates through the fresh graph: the
    # parameters receive their gradients there, the inputs' gradients flow on. Inside the B of a
    # split backward (``defer``, graph.WeightPass) the parameters' are left for its W.
    def backward(g, defer=None):
        with recomputing(rng_state):
            fresh = _detached(args)
            replay = fn(*fresh)
            run_backward([replay], [g], defer=defer)
        return [f.grad for f in fresh if isinstance(f, Tensor)]

    result = make_result(out.data, inputs, backward, "checkpoint", split="defer")
    if not result.requires_grad:  # the inputs need no gradient, but fn's parameters do
        result.requires_grad = True
        result._backward, result._split = backward, "defer"
        memory.remember(result)
    return result


def checkpoint_sequential(modules, segments, x):
    """Run ``modules`` (a Sequential or a list) in ``segments`` contiguous pieces, checkpointing
    every piece but the last (its activations are needed at once, as in PyTorch)."""
    modules = list(modules)
    if not isinstance(segments, int) or not 1 <= segments <= len(modules):
        raise ValueError(f"checkpoint_sequential: segments must be an integer between 1 and the "
                         f"number of modules ({len(modules)}), got {segments}")
    ### BEGIN SOLUTION checkpoint-sequential
    bounds = [round(i * len(modules) / segments) for i in range(segments + 1)]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        run = _run_segment(modules[lo:hi])
        x = run(x) if i == segments - 1 else checkpoint(run, x)
    return x
    ### END SOLUTION


def _run_segment(modules):
    def run(x):
        for module in modules:
            x = module(x)
        return x
    return run


def _detached(args):
    """Fresh leaves sharing the inputs' arrays, so the segment's graph stops at them."""
    return [Tensor(a.data, requires_grad=a.requires_grad) if isinstance(a, Tensor) else a
            for a in args]


def _release_graph(out):
    """Release every graph node between ``out`` and the leaves it was computed from."""
    stack = [out]
    while stack:
        node = stack.pop()
        if node._backward is None:
            continue
        stack.extend(node._parents)
        release(node)
