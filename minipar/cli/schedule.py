"""``minipar schedule``: draw a pipeline schedule and print its bubble, in theory and simulated.

    minipar schedule --schedule 1f1b --stages 4 --microbatches 8
    minipar schedule --schedule interleaved --stages 4 --microbatches 8 --chunks 2 --png il.png
    minipar schedule --schedule zb-h1 --stages 4 --microbatches 8 --json

Costs per stage: F = 1, B = 2 (an input-gradient B of 1 plus a weight-gradient W of 1, split for
zb-h1), a chunk of an interleaved rank 1/v of that, messages free. Peak in-flight counts the
micro-batches whose activations a rank holds at once (per chunk for interleaved).
"""
import json

from minipar.cli.drawing import write_png
from minipar.parallel.pipeline import (BUILDERS, ScheduleError, bubble_fraction, bubble_theory, build,
                                       makespan, peak_inflight, simulate, text_gantt, validate,
                                       write_chrome_trace)


def add_arguments(parser):
    parser.add_argument("--schedule", required=True, choices=list(BUILDERS))
    parser.add_argument("--stages", type=int, required=True, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m per step")
    parser.add_argument("--chunks", type=int, default=None, help="chunks v per rank (interleaved, default 2)")
    parser.add_argument("--remat", action="store_true", help="gpipe: re-compute forwards before backwards")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome-trace JSON (open in Perfetto)")
    parser.add_argument("--png", metavar="FILE", help="write the timeline as a PNG")


def summary(schedule, events):
    """The figures the command prints, also the keys of ``--json``."""
    p = schedule.ranks
    _, num, den = bubble_theory(schedule)
    return {"schedule": schedule.name, "stages": p, "microbatches": schedule.microbatches,
            "chunks": schedule.chunks,
            "bubble_theory": num / den,
            "bubble_simulated": bubble_fraction(events, p),
            "makespan": makespan(events),
            "peak_inflight": peak_inflight(events, p)}


def run(args):
    try:
        schedule = validate(build(args.schedule, args.stages, args.microbatches, args.chunks, args.remat))
    except (ValueError, ScheduleError) as err:
        print(f"minipar schedule: {err}")
        return 2
    events = simulate(schedule)
    figures = summary(schedule, events)
    if args.trace:
        write_chrome_trace(events, args.trace, schedule.ranks)
    if args.png:
        write_png(events, args.png, schedule.ranks)
    if args.json:
        print(json.dumps(figures))
        return 0
    formula, num, den = bubble_theory(schedule)
    print(f"{schedule.name}: p={schedule.ranks} ranks, m={schedule.microbatches} micro-batches"
          + (f", v={schedule.chunks} chunks" if schedule.chunks > 1 else "")
          + (", re-materialised" if schedule.remat else ""))
    print(text_gantt(events, schedule.ranks))
    print(f"bubble: theory {formula} = {num}/{den} = {num / den:.4f}, "
          f"simulated {figures['bubble_simulated']:.4f}")
    what = "micro-batches" if schedule.chunks == 1 else f"micro-batch chunks (each 1/{schedule.chunks})"
    print(f"peak in-flight {what} per rank: " + " ".join(map(str, figures["peak_inflight"])))
    for path in (args.trace, args.png):
        if path:
            print(f"wrote {path}")
    return 0
