"""Running a schedule for real at a chosen cost per action: the waiting kernel.

    runs = timed_steps(comm, build("1f1b", 4, 8), unit=0.04, repeats=3)  # events of 3 steps
    bubble, events = measure_bubble(comm, build("1f1b", 4, 8), unit=0.04, repeats=3)  # the best

The stages are tiny (one 4x4 Linear each) and every action is padded to ``unit x
unit_cost(action)`` seconds by the runtime's ``delay``: F = 1, B = 2 (or B = W = 1 when split),
R = 1, 1/v of that per interleaved chunk, messages and OPT_STEP free. A rank that sleeps uses no
core, so p ranks run side by side on a machine with fewer cores, and the timeline is the
schedule's own; what the textbook leaves out and a real run adds is the messages' latency.

Other processes on the machine can only delay a message or a wake-up, never hurry one, so of a
few steps the least disturbed one (smallest bubble, shortest makespan) is the schedule's figure,
as ``timeit`` and ``partition.measure_costs`` keep the fastest run.
"""
from minipar import backend, manual_seed, nn

from .runtime import Pipeline
from .simulate import unit_cost
from .timeline import bubble_fraction, gather_events


def timed_steps(comm, schedule, unit, repeats=1):
    """Run ``schedule`` ``repeats`` times with the waiting kernel, after one warm-up step
    without it; on rank 0 each step's trace events (a list of lists), None elsewhere."""
    manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(schedule.n_stages)]).double()
    cost = unit_cost(schedule)
    pipe = Pipeline(model, schedule, comm, lambda out, t: ((out - t) ** 2).mean(), trace=True)
    x = backend.xp().ones((2 * schedule.microbatches, 4))
    runs = []
    for i in range(repeats + 1):
        pipe.step(x, x)
        pipe.delay = lambda a: unit * cost(a)
        events = gather_events(comm, pipe.events)
        if i and comm.rank == 0:
            runs.append(events)
    return runs if comm.rank == 0 else None


def measure_bubble(comm, schedule, unit, repeats=1):
    """On rank 0: (the bubble of the least disturbed of ``repeats`` steps, that step's events);
    None elsewhere."""
    runs = timed_steps(comm, schedule, unit, repeats)
    if runs is None:
        return None
    best = min(runs, key=lambda events: bubble_fraction(events, schedule.ranks))
    return bubble_fraction(best, schedule.ranks), best
