"""Which tokens of the sequence a context-parallel rank holds, and the way back to the whole.

The sequence is cut into 2·cp chunks; rank r holds two of them, side by side:

    balanced     chunks r and 2·cp−1−r (Megatron-core's zig-zag): causal work equal on every rank
    contiguous   chunks 2r and 2r+1: the last rank's queries see the whole past, the first's little

    mine = split_sequence(x, group, dim=1)        # (B, T, C) -> (B, 2·T/(2·cp), C)
    x = gather_sequence(mine, group, dim=1)       # every rank gets the whole sequence back
    pos = split_sequence(np.arange(T), group, dim=0)   # this rank's position ids
"""
from ... import backend
from ...autograd import Tensor, make_result

LAYOUTS = ("balanced", "contiguous")


def rank_chunks(rank, cp, layout="balanced"):
    """The two chunk numbers (of 2·cp, in sequence order) rank ``rank`` holds, in that order."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if layout == "balanced":
        # chunk r from the cheap front of the triangle, chunk 2·cp−1−r from its dear end
        return (rank, 2 * cp - 1 - rank)
    return (2 * rank, 2 * rank + 1)


def chunk_length(T, cp):
    """T / (2·cp), or a ValueError naming the length: every rank holds two equal chunks."""
    if T % (2 * cp):
        # Causal attention pads for free: tokens added at the end come after every real one,
        # so the mask hides them from every real query; drop their rows after (docs).
        raise ValueError(f"sequence length {T} is not a multiple of 2·cp = {2 * cp}: the "
                         f"sequence is cut into 2·cp equal chunks, two per rank (pad it at the "
                         f"end to {-(-T // (2 * cp)) * 2 * cp} tokens, or choose another cp)")
    return T // (2 * cp)


def _take(a, dim, start, stop):
    index = [slice(None)] * a.ndim
    index[dim] = slice(start, stop)
    return a[tuple(index)]


def _split(a, rank, cp, dim, layout):
    xp = backend.get_array_module(a)
    c = chunk_length(a.shape[dim], cp)
    parts = [_take(a, dim, i * c, (i + 1) * c) for i in rank_chunks(rank, cp, layout)]
    return xp.ascontiguousarray(xp.concatenate(parts, axis=dim))


def _gather(a, group, dim, layout):
    xp = backend.get_array_module(a)
    cp, n = group.size, a.shape[dim]
    parts = group.all_gather(xp.ascontiguousarray(a))  # (cp, *a.shape): rank s's two chunks
    pieces = {}
    for s in range(cp):
        first, second = rank_chunks(s, cp, layout)
        pieces[first] = _take(parts[s], dim, 0, n // 2)
        pieces[second] = _take(parts[s], dim, n // 2, n)
    return xp.concatenate([pieces[i] for i in range(2 * cp)], axis=dim)


def split_sequence(x, group, dim=1, layout="balanced"):
    """This rank's two chunks of the whole sequence ``x`` (the same on every rank) along
    ``dim``. An array gives an array; a Tensor gives a Tensor whose backward gathers the
    gradient of the whole sequence back (every rank's slice in its place)."""
    dim = dim % x.ndim
    if not isinstance(x, Tensor):
        return _split(x, group.rank, group.size, dim, layout)
    out = _split(x.data, group.rank, group.size, dim, layout)
    return make_result(out, (x,), lambda g: (_gather(g, group, dim, layout),), "split_sequence")


def gather_sequence(x, group, dim=1, layout="balanced"):
    """The whole sequence on every rank from each rank's two chunks along ``dim`` (an
    all-gather, then each chunk to its place). A Tensor's backward keeps this rank's chunks."""
    dim = dim % x.ndim
    if not isinstance(x, Tensor):
        return _gather(x, group, dim, layout)
    out = _gather(x.data, group, dim, layout)
    backward = lambda g: (_split(g, group.rank, group.size, dim, layout),)  # noqa: E731
    return make_result(out, (x,), backward, "gather_sequence")
