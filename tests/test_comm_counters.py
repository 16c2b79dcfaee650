"""The counters confirm what each algorithm must move per rank (n bytes per rank's vector)."""
import math

import ml_dtypes
import numpy as np
import pytest

from minipar.testing import run_on_ranks


def expected_bytes_sent(algo, p, r, n):
    """Bytes rank r sends in one all-reduce of n bytes (p a power of two, n divisible by p)."""
    return {
        "ring": 2 * (p - 1) * n // p,
        "recursive_halving": 2 * (p - 1) * n // p,
        "recursive_doubling": n * int(math.log2(p)),
        "parallel": (p - 1) * n,
        "sequential": n if r in (0, p - 1) else 2 * n,
        "parameter_server": (p - 1) * n if r == 0 else n,
        "sharded_ps": 2 * (p - 1) * n // p,
    }[algo]


def counters_body(n_elements):
    from minipar import comm

    world = comm.world()
    p, r = world.size, world.rank
    x = np.ones(n_elements, np.float64)
    n = x.nbytes
    failures = []
    for algo in ("ring", "recursive_halving", "recursive_doubling", "parallel", "sequential",
                 "parameter_server", "sharded_ps"):
        world.counters.reset()
        world.all_reduce(x, algorithm=algo)
        c = world.counters.snapshot()
        want = expected_bytes_sent(algo, p, r, n)
        if c["bytes_sent"] != want or c["bytes_received"] != want:
            failures.append(f"rank {r}: {algo} sent {c['bytes_sent']} received "
                            f"{c['bytes_received']} bytes, expected {want} each way")
    # 16-bit vectors move as 2-byte elements: a quarter of float64's bytes, half of float32's
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for algo in ("ring", "recursive_halving", "recursive_doubling", "parallel", "sequential"):
            world.counters.reset()
            world.all_reduce(x.astype(dtype), algorithm=algo)
            c = world.counters.snapshot()
            want = expected_bytes_sent(algo, p, r, n // 4)
            if c["bytes_sent"] != want or c["bytes_received"] != want:
                failures.append(f"rank {r}: {np.dtype(dtype).name} {algo} sent "
                                f"{c['bytes_sent']} bytes, expected {want}")
    world.counters.reset()
    world.all_reduce(x, algorithm="ring")
    if world.counters.messages_sent != 2 * (p - 1):
        failures.append(f"rank {r}: ring sent {world.counters.messages_sent} messages")
    # the single parameter server's link carries 2(p-1)n, the sharded servers' 2(p-1)/p n each way
    world.counters.reset()
    world.all_reduce(x, algorithm="parameter_server")
    link = world.counters.bytes_sent + world.counters.bytes_received
    if r == 0 and link != 2 * (p - 1) * n:
        failures.append(f"server link carried {link} bytes, expected {2 * (p - 1) * n}")
    # point-to-point counters and trace events
    world.counters.reset()
    world.trace = []
    out = np.empty_like(x)
    world.sendrecv(x, (r + 1) % p, out, (r - 1) % p)
    c = world.counters.snapshot()
    if (c["messages_sent"], c["bytes_sent"], c["bytes_received"]) != (1, n, n):
        failures.append(f"rank {r}: sendrecv counted {c}")
    (event,) = world.trace
    if event[:3] != (r, "sendrecv", ((r + 1) % p, (r - 1) % p)) or event[5] != 2 * n \
            or not event[3] <= event[4] or c["comm_time_s"] <= 0:
        failures.append(f"rank {r}: trace event {event}")
    world.trace = None
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [4, 8])
def test_counters_match_the_algorithms(nprocs):
    failures = sum(run_on_ranks(counters_body, nprocs, args=(nprocs * 1000,)), [])
    assert not failures, "\n".join(failures)


def test_expected_bytes_formulas():
    assert expected_bytes_sent("ring", 4, 0, 4000) == 6000
    assert expected_bytes_sent("parameter_server", 4, 0, 100) == 300
