"""The shm all-reduce's pipeline (comm/shm.py): vectors of many chunks through a window that
stays cache-sized, bit for bit the rank-order sum (16 bits: added in float32, rounded once),
in place and not, odd counts, device arrays staged; the bytes and the formula it is charged.
"""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

UFUNCS = {"sum": np.add, "max": np.maximum, "prod": np.multiply}


def rank_order(vectors, op, dtype):
    """The reduction of every rank's vector in rank order (16 bits: in float32, rounded once)."""
    wide = np.dtype(dtype).itemsize == 2 and np.dtype(dtype).kind == "f"
    total = vectors[0].astype("float32") if wide else vectors[0].copy()
    for v in vectors[1:]:
        total = UFUNCS[op](total, v.astype("float32") if wide else v)
    return total.astype(dtype)


def pipeline_body():
    """Every case on this rank: a list of failures, and the window's size after them."""
    from minipar import backend, comm
    from minipar.comm import shm

    world = comm.world()
    c = world.dup()
    xp, p, r = backend.xp(), world.size, world.rank
    chunk = shm.chunk_bytes(p)
    failures = []
    # one chunk and less, a chunk exactly, and several with an odd tail, for every width
    for dtype in ("float32", "float64", "float16", "int32", "uint8"):
        size = np.dtype(dtype).itemsize
        for n in (0, 5, chunk // size, 2 * chunk // size + 7, (5 * chunk + 3 * size) // size + 1):
            for op in UFUNCS:
                rng = np.random.default_rng(1000 * r + n)
                x = (rng.standard_normal(n) * 2).astype(dtype) if dtype[0] == "f" else \
                    rng.integers(0, 3, n).astype(dtype)
                want = rank_order(world.all_gather_object(x), op, dtype)
                got = backend.to_numpy(c.all_reduce(xp.asarray(x), op, algorithm="shm"))
                y = xp.asarray(x)
                c.all_reduce(y, op, algorithm="shm", out=y)
                case = f"rank {r} p={p} {dtype} {op} n={n}"
                if got.tobytes() != want.tobytes():
                    failures.append(case)
                if backend.to_numpy(y).tobytes() != want.tobytes():
                    failures.append(case + " in place")
    w = shm._windows[c.coll]
    return failures, w.cap, 2 * chunk, w.steps


@pytest.mark.mpi
@pytest.mark.parametrize("device, nprocs", [("cpu", 2), ("cpu", 3), ("strict", 2)])
def test_vectors_of_many_chunks_equal_the_rank_order_sum(device, nprocs):
    for failures, cap, stage, steps in run_on_ranks(pipeline_body, nprocs, timeout=300,
                                                    env={"MINIPAR_DEVICE": device}):
        assert not failures, failures
        assert cap == stage  # the window never grows: every vector goes through two chunks
        assert steps > 0


def disagree_body():
    """A pipelined call, then one where the last rank's count differs, then one that agrees:
    the error on every rank, and the sum after it."""
    from minipar import comm
    from minipar.comm import CommError, shm

    world = comm.world()
    n = 3 * shm.chunk_bytes(world.size) // 4 + 1
    x = np.ones(n, np.float32)
    first = float(world.all_reduce(x, algorithm="shm")[-1])
    try:
        world.all_reduce(x[:-1] if world.rank == world.size - 1 else x, algorithm="shm")
        error = None
    except CommError as err:
        error = str(err)
    return first, error, float(world.all_reduce(x, algorithm="shm")[0])


@pytest.mark.mpi
def test_ranks_that_disagree_after_a_pipelined_call_get_an_error_on_every_rank():
    results = run_on_ranks(disagree_body, 3, timeout=120)
    assert [first for first, _, _ in results] == [3.0] * 3
    # the same words on every rank: none went on to its next call before all had read the call
    assert all(error and "counts" in error for _, error, _ in results), results
    assert len({error for _, error, _ in results}) == 1, results
    assert [after for _, _, after in results] == [3.0] * 3


def test_only_x_read_and_the_result_written_go_through_memory():
    from minipar.comm import shm

    assert shm.memory_traffic(2) == (4.5, 2.0)  # copy in 1, reduce 1.5, copy out 2
    assert shm.memory_traffic(4) == pytest.approx((4.75, 2.0))  # 3 + 2(p-1)/p + 1/p
    assert shm.memory_traffic(2, in_place=True) == (2.5, 2.5)
    assert 2 * 3 * shm.chunk_bytes(2) <= shm.STAGE  # two halves of 2 slots and R


def test_the_pipeline_is_charged_a_rendezvous_a_chunk_and_the_stage_at_its_rate():
    from minipar.comm import ALGORITHMS, cost
    from minipar.comm.shm import chunk_bytes, copy_cost

    shm = ALGORITHMS["all_reduce"]["shm"].cost
    a, chunk = 2e-6, chunk_bytes(2)
    flat = cost.Model(a, {1: 3e-10}, {1: 1e-10})
    n = 8 * chunk
    g = flat.gamma
    # one gamma for every size: the three steps' bytes, and a rendezvous a chunk besides
    assert shm(2, n, a, flat.beta, g) == pytest.approx(
        9 * a + 0.5 * copy_cost(n, g) + n / 2 * g(n) + copy_cost(n, g))
    # a cache ten times faster than memory: only the copy of n is charged memory's rate
    cached = cost.Model(a, {1: 3e-10}, {chunk: 1e-11, 4 * chunk: 1e-10})
    g = cached.gamma
    assert g(chunk / 2) == g(chunk) == 1e-11 and g(n) == 1e-10
    assert shm(2, n, a, cached.beta, g) == pytest.approx(
        9 * a + 0.5 * 2 / 3 * n * 1e-11 + n / 2 * 1e-11 + 2 / 3 * n * 1e-10)
