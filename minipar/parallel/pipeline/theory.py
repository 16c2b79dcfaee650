"""The textbook bubble of each schedule: idle / (idle + work) on a rank, as a formula of p, m, v.

With per-stage costs F = 1 and B + W = 2 (schedules.py's convention), the simulator's bubble of a
schedule (simulate.py, then ``timeline.bubble_fraction``) equals this exactly; the runtime's
measured bubble approaches it as messages get cheap (scripts/bench_pipeline.py).
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
    "pipedream": ("(p-1)/(m+p-1), fill and drain only", lambda p, m, v: (p - 1, m + p - 1)),
}


def theory_key(schedule):
    return schedule.name + ("-remat" if schedule.remat else "")


def bubble_theory(schedule):
    """(formula, numerator, denominator) of the schedule's textbook bubble fraction."""
    formula, terms = THEORY[theory_key(schedule)]
    return (formula,) + terms(schedule.ranks, schedule.microbatches, schedule.chunks)
