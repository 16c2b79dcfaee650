"""Measuring the cost model's constants on this machine, all ranks at once.

    model = fit(comm)            # alpha per algorithm, beta(m) and gamma(m) at each size
    cost.predict("all_reduce", "ring", p, n, model)

beta is the slope of a ring step (every rank sends to rank + 1 while it receives from rank - 1),
gamma the time of an add into a third array, both measured at each power of two in
``FIT_SIZES`` walking through p windows so they meet the caches as an all-reduce does; alpha is
what one step of an algorithm costs beyond its bytes, from its tiny all-reduce (cost.py explains
the model). Times are the median over iterations of the slowest rank's time (nccl-tests, OSU).
"""
import itertools
import statistics
import time

from minipar import backend
from minipar.comm import cost
from minipar.comm.registry import ALGORITHMS

FIT_SIZES = tuple(1 << k for k in range(15, 27))  # 32 KiB, 64 KiB, ... 64 MiB


def slowest_median(comm, times):
    """Median over iterations of the slowest rank's time (the nccl-tests / OSU convention)."""
    per_rank = comm.all_gather_object(times)
    return statistics.median(max(column) for column in zip(*per_rank))


def timed(comm, step, iters, warmup=3):
    """Median of the slowest rank's seconds for ``step()``, all ranks starting together."""
    times = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        step()
        backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return slowest_median(comm, times)


def _windows(nbytes, span):
    """Offsets of the next n-byte window of a span-window buffer, one per call, round and round
    (a ring all-reduce of p m-byte chunks walks through x and its result that way)."""
    i = itertools.count()
    return lambda: next(i) % span * nbytes


def exchange_time(comm, nbytes, iters=20, span=1):
    """Seconds for one ring step of n bytes: every rank sends to rank + 1 while it receives
    from rank - 1, all at once, each time from the next of ``span`` windows (span = p: the
    bytes a ring touches). (With p = 2 this is the classic ping-pong, both ways at once.)

    A ring, not pairs: when ranks outnumber cores, a rank waits for its left neighbour, who
    waits for its own, as in a ring all-reduce, and the fit pays that as the ring does."""
    xp = backend.xp()
    send, recv = xp.ones(max(span * nbytes, 1), xp.uint8), xp.empty(span * nbytes, xp.uint8)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    window = _windows(nbytes, span)

    def step():
        i = window()
        comm.sendrecv(send[i:i + nbytes], right, recv[i:i + nbytes], left)
    return timed(comm, step, iters)


def reduce_time(comm, nbytes, iters=10, span=1):
    """Seconds for ``c = a + b`` on n bytes of float32, every rank at once (slowest rank),
    each time on the next of ``span`` windows."""
    xp = backend.xp()
    a, b, c = (xp.ones(span * nbytes // 4, xp.float32) for _ in range(3))
    window = _windows(nbytes // 4, span)

    def step():
        i = window()
        xp.add(a[i:i + nbytes // 4], b[i:i + nbytes // 4], out=c[i:i + nbytes // 4])
    return timed(comm, step, iters, warmup=1)


def step_time(comm, algorithm="ring", iters=40, batches=5):
    """Seconds per step of a tiny all-reduce (16 floats a rank) by ``algorithm``: its alpha
    as paid. Its steps are the alphas in its formula: ``cost(p, n, 1, 0, 0)``.

    The lowest of a few batch medians: a burst of other work on the machine spoils one batch
    of these microsecond steps, not the fit."""
    xp = backend.xp()
    x = xp.ones(16 * comm.size, xp.float32)
    out = xp.empty_like(x)
    run = lambda: comm.all_reduce(x, algorithm=algorithm, out=out)  # noqa: E731
    seconds = min(timed(comm, run, iters) for _ in range(batches))
    zero = lambda m: 0  # noqa: E731
    steps = ALGORITHMS["all_reduce"][algorithm].cost(comm.size, x.nbytes, 1, zero, zero)
    return seconds / max(steps, 1)


def fit(comm, sizes=FIT_SIZES, small=8, algorithms=("ring",), rounds=3, progress=None):
    """Fit alpha per algorithm (a tiny all-reduce's step), then beta (ring-step slope) and
    gamma (an add) at each size, all ranks at once. Returns a Model; it becomes
    ``cost.default_model()`` in this process.

    ``progress``, when given, wraps the fit's measurements (an iterable, one item per size
    per round): the caller's progress bar, e.g. ``minipar.console.progress`` bound to a label
    (this layer does not print).

    m-byte messages and reductions walk through p windows (at least 2, at most 64 MiB), so they
    find the caches as a ring all-reduce of p m-byte chunks does (hot at 64 KiB, streaming from
    memory at 16 MiB). Each size's constants are the median of ``rounds`` samples taken a
    round apart, so one noisy moment does not bend the curve at one size."""
    exchange_time(comm, small)  # warm-up: the first messages on a channel pay its set-up
    latency = min(exchange_time(comm, small, iters=40) for _ in range(5))  # as step_time
    sends, adds = {m: [] for m in sizes}, {m: [] for m in sizes}
    # all sizes once a round: a burst of other work spoils one round
    measurements = [size for _ in range(rounds) for size in sizes]
    for size in (progress or iter)(measurements):
        iters = max(4, min(100, (256 << 20) // size) // rounds)
        span = max(2, min(comm.size, (64 << 20) // size))  # p windows, at most 64 MiB
        sends[size].append(exchange_time(comm, size, iters, span))
        adds[size].append(reduce_time(comm, size, iters, span))
    betas = {m: max(statistics.median(sends[m]) - latency, 0) / (m - small) for m in sizes}
    gammas = {m: statistics.median(adds[m]) / m for m in sizes}
    alphas = {a: step_time(comm, a) if comm.size > 1 else latency
              for a in dict.fromkeys(("ring",) + tuple(algorithms))
              if ALGORITHMS["all_reduce"][a].cost is not None}
    return cost.use(cost.Model(alphas["ring"], betas, gammas, alphas))
