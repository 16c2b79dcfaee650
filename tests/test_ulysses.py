"""Ulysses attention equals attention on the whole sequence, and sends the bytes of its formula.

One launch of 4 ranks runs P = 4 (the world) and P = 2 ([0, 1] and [2, 3]): outputs and dq, dk,
dv gathered back to the whole sequence equal the serial attention (float64, 1e-10), causal and
not, in both layouts of split_sequence, and equal ring_attention's; the counters give the bytes
each rank sends, forward and backward each 4 · (P − 1)/P · B · (N/P) · H · d · 8 (the
all-to-alls of q, k, v and of the output); a head count P does not divide is refused on every
rank with the group sizes that fit.
"""
import numpy as np
import pytest

from minipar.testing import run_on_ranks
# the serial attention, its NumPy twin (non-causal, with the head size D) and the error measure
from test_context_parallel import D, _causal_serial, _err, _full_attention

TOL = 1e-10
B, H, T = 2, 4, 16


def _draw(H_=H, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H_, T, D)) for _ in range(4)]  # q, k, v, output weight


def _parallel(attention, group, q, k, v, w, causal, layout):
    """``attention`` on this rank's shards of the whole q, k, v: output, dq, dk, dv gathered
    back to the whole sequence."""
    from minipar import Tensor
    from minipar.parallel.context import gather_sequence, split_sequence

    mine = [Tensor(split_sequence(a, group, dim=2, layout=layout), requires_grad=True)
            for a in (q, k, v)]
    out = attention(*mine, group, causal=causal, layout=layout)
    assert out.shape == mine[0].shape
    (out * split_sequence(w, group, dim=2, layout=layout)).sum().backward()
    return [gather_sequence(a, group, dim=2, layout=layout)
            for a in [out.data] + [t.grad for t in mine]]


def _equality(group):
    """[(what, max error)] against serial attention and against ring_attention."""
    from minipar.parallel.context import ring_attention, ulysses_attention

    q, k, v, w = _draw()
    serial = {True: _causal_serial(q, k, v, w), False: _full_attention(q, k, v, w)}
    found = []
    for causal in (True, False):
        for layout in ("balanced", "contiguous"):
            got = _parallel(ulysses_attention, group, q, k, v, w, causal, layout)
            ring = _parallel(ring_attention, group, q, k, v, w, causal, layout)
            case = f"{'causal' if causal else 'non-causal'} {layout}"
            found += [(f"{case} {n}", _err(a, b)) for n, a, b in zip("oqkv", got, serial[causal])]
            found += [(f"{case} {n} vs ring", _err(a, b)) for n, a, b in zip("oqkv", got, ring)]
    return found


def _bytes(group):
    """Bytes this rank sent in one forward and in its backward (the counters' snapshots)."""
    from minipar import Tensor
    from minipar.parallel.context import split_sequence, ulysses_attention

    q, k, v, w = (split_sequence(a, group, dim=2) for a in _draw())
    mine = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    group.counters.reset()
    out = ulysses_attention(*mine, group)
    forward = group.counters.snapshot()["bytes_sent"]
    (out * w).sum().backward()
    return {"forward": forward, "backward": group.counters.snapshot()["bytes_sent"] - forward,
            "elements": q.size, "itemsize": q.itemsize}


def _refusal(group):
    """The error of a head count the group size does not divide (H = 6 on P = 4, 3 on P = 2)."""
    from minipar.parallel.context import split_sequence, ulysses_attention

    heads = {4: 6, 2: 3}[group.size]
    q = split_sequence(_draw(heads)[0], group, dim=2)
    try:
        ulysses_attention(q, q, q, group)
    except ValueError as error:
        return str(error)
    return "no error"


def ulysses_body():
    from minipar import comm

    world = comm.world()
    groups = {4: world, 2: world.split(world.rank // 2)}  # collective: every rank makes both
    # each size in turn, on every rank: both P = 2 groups at once, then the world
    found = {P: _equality(group) for P, group in groups.items()}
    results = {P: {"checked": len(found[P]), "bad": [f for f in found[P] if not f[1] <= TOL],
                   "bytes": _bytes(group), "refusal": _refusal(group)}
               for P, group in groups.items()}
    world.barrier()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(ulysses_body, 4, timeout=240)


def _all(ranks, P):
    """(world rank, result) of every rank for groups of size P."""
    return [(r, result[str(P)]) for r, result in enumerate(ranks)]


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 4])
def test_ulysses_equals_serial_and_ring_causal_and_not_both_layouts(ranks, P):
    for r, result in _all(ranks, P):
        assert result["checked"] == 2 * 2 * 8
        assert not result["bad"], f"P {P} world rank {r}: {result['bad']}"


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 4])
def test_bytes_sent_are_four_all_to_alls_each_way(ranks, P):
    for r, result in _all(ranks, P):
        t = result["bytes"]
        # B·(N/P)·H·d elements a rank holds of each of q, k, v and the output; an all-to-all
        # keeps 1/P of them at home and sends (P − 1)/P
        assert t["elements"] == B * (T // P) * H * D
        per_all_to_all = (P - 1) * t["elements"] // P * t["itemsize"]
        assert t["forward"] == 4 * per_all_to_all, (r, t)
        assert t["backward"] == 4 * per_all_to_all, (r, t)


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 4])
def test_head_count_not_divisible_is_refused_on_every_rank(ranks, P):
    heads, nearest, usable = {4: (6, "3 or 6", [1, 2, 3, 6]), 2: (3, "1 or 3", [1, 3])}[P]
    for r, result in _all(ranks, P):
        error = result["refusal"]
        assert f"H = {heads} heads do not split over P = {P} ranks" in error, (r, error)
        assert f"the nearest {nearest}" in error and f"divisors of {heads}: {usable}" in error
