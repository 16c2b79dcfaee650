"""Pipeline parallelism: schedules as data, validated, simulated and run; the partitioner.

    actions.py       what a schedule is: Action, Schedule (stage placement), messages, the contract
    schedules.py     per-rank action lists for naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1, PipeDream
    zero_bubble.py   ZB-V (a V) and interleaved zero bubble; dualpipe.py DualPipeV (a V, F&B pairs)
    theory.py        the textbook bubble of each schedule, a formula of p, m and v
    validate.py      every send has its receive, inputs come first, nothing waits forever
    simulate.py      a schedule and per-action costs -> the timeline (Events)
    partition.py     split a sequential model into stages: by layer names or balanced by cost
    runtime.py       ``Pipeline`` runs the lists for real: a dispatch loop over the action table
    pipedream.py     ``PipeDream``, the runtime with weight stashing: a backward gets its F's weights
    measure.py       a schedule run at a chosen cost per action (the waiting kernel), its bubble
    timeline.py      Event, Tracer, gather_events, bubble_fraction, text_gantt, chrome_trace
The theory of every schedule, and how the pieces fit: docs/pipeline.md.
"""
from .partition import balanced_split, split_after, stage_costs
from .runtime import Pipeline
from .pipedream import PipeDream
from .actions import Action, Schedule, ScheduleError, message_tag
from .schedules import BUILDERS, build
from .simulate import cost_by_stage, simulate, unit_cost
from .theory import bubble_theory
from .timeline import (Event, Tracer, bubble_fraction, bubble_per_rank, chrome_trace, gather_events,
                       makespan, peak_inflight, text_gantt, write_chrome_trace)
from .validate import validate

__all__ = ["Action", "Schedule", "ScheduleError", "BUILDERS", "build", "bubble_theory", "message_tag",
           "validate", "simulate", "unit_cost", "cost_by_stage", "balanced_split", "split_after",
           "stage_costs",
           "Pipeline", "PipeDream", "Event", "Tracer", "gather_events", "makespan", "bubble_fraction",
           "bubble_per_rank", "peak_inflight", "text_gantt", "chrome_trace", "write_chrome_trace"]
