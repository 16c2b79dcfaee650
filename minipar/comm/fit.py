"""Measuring the cost model's constants on this machine, all ranks at once.

    model = fit(comm)            # alpha per algorithm, beta(m) and gamma(m) at each size
    cost.predict("all_reduce", "ring", p, n, model)

beta is the slope of a ring step (every rank sends to rank + 1 while it receives from rank - 1),
the one-way beta that of a message rank 0 sends and rank 1 only receives, gamma the time of an
add into a third array, each at every power of two in ``FIT_SIZES``, walking through p windows
to meet the caches as an all-reduce does; alpha is what one step of an algorithm costs beyond its
bytes, from its tiny all-reduce (cost.py explains the model). Times are the median over
iterations of the slowest rank's time (nccl-tests, OSU); a size's constant is the fastest of
several rounds, and a size whose fastest round is not confirmed, or costs more than the next
size up, is measured again (``stalled``, ``settle``):
a loaded machine slows some rounds, it does not bend the curve.
"""
import itertools
import statistics
import time

from minipar import backend
from minipar.comm import cost
from minipar.comm.registry import ALGORITHMS

FIT_SIZES = tuple(1 << k for k in range(15, 27))  # 32 KiB, 64 KiB, ... 64 MiB


def timed(comm, step, iters, warmup=3, statistic=statistics.median):
    """Median of the slowest rank's seconds for ``step()``, all ranks starting together
    (``statistic=list``: the slowest rank's seconds of each of the ``iters`` calls)."""
    times = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        step()
        backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    # a collective step ends when its last rank does: the slowest rank's time is the step's,
    # and the median over iterations is nccl-tests' and OSU's convention
    per_rank = comm.all_gather_object(times)
    return statistic([max(column) for column in zip(*per_rank)])


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


def one_way_time(comm, nbytes, iters=20, span=1):
    """Seconds for one n-byte message sent one way: rank 0 sends to rank 1, which only
    receives, each time from the next of ``span`` windows; the other ranks wait, as the rest of
    a chain waits for its link (the steps of sequential and the parameter server)."""
    xp = backend.xp()
    buf = xp.ones(max(span * nbytes, 1), xp.uint8)
    window = _windows(nbytes, span)

    def step():
        i = window()
        if comm.rank == 0:
            comm.send(buf[i:i + nbytes], 1)
        elif comm.rank == 1:
            comm.recv(buf[i:i + nbytes], 0)
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


def step_times(comm, algorithms, rounds=5, iters=40, retries=3):
    """Seconds per step of a tiny all-reduce (16 floats a rank) by each algorithm: its alpha as
    paid. Its steps are the alphas in its formula: ``cost(p, n, 1, 0, 0)``.

    ``rounds`` batches of ``iters`` each, the algorithms taking turns, and each algorithm's
    lowest batch median: a burst of other work spoils one batch of these microsecond steps
    (all of one algorithm's, were its batches back to back), not the fit. An algorithm whose
    lowest batch no other confirms (``unconfirmed``) runs another batch, up to ``retries``."""
    xp = backend.xp()
    x = xp.ones(16 * comm.size, xp.float32)
    out = xp.empty_like(x)
    batches = {a: [] for a in algorithms}

    def batch(a):
        batches[a].append(timed(comm, lambda: comm.all_reduce(x, algorithm=a, out=out), iters))
    settle(algorithms, batch, lambda: unconfirmed(batches), rounds, retries)
    zero = lambda m: 0  # noqa: E731
    return {a: min(batches[a]) / max(ALGORITHMS["all_reduce"][a].cost(
        comm.size, x.nbytes, 1, zero, zero), 1) for a in algorithms}


def settle(keys, measure, unsettled, rounds, retries, progress=None):
    """Call ``measure(key)`` for every key once a round for ``rounds`` rounds, the keys taking
    turns, then once more for each key ``unsettled()`` names, up to ``retries`` times; returns
    {key: measurements added}. The caller's ``measure`` keeps its samples, ``unsettled`` reads
    them; ``progress`` wraps the rounds' list of keys (a progress bar)."""
    # the keys take turns: a burst of other work on the machine spoils one round at a few
    # keys, not every sample of one key
    for key in (progress or iter)([key for _ in range(rounds) for key in keys]):
        measure(key)
    again = {}
    for _ in range(retries):
        for key in unsettled():
            measure(key)
            again[key] = again.get(key, 0) + 1
    return again


AGREE = 1.25  # a size's minimum stands once a second round comes within 25 % of it
RISE = 1.10  # a size over 10 % dearer than the next size up (twice its bytes) is stalled


def unconfirmed(samples, agree=AGREE):
    """The keys of ``{key: [seconds, ...]}`` whose fastest sample no second one comes within
    ``agree`` times of (two rounds seldom hit the same burst of other work)."""
    return [k for k, ts in samples.items() if len(ts) > 1 and sorted(ts)[1] > agree * min(ts)]


def stalled(samples, agree=AGREE, rise=RISE):
    """The sizes whose fastest sample cannot be trusted yet, from ``{size: [seconds, ...]}``
    (one sample per round). Load only ever adds time, so the fastest round is the one to keep;
    it stands when

    - confirmed: another round took at most ``agree`` times as long (two rounds seldom hit
      the same burst of other work), and
    - in line: it is not slower than the next size up (more bytes never cost less; ``rise``
      leaves 10 % for the noise of the measurement itself).

    Every rank computes this from the same slowest-rank times, so they all agree on what to
    measure again."""
    sizes, best = sorted(samples), {m: min(ts) for m, ts in samples.items()}
    bad = set(unconfirmed(samples, agree))
    bad |= {m for m, bigger in zip(sizes, sizes[1:]) if best[m] > rise * best[bigger]}
    return sorted(bad)


def in_line(samples):
    """{size: fastest seconds}, no size dearer than any bigger one (more bytes never cost less):
    a stall that outlasted the retries is capped at what the next size up took."""
    best, cap = {}, float("inf")
    for m in sorted(samples, reverse=True):
        best[m] = cap = min(min(samples[m]), cap)
    return best


def slopes(send, small):
    """beta at each size of ``{size: fastest seconds}``: (t(m) - t(small)) / (m - small), the
    seconds per byte once the latency t(small) is paid. Where load left the latency as dear as
    a size (in_line caps it there), that difference is no reading at all, not an infinite
    bandwidth: such a size takes the beta of the sizes around it that could be read (if none
    could, t(m) / m, the latency counted in)."""
    raw = {m: (t - send[small]) / (m - small) for m, t in send.items() if m != small}
    read = {m: b for m, b in raw.items() if b > 0}
    return {m: b if b > 0 else cost.interpolate(read, m) if read else send[m] / m
            for m, b in raw.items()}


def fit(comm, sizes=FIT_SIZES, small=8, algorithms=("ring",), rounds=3, retries=3,
        progress=None):
    """Fit alpha per algorithm (a tiny all-reduce's step), then beta (ring-step slope), the
    one-way beta (a one-way message's slope; not on one rank) and gamma (an add) at each size,
    all ranks at once. Returns a Model; it becomes ``cost.default_model()`` in this process.

    ``progress``, when given, wraps the fit's measurements (an iterable, one item per size
    per round): the caller's progress bar, e.g. ``minipar.console.progress`` bound to a label
    (this layer does not print).

    m-byte messages and reductions walk through p windows (at least 2, at most 64 MiB), so they
    find the caches as a ring all-reduce of p m-byte chunks does (hot at 64 KiB, streaming from
    memory at 16 MiB).

    Robust to a loaded machine: every size, and the ``small``-byte message whose time is the
    latency subtracted from each, is measured once a round for ``rounds`` rounds (a burst of
    other work spoils one round at a few sizes, not the curve), and a size's
    constant comes from its fastest round (load only adds time). ``stalled`` finds the sizes
    whose fastest round is not yet confirmed by a second, or costs more than the next size up:
    they are measured again, up to ``retries`` more rounds, and refitted. The Model records
    what happened: ``model.refitted`` {size: rounds added}, ``model.unsettled`` (sizes still
    stalled when the retries ran out: their fastest round is used, capped by ``in_line``)."""
    exchange_time(comm, small)  # warm-up: the first messages on a channel pay its set-up
    sends, adds = {m: [] for m in (small,) + tuple(sizes)}, {m: [] for m in sizes}
    ones = {m: [] for m in sends} if comm.size > 1 else {}  # one rank: no peer to send one way
    if ones:
        one_way_time(comm, small)  # its warm-up

    def measure(size):
        iters = max(4, min(100, (256 << 20) // size) // rounds)
        span = max(2, min(comm.size, (64 << 20) // size))  # p windows, at most 64 MiB
        sends[size].append(exchange_time(comm, size, iters, span))
        if ones:
            ones[size].append(one_way_time(comm, size, iters, span))
        if size != small:
            adds[size].append(reduce_time(comm, size, iters, span))

    def stalled_sizes():
        return sorted(set(stalled(sends)) | set(stalled(adds)) | set(stalled(ones)))

    # all sizes once a round, the tiny message (the latency) first
    refitted = settle(list(sends), measure, stalled_sizes, rounds, retries, progress)
    unsettled = stalled_sizes()
    send, add = in_line(sends), in_line(adds)  # the latency, too, no dearer than 32 KiB
    latency, betas = send[small], slopes(send, small)
    gammas = {m: add[m] / m for m in sizes}
    algorithms = [a for a in dict.fromkeys(("ring",) + tuple(algorithms))
                  if ALGORITHMS["all_reduce"][a].cost is not None]
    alphas = step_times(comm, algorithms) if comm.size > 1 else dict.fromkeys(algorithms, latency)
    one_way = slopes(in_line(ones), small) if ones else None
    model = cost.Model(alphas["ring"], betas, gammas, alphas, one_way)
    model.refitted, model.unsettled = refitted, unsettled
    return cost.use(model)
