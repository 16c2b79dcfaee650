"""The validator: a broken schedule is an error before it runs, not a hang or a wrong gradient.

Four checks, each naming the rank and the action at fault:
  coverage   every (stage, micro-batch) has exactly one F and one B (plus one W when the backward
             is split, one R with re-materialisation), on the rank that holds the stage;
  order      on each rank, nothing runs before its inputs: F after its RECV_F (or the local F of
             the stage before), B after its F, R and RECV_B, W after its B, a send after what it
             sends, OPT_STEP after the backwards it applies;
  matching   every send has exactly one receive on its peer, pointing back, and the reverse;
  progress   replayed with zero costs (``simulate``), no set of ranks waits on each other forever.
The first three read DualPipeV's F&B pair as its F then its B, and a whole backward BW as its B
then its W (``_passes``).
"""
from collections import Counter
from dataclasses import replace

from .actions import (B, BW, COMPUTE, F, OPT_STEP, R, RECV_B, RECV_F, RECVS, SEND_B, SEND_F, SENDS,
                      W, Action, ScheduleError, message_key)
from .simulate import simulate


def validate(schedule):
    """Return ``schedule`` if it is sound, else raise ``ScheduleError`` listing every problem."""
    passes = replace(schedule, actions=[_passes(acts) for acts in schedule.actions])
    problems = _coverage(passes) + _order(passes) + _matching(passes)
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise ScheduleError(f"schedule {schedule.name!r} is invalid:\n  " + "\n  ".join(shown))
    simulate(schedule, cost=lambda action: 0.0)  # raises on a deadlock
    return schedule


def _passes(acts):
    """A rank's list with each F&B as its F then its B, and each BW as its B then its W."""
    out = []
    for part in (part for a in acts for part in a.parts):
        out += [replace(part, kind=B), replace(part, kind=W)] if part.kind == BW else [part]
    return out


def _coverage(s):
    wanted = [F, B] + ([W] if s.split_backward else []) + ([R] if s.remat else [])
    counts = Counter((a.kind, a.stage, a.mb) for acts in s.actions for a in acts if a.kind in COMPUTE)
    problems = [f"rank {r}: {a} belongs to stage {a.stage}, which lives on rank {s.rank_of(a.stage)}"
                for r, acts in enumerate(s.actions) for a in acts
                if a.kind != OPT_STEP and a.stage >= 0 and s.rank_of(a.stage) != r]
    for stage in range(s.n_stages):
        for mb in range(s.microbatches):
            for kind in wanted:
                n = counts.pop((kind, stage, mb), 0)
                if n != 1:
                    problems.append(f"{kind}(stage {stage}, mb {mb}) appears {n} times, not once")
    problems += [f"unexpected {kind}(stage {stage}, mb {mb})" for kind, stage, mb in counts]
    return problems


def _needs(s, r, a):
    """What must already have happened on rank r before action a, as (kind, stage, mb) keys."""

    def neighbour(kind, recv, stage):  # input from stage +-1: a local action or a received message
        if not 0 <= stage < s.n_stages:
            return []
        return [(kind, stage, a.mb)] if s.rank_of(stage) == r else [(recv, a.stage, a.mb)]

    if a.kind == F:
        return neighbour(F, RECV_F, a.stage - 1)
    if a.kind in (R, SEND_F):
        return [(F, a.stage, a.mb)]
    if a.kind == B:
        recompute = [(R, a.stage, a.mb)] if s.remat else []
        return [(F, a.stage, a.mb)] + recompute + neighbour(B, RECV_B, a.stage + 1)
    if a.kind in (W, SEND_B) or (a.kind == OPT_STEP and a.mb >= 0):
        return [(B, a.stage, a.mb)]
    return []


def _order(s):
    problems = []
    for r, acts in enumerate(s.actions):
        done = set()
        for i, a in enumerate(acts):
            problems += [f"rank {r}: {a} runs before {Action(*need)}" for need in _needs(s, r, a)
                         if need not in done]
            if a.kind == OPT_STEP and a.mb < 0:
                problems += [f"rank {r}: {later} runs after the optimizer step"
                             for later in acts[i + 1:] if later.kind in COMPUTE]
            done.add((a.kind, a.stage, a.mb))
    return problems


def _matching(s):
    """Pair sends and receives by what they carry; name whatever is left over."""
    ends = {}  # message -> {"send": [(rank, action)], "recv": [...]}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in SENDS or a.kind in RECVS:
                side = "send" if a.kind in SENDS else "recv"
                ends.setdefault(message_key(a), {"send": [], "recv": []})[side].append((r, a))
    problems = []
    for (direction, stage, mb), pair in ends.items():
        to, frm = s.rank_of(stage), s.rank_of(stage + (1 if direction == B else -1))
        counterpart = {"send": Action(RECV_F if direction == F else RECV_B, stage, mb, peer=frm),
                       "recv": Action(SEND_F if direction == F else SEND_B,
                                      stage + (-1 if direction == F else 1), mb, peer=to)}
        for side, other, (at, want_peer) in (("send", "recv", (frm, to)), ("recv", "send", (to, frm))):
            for r, a in pair[side]:
                if r != at or a.peer != want_peer:
                    problems.append(f"rank {r}: {a} should run on rank {at} with peer {want_peer}")
            if len(pair[side]) > 1:
                problems.append(f"{pair[side][0][1]} appears {len(pair[side])} times")
            if pair[side] and not pair[other]:
                r, a = pair[side][0]
                problems.append(f"rank {r}: {a} has no matching {counterpart[side]} on rank {a.peer}")
    return problems
