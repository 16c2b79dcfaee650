"""The textbook bubble of each schedule: idle / (idle + work) on a rank, as a formula of p, m, v.

With per-stage costs F = 1 and B + W = 2 (the convention of docs/pipeline.md), the simulator's
bubble of a schedule (simulate.py, then ``timeline.bubble_fraction``) equals this exactly; the
runtime's measured bubble approaches it as messages get cheap (scripts/bench_pipeline.py).
"""

# name -> (formula, (p, m, v) -> (numerator, denominator)), kept unreduced so 3/27 reads as 3/27.
THEORY = {
    "naive": ("(p-1)/p", lambda p, m, v: (p - 1, p)),
    "gpipe": ("(p-1)/(m+p-1)", lambda p, m, v: (p - 1, m + p - 1)),
    # re-computing costs one more F per micro-batch, but R needs no message, so it hides in the drain
    "gpipe-remat": ("3(p-1)/(4m+3(p-1))", lambda p, m, v: (3 * (p - 1), 4 * m + 3 * (p - 1))),
    "1f1b": ("(p-1)/(m+p-1)", lambda p, m, v: (p - 1, m + p - 1)),
    "interleaved": ("(p-1)/(v*m+p-1)", lambda p, m, v: (p - 1, v * m + p - 1)),
    # m < p never reaches the steady state: makespan 2(m+p)-1 for this order, work 3m
    "zb-h1": ("(p-1)/(3m+p-1) if m >= p, else (2p-m-1)/(2(m+p)-1)",
              lambda p, m, v: (p - 1, 3 * m + p - 1) if m >= p else (2 * p - m - 1, 2 * (m + p) - 1)),
    # two chunks per rank, F = B = W = 1/2 each: the steady state has no bubble; the fill and drain
    # leave (p-1)/2 idle (6m+p-1: in half units), or 2p-1-m while m is too small to reach it
    "zb-v": ("(p-1)/(6m+p-1) if 2m >= 3p-1, else (2p-1-m)/(2m+2p-1)",
             lambda p, m, v: (p - 1, 6 * m + p - 1) if 2 * m >= 3 * p - 1
             else (2 * p - 1 - m, 2 * m + 2 * p - 1)),
    # v chunks of 1/v: idle (p-1)/v once m >= p (v = 1: ZB-H1's); fewer, the makespan T of
    # the longer of two chains, in units of 1/v (so the fraction reads idle*v / T*v)
    "zb-interleaved": ("(p-1)/(3vm+p-1) if m >= p, else 1-3m/T with vT = max((2m+p)v+p-1, "
                       "2pv+2m-1)", lambda p, m, v: _zb_interleaved(p, m, v)),
    # m >= 2p (its rule); F&B runs as F + B, one after the other: each rank idles p-1 stage
    # passes, DualPipe's (PP/2-1)(F&B+B-3W) with PP = 2p chunks, F = W = 1/2, B = 1, F&B = 3/2
    "dualpipev": ("(p-1)/(3m+p-1)", lambda p, m, v: (p - 1, 3 * m + p - 1)),
    "pipedream": ("(p-1)/(m+p-1), fill and drain only", lambda p, m, v: (p - 1, m + p - 1)),
}


def _zb_interleaved(p, m, v):
    if m >= p:
        return p - 1, 3 * v * m + p - 1
    vt = max((2 * m + p) * v + p - 1, 2 * p * v + 2 * m - 1)
    return vt - 3 * v * m, vt


def theory_key(schedule):
    return schedule.name + ("-remat" if schedule.remat else "")


def bubble_theory(schedule):
    """(formula, numerator, denominator) of the schedule's textbook bubble fraction."""
    formula, terms = THEORY[theory_key(schedule)]
    return (formula,) + terms(schedule.ranks, schedule.microbatches, schedule.chunks)
