"""Ring attention equals attention on the whole sequence, and the layout balances its work.

One launch of 4 ranks runs cp = 4 (the world), cp = 3 (ranks 0-2), cp = 2 ([0, 1] and [2, 3])
and cp = 1 (each rank alone): outputs and dq, dk, dv gathered back to the whole sequence equal
the serial attention (float64, 1e-10), causal and not; the counters give the bytes the ring
sends; RingLog the work each rank did; ActivationMemory what the forward keeps. Bad input is
one clear error on every rank, ranks that split the sequence by different cp included.
"""
import math

import numpy as np
import pytest

from minipar.testing import run_on_ranks
from nn_torch_twins import requires_torch, torch

TOL = 1e-10
B, H, T, D = 2, 2, 24, 4
T_WORK = 48  # long enough that the contiguous layout's last/first work nears 2·cp − 1


def _draw(T_, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, T_, D)) for _ in range(4)]  # q, k, v, output weight


def _full_attention(q, k, v, w):
    """Non-causal attention and its gradients for the loss Σ out ⊙ w, in NumPy."""
    s = q @ k.swapaxes(-1, -2) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = w @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(D)
    return p @ v, ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ w


def _causal_serial(q, k, v, w):
    from minipar import Tensor
    from minipar.attention import causal_self_attention

    leaves = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
    out = causal_self_attention(*leaves)
    (out * w).sum().backward()
    return [out.data] + [t.grad for t in leaves]


def _err(a, b):
    from minipar import to_numpy

    a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


def _ring_arrays(group, q, k, v, w, causal=True, **kw):
    """Ring attention from this rank's slices of the whole q, k, v (arrays in, arrays out):
    output, dq, dk, dv gathered back to the whole sequence."""
    from minipar import Tensor
    from minipar.parallel.context import gather_sequence, ring_attention, split_sequence

    mine = [Tensor(split_sequence(a, group, dim=2), requires_grad=True) for a in (q, k, v)]
    out = ring_attention(*mine, group, causal=causal, **kw)
    (out * split_sequence(w, group, dim=2)).sum().backward()
    return [gather_sequence(a, group, dim=2) for a in [out.data] + [t.grad for t in mine]]


def _equality(group):
    """[(what, max error)] against the serial attention on the whole sequence."""
    from minipar import Tensor
    from minipar.parallel.context import gather_sequence, ring_attention, split_sequence

    q, k, v, w = _draw(T)
    want = _causal_serial(q, k, v, w)
    found = [(f"causal {n}", _err(a, b)) for n, a, b in zip("o q k v".split(),
                                                            _ring_arrays(group, q, k, v, w), want)]
    # the Tensor path: split_sequence, ring, gather_sequence, all differentiable
    leaves = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
    mine = [split_sequence(t, group, dim=2) for t in leaves]
    out = gather_sequence(ring_attention(*mine, group), group, dim=2)
    (out * w).sum().backward()
    found += [(f"tensor path {n}", _err(a, b)) for n, a, b in
              zip("o q k v".split(), [out.data] + [t.grad for t in leaves], want)]
    got = _ring_arrays(group, q, k, v, w, overlap=False)
    found += [(f"no overlap {n}", _err(a, b)) for n, a, b in zip("o q k v".split(), got, want)]
    got = _ring_arrays(group, q, k, v, w, causal=False)
    found += [(f"non-causal {n}", _err(a, b)) for n, a, b in
              zip("o q k v".split(), got, _full_attention(q, k, v, w))]
    # padded at the end to a multiple of 2·cp: causal attention's real rows are unchanged
    n = 21
    padded = -(-n // (2 * group.size)) * 2 * group.size
    qs, ks, vs, ws = (a[:, :, :n] for a in (q, k, v, w))
    pad = [np.pad(a, ((0, 0), (0, 0), (0, padded - n), (0, 0))) for a in (qs, ks, vs, ws)]
    got = [a[:, :, :n] for a in _ring_arrays(group, *pad)]
    found += [(f"padded {n}->{padded} {name}", _err(a, b)) for name, a, b in
              zip("o q k v".split(), got, _causal_serial(qs, ks, vs, ws))]
    return found, [a.tolist() for a in _ring_arrays(group, q, k, v, w)]


def _work(group):
    """Per layout: RingLog's forward work and timeline on this rank, at T_WORK."""
    from minipar import Tensor
    from minipar.parallel.context import RingLog, ring_attention, split_sequence

    found = {}
    for layout in ("balanced", "contiguous"):
        mine = [Tensor(split_sequence(a, group, dim=2, layout=layout)) for a in _draw(T_WORK)[:3]]
        with RingLog() as log:
            ring_attention(*mine, group, layout=layout)
        found[layout] = {"work": log.work("forward"), "steps": log.steps("forward")}
    return found


def _bytes_and_memory(group):
    """Bytes this rank sent in one forward and one backward, and the activation bytes the
    forward keeps for backward (q, k, v are leaves: what the ring itself adds)."""
    from minipar import Tensor
    from minipar.memory import ActivationMemory
    from minipar.parallel.context import ring_attention, split_sequence

    q, k, v, w = (split_sequence(a, group, dim=2) for a in _draw(T_WORK))
    mine = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    group.counters.reset()
    with ActivationMemory() as memory:
        out = ring_attention(*mine, group)
    forward = group.counters.bytes_sent
    (out * w).sum().backward()
    return {"forward": forward, "backward": group.counters.bytes_sent - forward,
            "kv": q.nbytes + k.nbytes, "memory": memory.peak_bytes}


def _errors(group):
    """The clear error of each bad input, the same on every rank."""
    from minipar.parallel.context import ring_attention, split_sequence

    x = np.zeros((B, H, 25, D))
    cases = {"split": lambda: split_sequence(x, group, dim=2),
             "odd": lambda: ring_attention(x[:, :, :5], x[:, :, :5], x[:, :, :5], group),
             "shapes": lambda: ring_attention(x, x[:, :, :4], x, group),
             "layout": lambda: split_sequence(x[:, :, :24], group, dim=2, layout="zigzag"),
             # each rank split by a cp of its own: T/cp differs, so would the k/v blocks
             "lengths": lambda: ring_attention(*[x[:, :, :4 * (group.rank + 1)]] * 3, group)}
    seen = {}
    for case, make in cases.items():
        try:
            make()
            seen[case] = "no error"
        except ValueError as error:
            seen[case] = str(error)
    return seen


def ring_body():
    from minipar import comm

    world = comm.world()
    groups = {4: world, 2: world.split(world.rank // 2), 3: world.split(world.rank // 3),
              1: world.split(world.rank)}  # collective: every rank makes every split
    results = {}
    for cp, group in groups.items():
        if group.size != cp:  # rank 3's group of the cp = 3 split holds it alone
            continue
        found, gathered = _equality(group)
        results[cp] = {"rank": group.rank, "bad": [f for f in found if not f[1] <= TOL],
                       "checked": len(found), "gathered": gathered if group.rank == 0 else None,
                       "work": _work(group), "traffic": _bytes_and_memory(group)}
        if cp in (2, 3):
            results[cp]["errors"] = _errors(group)
    world.barrier()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(ring_body, 4, timeout=240)


def _by_group(ranks, cp):
    """The results of the first group of that size (world ranks 0..cp−1), in rank order."""
    mine = [r[str(cp)] for r in ranks[:cp]]
    assert [r["rank"] for r in mine] == list(range(cp))
    return mine


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_attention_equals_serial_causal_and_not(ranks, cp):
    for result in _by_group(ranks, cp):
        assert result["checked"] == 20
        assert not result["bad"], f"cp {cp} rank {result['rank']}: {result['bad']}"


@requires_torch
@pytest.mark.mpi
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_equals_torch_sdpa(ranks, cp):
    q, k, v, w = (torch.tensor(a, requires_grad=True) for a in _draw(T))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * w).sum().backward()
    got = _by_group(ranks, cp)[0]["gathered"]
    for name, mine, want in zip("o q k v".split(), got, [out, q.grad, k.grad, v.grad]):
        assert _err(np.array(mine), want.detach().numpy()) < TOL, (cp, name)


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_balanced_layout_balances_causal_work(ranks, cp):
    group = _by_group(ranks, cp)
    balanced = [r["work"]["balanced"]["work"] for r in group]
    for key in ("causal", "scores", "blocks"):
        counts = [w[key] for w in balanced]
        assert max(counts) <= 1.10 * min(counts), (key, counts)
    # each rank computes 2·cp + 1 of its 4·cp blocks and skips the 2·cp − 1 above the diagonal
    assert all(w["blocks"] == 2 * cp + 1 and w["skipped"] == 2 * cp - 1 for w in balanced)
    contiguous = [r["work"]["contiguous"]["work"]["causal"] for r in group]
    assert contiguous == sorted(contiguous)
    assert abs(contiguous[-1] / contiguous[0] - (2 * cp - 1)) <= 0.1 * (2 * cp - 1), contiguous


@pytest.mark.mpi
def test_the_timeline_shows_the_blocks_of_each_step(ranks):
    first = _by_group(ranks, 2)[0]["work"]["balanced"]["steps"]
    # rank 0 holds chunks 0 and 3; step 0 its own block, step 1 rank 1's chunks 1 and 2
    assert first == [[[0, 0, "diagonal"], [0, 3, "skipped"], [3, 0, "full"], [3, 3, "diagonal"]],
                     [[0, 1, "skipped"], [0, 2, "skipped"], [3, 1, "full"], [3, 2, "full"]]]


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_bytes_sent_are_the_k_and_v_blocks_cp_minus_one_times(ranks, cp):
    for result in _by_group(ranks, cp):
        t = result["traffic"]
        assert t["forward"] == (cp - 1) * t["kv"]
        # backward: k and v again (cp − 1 moves) and their gradients (cp moves, the last home)
        assert t["backward"] == (cp - 1 + (cp > 1) * cp) * t["kv"]


@pytest.mark.mpi
def test_activation_memory_per_rank_is_one_cp_th(ranks):
    """The forward keeps its output and one log-sum-exp per query: B·H·(T/cp)·(D + 1) floats,
    no (T/cp)² probabilities; so 1/cp of cp = 1."""
    one = _by_group(ranks, 1)[0]["traffic"]["memory"]
    assert one == B * H * T_WORK * (D + 1) * 8
    for cp in (2, 4):
        for result in _by_group(ranks, cp):
            assert abs(result["traffic"]["memory"] * cp / one - 1) <= 0.05, (cp, result)


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [2, 3])
def test_bad_input_is_a_clear_error(ranks, cp):
    group = _by_group(ranks, cp)
    expected = {"split": f"sequence length 25 is not a multiple of 2·cp = {2 * cp}",
                "odd": "this rank's sequence length 5 is odd",
                "shapes": "q, k, v must share one",
                "layout": "layout 'zigzag' is not one of",
                "lengths": f"ring_attention over a context group of cp = {cp} ranks: the ranks "
                           f"disagree on T/cp (" + ", ".join(f"rank {r}: {4 * (r + 1)}"
                                                            for r in range(cp)) + ")"}
    for result in group:
        assert result["errors"] == group[0]["errors"]
        for case, words in expected.items():
            assert words in result["errors"][case], (case, result["errors"][case])
