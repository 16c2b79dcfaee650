"""The simulator: a schedule plus a cost per action gives the timeline, without running a model.

Each rank walks its list in order with its own clock. A computation or a send takes ``cost(a)``
and starts when the previous action ended; a send's data arrives ``latency(a)`` after it ends; a
receive ends when its data has arrived (the wait is idle time); an F&B pair runs its F, then its
B, an event each. That is exactly the runtime's contract (sends posted without waiting, receives
block), so the events it returns have the shape a runtime's ``Tracer`` records, and timeline.py
measures both the same way.

If every unfinished rank is stuck at a receive whose send has not happened, the schedule would
hang: ``simulate`` raises ``ScheduleError`` naming the ranks and the actions waiting on each other.
"""
from .actions import B, BW, F, R, RECVS, SENDS, W, ScheduleError, message_key
from .timeline import Event


def _pass_costs(schedule, f, b, w):
    """Each pass's cost by its kind: F = f, R = f (a forward again), W = w, B = b, or b + w
    when the schedule does not split W from B, and BW (a whole backward) b + w."""
    return {F: f, R: f, W: w, B: b if schedule.split_backward else b + w, BW: b + w}


def unit_cost(schedule, f=1.0, b=1.0, w=1.0):
    """The textbook costs per stage: F = f, B = b + w (or b when W is separate), W = w, R = f;
    a chunk of an interleaved rank costs 1/v of that; messages and OPT_STEP are free."""
    table = _pass_costs(schedule, f, b, w)
    v = schedule.chunks
    return lambda action: table.get(action.kind, 0.0) / v


def cost_by_stage(schedule, stages, f=1.0, b=1.0, w=1.0):
    """Costs per action when one micro-batch's passes through stage s cost ``stages[s]`` in
    all, split f : b : w between F, B and W (R as F; B takes W's share when W is not separate):
    stages of unequal cost, as a model's layers cut them; messages and OPT_STEP are free."""
    total = f + b + w
    share = _pass_costs(schedule, f, b, w)
    return lambda action: stages[action.stage] * share.get(action.kind, 0.0) / total


def simulate(schedule, cost=None, latency=None):
    """Replay ``schedule`` with ``cost(action)`` seconds per action (default ``unit_cost``) and
    ``latency(send_action)`` seconds in flight per message (default 0); return the Events."""
    cost = cost or unit_cost(schedule)
    latency = latency or (lambda action: 0.0)
    p = schedule.ranks
    clock, pos, arrival, events = [0.0] * p, [0] * p, {}, []
    while any(pos[r] < len(schedule.actions[r]) for r in range(p)):
        moved = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a, start = acts[pos[r]], clock[r]
                if a.kind in RECVS:
                    if message_key(a) not in arrival:
                        break  # blocked until the sender gets there
                    end = max(start, arrival[message_key(a)]) + cost(a)
                    events.append(Event(r, start, end, a.kind, a.mb, a.chunk))
                else:
                    for part in a.parts:  # an F&B pair: its F, then its B
                        end = start + cost(part)
                        events.append(Event(r, start, end, part.kind, part.mb, part.chunk))
                        start = end
                    if a.kind in SENDS:
                        arrival[message_key(a)] = end + latency(a)
                clock[r], pos[r], moved = end, pos[r] + 1, True
        if not moved:
            raise ScheduleError(_deadlock(schedule, pos))
    return events


def _deadlock(schedule, pos):
    """Follow who waits on whom from a stuck rank until a rank repeats (a cycle) or the chain
    reaches a rank that has finished without sending."""
    waiting = {r: schedule.actions[r][i] for r, i in enumerate(pos) if i < len(schedule.actions[r])}
    r, chain = min(waiting), []
    while r in waiting and r not in chain:
        chain.append(r)
        r = waiting[r].peer
    lines = [f"rank {q} waits at {waiting[q]} for rank {waiting[q].peer}" for q in chain]
    if r in chain:
        cycle = chain[chain.index(r):]
        end = f"a cycle: ranks {' -> '.join(map(str, cycle + [r]))} wait on each other"
    else:
        end = f"rank {r} finished without sending it"
    return f"deadlock in schedule {schedule.name!r}: " + "; ".join(lines) + f"; {end}"
