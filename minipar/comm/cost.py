"""The alpha-beta-gamma cost model, fitted on this machine.

    time(one step, sending m bytes) = alpha + m * beta(m)      time(reduce m bytes) = m * gamma(m)

Each algorithm's formula sits beside its code in ``collectives.py`` as ``cost(p, n, a, b, g)``:
``a`` is alpha, and ``b(m)``, ``g(m)`` are seconds per byte of an m-byte message and of an
m-byte reduction, so a ring's formula asks for ``b(n / p)``, the size of the messages it sends.

Caches make beta and gamma depend on the size: 64 KiB stays in L2, 4 MiB in L3, and 16 MiB or
more streams from memory at a third of the speed. So ``fit(comm)`` measures them at every power
of two in ``FIT_SIZES`` the way the algorithms use the machine (every rank sends a message to
rank + 1 while it receives one from rank - 1, a ring step; every rank reduces into a third
array at the same moment, as a ring reduces x and the chunk that arrived into the result), and
``b(m)`` and ``g(m)`` interpolate between them (linear in log2 m; below 32 KiB a message costs
about alpha, whatever its beta, so the 32 KiB values stand in). When ranks outnumber cores,
this folds the sharing of cores into the constants.

alpha is what one step costs beyond its bytes: MPI's latency, and the Python around it (the
wrapper's checks and counters, slicing, the ufunc call). That Python differs by algorithm, so
``fit(comm, algorithms)`` gives each algorithm its own alpha: its tiny all-reduce (16 floats a
rank), timed like the benchmark times one, over its number of steps (the alphas in its formula,
read off as ``cost(p, n, 1, 0, 0)``). ``model.alpha`` is the ring's.

``default_model()`` is the last fit in this process, else ``MINIPAR_COST="alpha,beta,gamma"``
(seconds, seconds per byte, seconds per byte), else a laptop-like guess.
"""
import collections
import itertools
import math
import os
import statistics
import time

from minipar import backend

Params = collections.namedtuple("Params", "alpha beta gamma")  # the constants at one size
FIT_SIZES = tuple(1 << k for k in range(15, 27))  # 32 KiB, 64 KiB, ... 64 MiB
_fitted = {}


def interpolate(table, m):
    """{size: value} at m bytes: linear in log2(m) between the fitted sizes around m."""
    sizes = sorted(table)
    x = math.log2(min(max(m, sizes[0]), sizes[-1]))
    for lo, hi in zip(sizes, sizes[1:]):
        if x <= math.log2(hi):
            w = (x - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return (1 - w) * table[lo] + w * table[hi]
    return table[sizes[-1]]


class Model:
    """alpha (seconds per step; per algorithm in ``alphas``), beta(m) and gamma(m) (seconds
    per byte, fitted per size)."""

    def __init__(self, alpha, betas, gammas, alphas=None):
        self.alpha, self.betas, self.gammas = alpha, dict(betas), dict(gammas)
        self.alphas = dict(alphas or {})

    def alpha_of(self, algorithm):
        """The per-step overhead fitted for this algorithm (else the ring's)."""
        return self.alphas.get(algorithm, self.alpha)

    def beta(self, m):
        return interpolate(self.betas, m)

    def gamma(self, m):
        return interpolate(self.gammas, m)

    def at(self, m):
        """The constants an m-byte message or reduction sees, as Params."""
        return Params(self.alpha, self.beta(m), self.gamma(m))

    def __repr__(self):
        return f"Model(alpha={self.alpha:.3g}, sizes={sorted(self.betas)})"


GUESS = Model(5e-6, {1: 1 / 4e9}, {1: 1 / 4e9})


def default_model():
    """The cost model ``auto`` and the benchmark use (see the module docstring)."""
    if "model" in _fitted:
        return _fitted["model"]
    env = os.environ.get("MINIPAR_COST")
    if env:
        alpha, beta, gamma = (float(v) for v in env.split(","))
        return Model(alpha, {1: beta}, {1: gamma})
    return GUESS


def predict(collective, algorithm, p, nbytes, model=None):
    """Predicted seconds of ``collective`` by ``algorithm`` on p ranks for n bytes (None: no formula)."""
    from minipar.comm.collectives import ALGORITHMS  # collectives imports this module

    formula = ALGORITHMS[collective][algorithm].cost
    model = model or default_model()
    if formula is None:
        return None
    return formula(p, nbytes, model.alpha_of(algorithm), model.beta, model.gamma)


# ----------------------------------------------------------------------------------------------
# Measuring the constants
# ----------------------------------------------------------------------------------------------

def slowest_median(comm, times):
    """Median over iterations of the slowest rank's time (the nccl-tests / OSU convention)."""
    per_rank = comm.all_gather_object(times)
    return statistics.median(max(column) for column in zip(*per_rank))


def timed(comm, step, iters, warmup=3):
    """Median of the slowest rank's seconds for ``step()``, all ranks starting together."""
    times = []
    for i in range(warmup + iters):
        comm.mpi.Barrier()
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
    from minipar.comm.collectives import ALGORITHMS  # collectives imports this module

    xp = backend.xp()
    x = xp.ones(16 * comm.size, xp.float32)
    out = xp.empty_like(x)
    run = lambda: comm.all_reduce(x, algorithm=algorithm, out=out)  # noqa: E731
    seconds = min(timed(comm, run, iters) for _ in range(batches))
    zero = lambda m: 0  # noqa: E731
    steps = ALGORITHMS["all_reduce"][algorithm].cost(comm.size, x.nbytes, 1, zero, zero)
    return seconds / max(steps, 1)


def fit(comm, sizes=FIT_SIZES, small=8, algorithms=("ring",), rounds=3):
    """Fit alpha per algorithm (a tiny all-reduce's step), then beta (ring-step slope) and
    gamma (an add) at each size, all ranks at once. Returns a Model; it becomes
    ``default_model()`` in this process.

    m-byte messages and reductions walk through p windows (at least 2, at most 64 MiB), so they
    find the caches as a ring all-reduce of p m-byte chunks does (hot at 64 KiB, streaming from
    memory at 16 MiB). Each size's constants are the median of ``rounds`` samples taken a
    round apart, so one noisy moment does not bend the curve at one size."""
    exchange_time(comm, small)  # warm-up: the first messages on a channel pay its set-up
    latency = min(exchange_time(comm, small, iters=40) for _ in range(5))  # as step_time
    sends, adds = {m: [] for m in sizes}, {m: [] for m in sizes}
    for _ in range(rounds):  # all sizes once a round: a burst of other work spoils one round
        for size in sizes:
            iters = max(4, min(100, (256 << 20) // size) // rounds)
            span = max(2, min(comm.size, (64 << 20) // size))  # p windows, at most 64 MiB
            sends[size].append(exchange_time(comm, size, iters, span))
            adds[size].append(reduce_time(comm, size, iters, span))
    betas = {m: max(statistics.median(sends[m]) - latency, 0) / (m - small) for m in sizes}
    gammas = {m: statistics.median(adds[m]) / m for m in sizes}
    from minipar.comm.collectives import ALGORITHMS  # collectives imports this module

    alphas = {a: step_time(comm, a) if comm.size > 1 else latency
              for a in dict.fromkeys(("ring",) + tuple(algorithms))
              if ALGORITHMS["all_reduce"][a].cost is not None}
    model = Model(alphas["ring"], betas, gammas, alphas)
    _fitted["model"] = model
    return model
