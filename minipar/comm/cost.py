"""The alpha-beta-gamma cost model, fitted on this machine.

    time(message of n bytes) = alpha + n * beta        time(reduce n bytes) = n * gamma

Each algorithm's formula sits beside its code in ``collectives.py`` (``fn.cost(p, n, a, b, g)``).
``fit(comm)`` measures the three constants the way the algorithms use the machine: every rank
exchanges messages with a partner at the same moment (a ping-pong per pair of ranks, both
directions at once, as in a ring step), and every rank adds two arrays at the same moment. When
ranks outnumber cores this folds the sharing of cores into alpha, beta and gamma.

Caches make beta and gamma depend on the working set: a 64 KiB vector stays in cache, a 16 MiB
one streams from memory at a third of the speed. So ``fit`` measures them at a few sizes
(``FIT_SIZES``) and a prediction for n bytes uses the constants fitted nearest to n (log scale).
alpha is one fit: the time of a tiny exchange, Python wrapper included.

``default_params(n)`` is the last fit in this process, else ``MINIPAR_COST="alpha,beta,gamma"``
(seconds, seconds per byte, seconds per byte), else a laptop-like guess.
"""
import collections
import math
import os
import statistics
import time

from mpi4py import MPI

from minipar import backend

Params = collections.namedtuple("Params", "alpha beta gamma")
GUESS = Params(alpha=5e-6, beta=1 / 4e9, gamma=1 / 4e9)
FIT_SIZES = (64 << 10, 1 << 20, 16 << 20)
_fitted = {}


def nearest(table, nbytes):
    """The entry of {size: Params} fitted at the size nearest to n bytes (on a log scale)."""
    return table[min(table, key=lambda size: abs(math.log2(size) - math.log2(max(nbytes, 1))))]


def default_params(nbytes=1 << 20):
    """The cost constants ``auto`` and the benchmark use for an n-byte vector (module docstring)."""
    if "table" in _fitted:
        return nearest(_fitted["table"], nbytes)
    env = os.environ.get("MINIPAR_COST")
    if env:
        return Params(*(float(v) for v in env.split(",")))
    return GUESS


def predict(collective, algorithm, p, nbytes, params=None):
    """Predicted seconds of ``collective`` by ``algorithm`` on p ranks for n bytes (None: no formula)."""
    from minipar.comm.collectives import ALGORITHMS  # collectives imports this module

    formula = ALGORITHMS[collective][algorithm].cost
    if isinstance(params, dict):
        params = nearest(params, nbytes)
    return None if formula is None else formula(p, nbytes, *(params or default_params(nbytes)))




def slowest_median(comm, times):
    """Median over iterations of the slowest rank's time (the nccl-tests / OSU convention)."""
    per_rank = comm.mpi.allgather(times)
    return statistics.median(max(column) for column in zip(*per_rank))


def exchange_time(comm, nbytes, iters=20, warmup=3):
    """Seconds for one message of n bytes when every rank swaps one with rank ^ 1 at once.

    (With p = 2 this is the classic ping-pong, both ways at once; an odd last rank idles.)"""
    xp = backend.xp()
    send, recv = xp.ones(max(nbytes, 1), xp.uint8)[:nbytes], xp.empty(nbytes, xp.uint8)
    peer = comm.rank ^ 1
    times = []
    for i in range(warmup + iters):
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        if peer < comm.size:
            comm.sendrecv(send, peer, recv, peer)
        backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return slowest_median(comm, times)


def reduce_time(nbytes, iters=10):
    """Seconds for ``a += b`` on n bytes of float32 on this rank (median of iters)."""
    xp = backend.xp()
    a, b = xp.ones(nbytes // 4, xp.float32), xp.ones(nbytes // 4, xp.float32)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        xp.add(a, b, out=a)
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def fit(comm, sizes=FIT_SIZES, small=8):
    """Fit alpha (a tiny exchange), then beta (exchange slope) and gamma (an add) at each size,
    all ranks at once. Returns {size: Params}; it becomes ``default_params`` in this process."""
    alpha = exchange_time(comm, small)
    table = {}
    for size in sizes:
        iters = max(3, min(20, (64 << 20) // size))
        beta = max(exchange_time(comm, size, iters=iters) - alpha, 1e-12) / (size - small)
        comm.mpi.Barrier()
        gamma = comm.mpi.allreduce(reduce_time(size, iters), op=MPI.MAX) / size
        table[size] = Params(alpha, beta, gamma)
    _fitted["table"] = table
    return table
