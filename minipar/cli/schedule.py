"""``minipar schedule``: draw a pipeline schedule and print its bubble, in theory and simulated.

    minipar schedule --schedule 1f1b --stages 4 --microbatches 8
    minipar schedule --schedule interleaved --stages 4 --microbatches 8 --chunks 2 --png il.png
    minipar schedule --schedule zb-h1 --stages 4 --microbatches 8 --json
    minipar schedule --schedule zb-v --stages 4 --microbatches 8 --png zbv.png
    minipar schedule --schedule dualpipev --stages 4 --microbatches 8 --png dualpipev.png

Costs per action: ``simulate.unit_cost`` (F = 1, B + W = 2 per stage, 1/v per chunk; an F&B
pair, DualPipeV's forward run with another micro-batch's backward, costs its two halves). Peak
in-flight counts the micro-batches whose activations a rank holds at once (per chunk when ranks
hold several). The rules of the arguments are ``build()``'s (schedules.py); this command names
the option that breaks one, and adds its own size limits.
"""
import errno
import json
import os
import sys
import textwrap

from minipar.cli.args import UsageError, positive_int
from minipar.console import terminal_width
from minipar.figures import FiguresUnavailable
from minipar.parallel.pipeline import (BUILDERS, ScheduleError, bubble_fraction, bubble_theory, build,
                                       makespan, peak_inflight, simulate, text_gantt, validate,
                                       write_chrome_trace)
from minipar.parallel.pipeline.actions import FB
from minipar.parallel.pipeline.schedules import ArgumentError, check_arguments, chunks_of
from minipar.parallel.pipeline.timeline import span, work_events

# The work is bounded by what it costs: stages × micro-batches × chunks forward steps, each with
# its backward and messages, built, validated and simulated in a few seconds up to 65536 (64 × 512
# with two chunks: the 64-stage pipeline of Megatron-LM's trillion-parameter run). The charts keep
# one readable row per rank up to 64 stages. The text chart is one cell per rank and time step: a
# longer one (naive at 64 × 512: 64 × 98304) is left out, the PNG and the trace still draw it.
MAX_STAGES, MAX_WORK, MAX_CELLS = 64, 65536, 2 ** 18


def add_arguments(parser):
    parser.description = (f"{parser.description}. At most {MAX_STAGES} stages and stages × "
                          f"micro-batches × chunks = {MAX_WORK}.")
    parser.add_argument("--schedule", required=True, choices=list(BUILDERS))
    parser.add_argument("--stages", type=positive_int, required=True,
                        help=f"pipeline ranks p (at most {MAX_STAGES})")
    parser.add_argument("--microbatches", type=positive_int, required=True,
                        help="micro-batches m per step")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="chunks v per rank (interleaved, zb-interleaved: default 2; zb-v, "
                             "dualpipev: 2)")
    parser.add_argument("--remat", action="store_true", help="gpipe: re-compute forwards before backwards")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome-trace JSON (open in Perfetto)")
    parser.add_argument("--png", metavar="FILE",
                        help="draw the labelled schedule chart as a PNG (needs minipar[plot])")


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


def check(args):
    """``build()``'s rules and this command's limits, each named by the argument that breaks it."""
    p, m, v = args.stages, args.microbatches, args.chunks
    try:
        check_arguments(args.schedule, p, m, v, args.remat)
    except ArgumentError as err:
        raise usage_error(err, args) from None
    if p > MAX_STAGES:
        raise UsageError(f"argument --stages: {p} stages is above this command's limit of "
                         f"{MAX_STAGES}")
    v = chunks_of(args.schedule, v)
    if p * m * v > MAX_WORK:
        raise UsageError(f"argument --microbatches: stages × micro-batches × chunks = {p} × {m} × "
                         f"{v} = {p * m * v} is above this command's limit of {MAX_WORK}")


def usage_error(err, args):
    """A rule ``build()`` refuses, worded with this command's options and their values."""
    option, given = {
        "zb-v chunks": ("--chunks", f"got --chunks {args.chunks}"),
        "dualpipev chunks": ("--chunks", f"got --chunks {args.chunks}"),
        "dualpipev micro-batches": ("--microbatches", f"got --microbatches {args.microbatches} "
                                    f"with --stages {args.stages}: try {2 * args.stages}"),
        "chunks": ("--chunks", f"got --chunks {args.chunks} with --schedule {args.schedule}"),
        "remat": ("--remat", f"got --schedule {args.schedule}"),
        "groups": ("--microbatches", f"try m={-(-args.microbatches // args.stages) * args.stages}"),
    }[err.name]
    return UsageError(f"argument {option}: {err.rule} ({given})")


def describe(schedule):
    """``1f1b: p=4 ranks, m=8 micro-batches``: the first line of the output and the chart's title."""
    return (f"{schedule.name}: p={schedule.ranks} ranks, m={schedule.microbatches} micro-batches"
            + (f", v={schedule.chunks} chunks" if schedule.chunks > 1 else "")
            + (", re-materialised" if schedule.remat else ""))


def chart_columns(events):
    """The text chart's time steps: its span in units of the shortest action, as text_gantt draws."""
    t0, t1 = span(events)
    return max(1, round((t1 - t0) / min(e.duration for e in work_events(events))))


def write_png(schedule, events, path):
    """The schedule chart, the simulated bubble beside the theory's in its title."""
    from minipar.figures import require, save, schedule_chart
    if not os.path.isdir(os.path.dirname(path) or "."):  # a bad path fails at once, not after
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)  # matplotlib loads
    require()  # without matplotlib, say so before touching the file
    open(path, "wb").close()  # nor after the drawing
    from minipar.figures.pipeline import pair_spans
    formula, num, den = bubble_theory(schedule)
    save(schedule_chart(events, schedule.ranks, title=describe(schedule),
                        theory=(formula, num / den), pairs=pair_spans(schedule, events)), path)


def pairs_line(schedule):
    """DualPipeV's F&B pairs, for the text chart (where a pair is its F's cells, then its B's):
    how many each rank runs and rank 0's first; None for a schedule without pairs."""
    per_rank = [[a for a in acts if a.kind == FB] for acts in schedule.actions]
    if not any(per_rank):
        return None
    rank, first = next((r, acts[0]) for r, acts in enumerate(per_rank) if acts)
    f, b = (_cell(part, schedule.chunks > 1) for part in first.pair)
    return (f"F&B pairs, a forward run with another micro-batch's backward (each half its own "
            f"cells, the F first; rank {rank}'s first: {f} {b}), per rank: "
            + " ".join(str(len(acts)) for acts in per_rank))


def _cell(action, chunked):
    """An action as the text chart names its cells: ``F3``, ``BW1b`` (chunk 1)."""
    return f"{action.kind}{action.mb}" + (chr(ord("a") + action.chunk) if chunked else "")


def run(args):
    check(args)
    try:
        schedule = validate(build(args.schedule, args.stages, args.microbatches, args.chunks, args.remat))
    except (ValueError, ScheduleError) as err:  # a builder's own rule (zb-interleaved's rounds)
        raise UsageError(str(err)) from None
    events = simulate(schedule)
    figures = summary(schedule, events)
    written, missing = [], None
    # --png needs matplotlib (the plot extra): without it the command still prints everything
    # else, then one line on standard error naming the extra, and exits with status 1
    outputs = (("--trace", args.trace, lambda path: write_chrome_trace(events, path, schedule.ranks)),
               ("--png", args.png, lambda path: write_png(schedule, events, path)))
    for option, path, write in outputs:
        try:
            if path:
                write(path)
                written.append(path)
        except FiguresUnavailable as err:
            missing = f"minipar schedule: {option} {path} not written: {err}"
        except OSError as err:
            raise UsageError(f"argument {option}: cannot write {path}: {err.strerror}") from None
    if args.json:
        print(json.dumps(figures))
    else:
        formula, num, den = bubble_theory(schedule)
        print(describe(schedule))
        cells = schedule.ranks * chart_columns(events)
        if cells <= MAX_CELLS:
            print(text_gantt(events, schedule.ranks, width=terminal_width(), legend=True))
        else:
            steps = cells // schedule.ranks
            print(f"(the text chart, {schedule.ranks} ranks × {steps} time steps, is left out: "
                  f"--png or --trace draws it)")
        pairs = pairs_line(schedule)
        if pairs:
            print(textwrap.fill(pairs, terminal_width(), subsequent_indent="  "))
        print(textwrap.fill(f"bubble: theory {formula} = {num}/{den} = {num / den:.4f}, "
                            f"simulated {figures['bubble_simulated']:.4f}",
                            terminal_width(), subsequent_indent="  "))
        what = "micro-batches" if schedule.chunks == 1 else f"micro-batch chunks (each 1/{schedule.chunks})"
        print(f"peak in-flight {what} per rank: " + " ".join(map(str, figures["peak_inflight"])))
        for path in written:
            print(f"wrote {path}")
    if missing:  # everything else is out; the picture asked for is not
        sys.stdout.flush()
        print(missing, file=sys.stderr)
        return 1
    return 0
