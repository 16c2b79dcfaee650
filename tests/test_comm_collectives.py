"""Every hand-coded collective equals MPI's own, for p = 1..5 and 8, every op and dtype, counts
0, 1, p-1, p+1, a prime and a large one, in place and out of place.

One mpiexec launch per rank count runs the whole table and returns the failing cases."""
import zlib

import numpy as np
import pytest

from minipar.testing import run_on_ranks

DTYPES = ("float16", "float32", "float64", "int32", "int64")
TOL = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def counts(p):
    return sorted({0, 1, max(p - 1, 0), p + 1, 13, 30011})


def data(xp, rng, n, dtype, op, rank, shape=None):
    """Values whose reduction neither overflows nor loses every digit (prod stays near 1)."""
    if dtype.startswith("int"):
        low, high = (1, 3) if op == "prod" else (-50, 50)
        values = rng.integers(low, high, n) + rank % 2
    else:
        values = rng.uniform(0.5, 1.5, n) if op == "prod" else rng.standard_normal(n) + rank
    return xp.asarray(values.astype(dtype).reshape(shape or (n,)))


def same(a, b, dtype):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    if dtype.startswith("int"):
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype] * max(1.0, np.abs(b).max(initial=0)))


def collectives_body(seed=0):
    """Run the table on this rank; return a list of failures (strings)."""
    from minipar import backend, comm
    from minipar.comm import ALGORITHMS, OPS, node

    world = comm.world()
    xp, p, r = backend.xp(), world.size, world.rank
    rng = np.random.default_rng(seed + r)
    failures = []
    # shared memory reaches one node's ranks: across nodes (MPIR_CVAR_NOLOCAL=1 makes every
    # rank its own) 'shm' must refuse on every rank, which test_comm_shm.py checks
    one_node = node.span(world) == 1
    digest = 0  # crc of every all-reduce result: all ranks must hold the same bits

    def check(what, got, want, dtype):
        got = None if got is None else backend.to_numpy(got)
        want = None if want is None else backend.to_numpy(want)
        if (got is None) != (want is None) or (got is not None and not same(got, want, dtype)):
            failures.append(f"rank {r} p={p}: {what}")

    for n in counts(p):
        for dtype in DTYPES:
            for op in OPS:
                x = data(xp, rng, n, dtype, op, r)
                want = world.all_reduce(x, op, algorithm="mpi")
                for algo in ALGORITHMS["all_reduce"]:
                    if algo == "mpi" or (algo == "shm" and not one_node):
                        continue
                    case = f"all_reduce {algo} {op} {dtype} n={n}"
                    got = world.all_reduce(x, op, algorithm=algo)
                    check(case, got, want, dtype)
                    digest = zlib.crc32(backend.to_numpy(got).tobytes(), digest)
                    y = x.copy()
                    out = world.all_reduce(y, op, algorithm=algo, out=y)
                    check(case + " in place", out if out is y else None, want, dtype)
                for algo in ALGORITHMS["reduce_scatter"]:
                    check(f"reduce_scatter {algo} {op} {dtype} n={n}",
                          world.reduce_scatter(x, op, algorithm=algo),
                          world.reduce_scatter(x, op, algorithm="mpi"), dtype)
                for root in sorted({0, p - 1}) if op == "sum" else [p - 1]:
                    for algo in ALGORITHMS["reduce"]:
                        check(f"reduce {algo} {op} {dtype} n={n} root={root}",
                              world.reduce(x, root, op, algorithm=algo),
                              world.reduce(x, root, op, algorithm="mpi"), dtype)
            x = data(xp, rng, n, dtype, "sum", r)
            rows = data(xp, rng, n * p, dtype, "sum", r, shape=(p, n))
            for algo in ALGORITHMS["all_gather"]:
                check(f"all_gather {algo} {dtype} n={n}", world.all_gather(x, algorithm=algo),
                      world.all_gather(x, algorithm="mpi"), dtype)
            for algo in ALGORITHMS["all_to_all"]:
                check(f"all_to_all {algo} {dtype} n={n}", world.all_to_all(rows, algorithm=algo),
                      world.all_to_all(rows, algorithm="mpi"), dtype)
            for root in sorted({0, p - 1}):
                for algo in ALGORITHMS["broadcast"]:
                    case = f"broadcast {algo} {dtype} n={n} root={root}"
                    want = world.broadcast(x, root, algorithm="mpi")
                    check(case, world.broadcast(x, root, algorithm=algo), want, dtype)
                    y = x.copy()
                    out = world.broadcast(y, root, algorithm=algo, out=y)
                    check(case + " in place", out if out is y else None, want, dtype)
                for algo in ALGORITHMS["gather"]:
                    check(f"gather {algo} {dtype} n={n} root={root}",
                          world.gather(x, root, algorithm=algo),
                          world.gather(x, root, algorithm="mpi"), dtype)
                for algo in ALGORITHMS["scatter"]:
                    check(f"scatter {algo} {dtype} n={n} root={root}",
                          world.scatter(rows, root, algorithm=algo),
                          world.scatter(rows, root, algorithm="mpi"), dtype)

    if len(set(world.mpi.allgather(digest))) != 1:
        failures.append(f"rank {r} p={p}: all-reduce results differ in their bits across ranks")

    # multi-dimensional and non-contiguous inputs are handled (copied), the result is fresh
    m = xp.asarray(np.arange(24, dtype=np.float64).reshape(4, 6) * (r + 1))
    for algo in ALGORITHMS["all_reduce"]:
        if algo == "shm" and not one_node:
            continue
        check(f"all_reduce {algo} non-contiguous", world.all_reduce(m[:, ::2], algorithm=algo),
              world.all_reduce(xp.ascontiguousarray(m[:, ::2]), algorithm="mpi"), "float64")
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_collectives_equal_mpi(nprocs):
    failures = [f for per_rank in run_on_ranks(collectives_body, nprocs, timeout=240)
                for f in per_rank]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:50])
