"""The shared-memory all-reduces (comm/shm.py, comm/hierarchical.py) equal MPI's own.

shm and hierarchical on one node run in test_comm_collectives.py's table with every other
algorithm. Here: hierarchical on one machine cut into "nodes" (MINIPAR_RANKS_PER_NODE=k,
node.py) of 1, 2 and 3 ranks for p = 1..5 and 8, every op and dtype, odd counts, in place and
not; the same bits on every rank; the window growing and shrinking; strict device arrays
(staged through the host window); what ``auto`` picks where ranks share a node; the bytes the
counters see; and ranks that disagree: the same CommError on every rank, no hang.
"""
import zlib

import numpy as np
import pytest

from minipar.testing import run_on_ranks
from test_comm_collectives import DTYPES, counts, data, same

SPLITS = (None, 1, 2, 3)  # ranks per pretend node (None: the real node, one for all)


def _with_nodes(world, k):
    """A fresh communicator over world's ranks, cut into nodes of k ranks (None: real nodes)."""
    import os
    if k is None:
        os.environ.pop("MINIPAR_RANKS_PER_NODE", None)
    else:
        os.environ["MINIPAR_RANKS_PER_NODE"] = str(k)
    return world.dup()


def equal_body(seed=0):
    """Every case on this rank; a list of failures."""
    from minipar import backend, comm
    from minipar.comm import OPS, node

    world = comm.world()
    xp, p, r = backend.xp(), world.size, world.rank
    rng = np.random.default_rng(seed + r)
    failures, digest = [], 0
    for k in SPLITS:
        c = _with_nodes(world, k)
        algos = ["hierarchical"] + (["shm"] if node.span(c) == 1 else [])
        for n in counts(p):
            for dtype in DTYPES:
                for op in OPS:
                    x = data(xp, rng, n, dtype, op, r)
                    want = backend.to_numpy(c.all_reduce(x, op, algorithm="mpi"))
                    for algo in algos:
                        case = f"rank {r} p={p} nodes of {k}: {algo} {op} {dtype} n={n}"
                        got = backend.to_numpy(c.all_reduce(x, op, algorithm=algo))
                        if not same(got, want, dtype):
                            failures.append(case)
                        digest = zlib.crc32(got.tobytes(), digest)
                        y = x.copy()
                        out = c.all_reduce(y, op, algorithm=algo, out=y)
                        if out is not y or not same(backend.to_numpy(y), want, dtype):
                            failures.append(case + " in place")
        # the window grows for a larger vector and serves smaller ones after it
        for n in (5, 70000, 3, 1 << 18, 17):
            x = xp.asarray(np.arange(n, dtype=np.float64) * (r + 1))
            for algo in algos:
                got = backend.to_numpy(c.all_reduce(x, algorithm=algo))
                if not np.array_equal(got, np.arange(n) * (p * (p + 1) // 2)):
                    failures.append(f"rank {r} p={p} nodes of {k}: {algo} n={n} after growth")
    if len(set(world.mpi.allgather(digest))) != 1:
        failures.append(f"rank {r} p={p}: shared-memory results differ in their bits across ranks")
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_shared_memory_all_reduce_equals_mpi(nprocs):
    failures = [f for per_rank in run_on_ranks(equal_body, nprocs, timeout=300) for f in per_rank]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:50])


def strict_body():
    """Device arrays (the strict stand-in) are staged through the host window."""
    from minipar import backend, comm

    world = comm.world()
    xp = backend.xp()
    failures = []
    for k in (None, 2):
        c = _with_nodes(world, k)
        for algo in ("hierarchical",) + (("shm",) if k is None else ()):
            x = xp.asarray(np.arange(1001, dtype=np.float32) + world.rank)
            got = c.all_reduce(x, algorithm=algo)
            want = c.all_reduce(x, algorithm="mpi")
            if not backend.is_gpu_array(got) or not np.array_equal(backend.to_numpy(got),
                                                                    backend.to_numpy(want)):
                failures.append(f"{algo} nodes of {k}")
    return failures, backend.device()


@pytest.mark.mpi
def test_device_arrays_are_staged_through_the_window():
    for failures, device in run_on_ranks(strict_body, 3, env={"MINIPAR_DEVICE": "strict"}):
        assert device == "strict"
        assert not failures, failures


def choice_body():
    """What auto runs, and the bytes the counters see, where ranks share nodes."""
    from minipar import comm
    from minipar.comm import allreduce, cost, node

    world = comm.world()
    # a machine where a copy is cheap next to a message: the shared-memory ones must win
    model = cost.Model(1e-6, {1: 1e-9}, {1: 1e-10})
    picks = {}
    for k in (None, 1, 2):
        c = _with_nodes(world, k)
        nodes = node.span(c)
        picks[str(k)] = (nodes, allreduce.choose(c.size, 1 << 22, model, nodes=nodes))
        x = np.ones(1 << 12, np.float32)
        c.counters.reset()
        c.all_reduce(x, algorithm="hierarchical")
        picks[f"bytes {k}"] = c.counters.snapshot()["bytes_sent"]
    cost.use(model)
    c = _with_nodes(world, None)
    c.trace = []
    y = c.all_reduce(np.ones(1 << 20, np.float32), algorithm="auto")  # shm: no message
    picks["auto"] = (float(y[0]), len(c.trace))
    return picks


@pytest.mark.mpi
def test_auto_picks_shared_memory_where_ranks_share_a_node():
    picks = run_on_ranks(choice_body, 4)
    for r, got in enumerate(picks):
        assert got["None"] == [1, "shm"]  # one node: shm
        assert got["2"] == [2, "hierarchical"]  # two nodes of two: hierarchical
        assert got["1"][0] == 4 and got["1"][1] in ("ring", "recursive_halving",
                                                    "recursive_doubling")  # no node shared
        assert got["bytes None"] == 0  # one node: nothing goes over a message
        assert got["bytes 1"] > 0  # every rank its own node: the leaders' messages count
        assert got["bytes 2"] == (4096 * 4 if r % 2 == 0 else 0)  # leaders: 2 nodes, 2(N-1)/N n
        assert got["auto"] == [4.0, 0]


def test_formulas_reduce_to_their_parts():
    from minipar.comm import ALGORITHMS, cost
    from minipar.comm.hierarchical import hierarchical_cost
    from minipar.comm.shm import copy_cost, traffic

    model = cost.Model(2e-6, {1: 3e-10}, {1: 1e-10})
    a, b, g, n = 2e-6, model.beta, model.gamma, 1 << 20
    shm = ALGORITHMS["all_reduce"]["shm"].cost
    # copy in and the peers' slices out 3/4 of a copy each, three reductions of n/4, and my
    # slice written out: a third of one
    assert shm(4, n, a, b, g) == pytest.approx(2 * a + 1.5 * copy_cost(n, g) + 3 * n / 4 * g(n)
                                               + n / 12 * g(n))
    assert (traffic(2), traffic(2, bucket=True)) == (4, 2.5)  # docs/comm.md's bytes at p = 2
    assert hierarchical_cost(4, n, a, b, g, nodes=1) == pytest.approx(shm(4, n, a, b, g))
    ring = ALGORITHMS["all_reduce"]["ring"].cost(4, n, a, b, g)
    assert hierarchical_cost(4, n, a, b, g, nodes=4) <= 3 * a + 2 * copy_cost(n, g) + ring
    assert cost.predict("all_reduce", "hierarchical", 8, n, model, nodes=2) == pytest.approx(
        hierarchical_cost(8, n, model.alpha, b, g, nodes=2))


MISMATCHES = [(None, "shm", "count"), (None, "shm", "dtype"), (None, "shm", "op"),
              (2, "hierarchical", "count"), (2, "hierarchical", "dtype"),
              (3, "hierarchical", "count"), (None, "hierarchical", "op"),
              (2, "shm", "count")]


def mismatch_body():
    """Ranks that disagree, case after case: every case's error message on this rank (None
    when nothing was raised). Each case on a fresh communicator."""
    from minipar import comm
    from minipar.comm import CommError

    world = comm.world()
    messages = []
    for k, algo, what in MISMATCHES:
        c = _with_nodes(world, k)
        n, dtype, op = 8, "float32", "sum"
        if world.rank == world.size - 1:
            n, dtype, op = {"count": (9, dtype, op), "dtype": (n, "float64", op),
                            "op": (n, dtype, "max")}[what]
        try:
            c.all_reduce(np.ones(n, dtype), op, algorithm=algo)
            messages.append(None)
        except CommError as error:
            messages.append(str(error))
    return messages


@pytest.mark.mpi
def test_ranks_that_disagree_get_an_error_on_every_rank():
    per_rank = run_on_ranks(mismatch_body, 4, timeout=120)
    for i, (k, algo, what) in enumerate(MISMATCHES):
        messages = [m[i] for m in per_rank]
        assert all(messages), (k, algo, what, messages)
        words = "span 2 nodes" if (k, algo) == (2, "shm") else what
        assert all(words in m for m in messages), (k, algo, what, messages)
        if k is None or algo == "shm":
            assert len(set(messages)) == 1, messages  # one node: the very same words everywhere



def back_to_back_body(rounds=20):
    """Calls that agree and calls where the last rank's count differs, back to back: each
    mismatch is the same error on every rank, and the next call agrees."""
    from minipar import comm
    from minipar.comm import CommError

    world = comm.world()
    x = np.ones(1000, np.float32)
    seen = []
    for _ in range(rounds):
        total = float(world.all_reduce(x, algorithm="shm")[0])
        try:
            world.all_reduce(x[:-1] if world.rank == world.size - 1 else x, algorithm="shm")
            seen.append((total, None))
        except CommError as err:
            seen.append((total, str(err)))
    return seen


@pytest.mark.mpi
def test_a_mismatch_right_after_a_call_names_the_same_mismatch_everywhere():
    """A rank that raised on differing headers waits for every peer to read them before its
    next call writes its own header over them (a slow peer read the next call's before)."""
    per_rank = run_on_ranks(back_to_back_body, 3, timeout=120)
    for calls in zip(*per_rank):
        assert [total for total, _ in calls] == [3.0] * 3, calls
        errors = {error for _, error in calls}
        assert len(errors) == 1 and "counts" in errors.pop(), calls

def ddp_body():
    """DDP's buckets on shared memory: with ``auto`` on one node they run shm (no message is
    sent), overlapped or not, and training equals serial training (float64, 1e-10). The cost
    model: a byte sent costs 10 reduced ones (as fitted on this 2-core machine at 1 MiB), a
    step little, so shm is the cheapest for every bucket (tiny ones too)."""
    from minipar import comm
    from minipar.comm import cost
    from test_dp_helpers import max_difference, train

    cost.use(cost.Model(1e-8, {1: 1e-9}, {1: 1e-10}))
    world = comm.world()
    serial = train("mlp", "float64", "adamw")
    report = []
    for options in (dict(algorithm="mpi"), dict(algorithm="auto", overlap=True),
                    dict(algorithm="auto", overlap=False),
                    dict(algorithm="shm", overlap=True, bucket_cap_mb=0.0005),
                    dict(algorithm="hierarchical", overlap=False, bucket_cap_mb=0.0005)):
        world.counters.reset()
        got = train("mlp", "float64", "adamw", "ddp", world, **options)
        report.append((str(options), max_difference(got, serial),
                       world.counters.snapshot()["bytes_sent"]))
    return report


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_ddp_buckets_run_on_shared_memory_and_equal_serial(nprocs):
    for report in run_on_ranks(ddp_body, nprocs, timeout=240):
        wrap_bytes = report[0][2]  # with MPI's all-reduce only the wrap's broadcast is counted
        for options, difference, sent in report:
            assert difference < 1e-10, (options, difference)
            assert sent == wrap_bytes, (options, sent, wrap_bytes)  # buckets: no message


def shared_buffer_body():
    """Buckets in shared memory (buckets.bucket_buffers): an in-place shm all-reduce of them
    equals MPI's and never touches the communicator's own window (nothing is copied in).
    Device arrays (strict) stay on the device: their buckets are not shared."""
    from minipar import backend, comm, nn
    from minipar.comm import shm
    from minipar.parallel.data.buckets import bucket_buffers, make_buckets

    world = comm.world()
    c = world.dup()
    params = list(nn.Linear(40, 30).parameters()) + list(nn.Linear(30, 7).parameters())
    buffers = bucket_buffers(make_buckets(params, 1000), c)
    failures = []
    for i, buf in enumerate(buffers):
        buf[...] = backend.xp().arange(buf.size) * (world.rank + 1) + i
        want = backend.to_numpy(c.all_reduce(buf, algorithm="mpi"))
        for algo in ("shm", "auto", "ring"):
            mine = buf.copy()
            c.all_reduce(buf, algorithm=algo, out=buf)
            if not np.allclose(backend.to_numpy(buf), want):
                failures.append(f"bucket {i} {algo}")
            buf[...] = mine  # back to this rank's values
    shared = [shm.owner(b, b) is not None for b in buffers]
    return failures, backend.device(), shared, c.coll in shm._windows


@pytest.mark.mpi
@pytest.mark.parametrize("device, nprocs", [("cpu", 2), ("cpu", 5), ("strict", 3)])
def test_buckets_in_shared_memory_are_reduced_where_they_lie(device, nprocs):
    ranks = run_on_ranks(shared_buffer_body, nprocs, env={"MINIPAR_DEVICE": device})
    for failures, where, shared, copied in ranks:
        assert not failures, failures
        assert where == device
        assert all(shared) if device == "cpu" else not any(shared)
        assert not copied or device == "strict"
