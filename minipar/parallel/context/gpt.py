"""The GPT's pieces that follow the cp layout: its position ids and its share of the loss.

Under context parallelism a rank holds two chunks of every sequence (layout.py), so its tokens
are not positions 0..T/cp−1, and its mean loss covers only its T/cp tokens of each sample:

    pos = local_positions(T_local, context)          # the positions of this rank's tokens
    loss = local_mean * loss_share(targets, context) # averaged over cp: the whole sequence's mean

The trainer with cp (parallel/hybrid.py) and why: docs/context_parallel.md.
"""
from ... import backend
from ...autograd import Tensor
from .layout import split_sequence


def local_positions(length, context):
    """The position ids of this rank's ``length`` tokens of a sequence split over ``context``
    (None: no split, 0..length−1), on the device."""
    if context is None or context.size == 1:
        return backend.xp().arange(length)
    return split_sequence(backend.xp().arange(length * context.size), context, dim=0)


def loss_share(targets, context, ignore_index=-100):
    """cp · n_local / n_total: the weight that makes this rank's mean loss over its n_local
    counted tokens, once averaged over the cp ranks (as the gradients are, over dp × cp), the
    mean over the n_total counted tokens of the whole sequences. 1 when no token is ignored."""
    t = targets.data if isinstance(targets, Tensor) else backend.asarray(targets)
    xp = backend.get_array_module(t)
    kept = xp.asarray([(t != ignore_index).sum()], dtype="float64")
    # one number a micro-batch over the context group: the ranks' counts differ only where
    # some of them hold more ignored targets (padding) than others
    total = context.all_reduce(kept)
    return context.size * kept[0] / xp.maximum(total[0], 1.0)
