"""Lesson 9: 1F1B, interleaved stages, zero bubble and PipeDream: less memory, smaller bubbles.

    mpiexec -n 4 python lessons/09_1f1b_interleaved.py        (add --quick for a smoke run)

1F1B (PipeDream-Flush, Narayanan et al. 2021) runs the same F and B as GPipe in another order:
rank r does p - 1 - r forwards, then alternates one forward and one backward. A backward frees
its micro-batch's activations as early as possible, so rank r holds at most p - r micro-batches
instead of m, with GPipe's bubble (p - 1)/(m + p - 1). Part 1 measures both from the runtime's
counters.

Part 2 measures bubbles from real traces (the waiting kernel of measure.py): interleaving v
model chunks per rank (stages r, r + p, ...) shrinks the fill and drain v times,
(p - 1)/(v m + p - 1); ZB-H1 (Qi et al. 2023) splits the backward into B (input gradient, on
the critical path) and W (weight gradient, which nothing waits for) and fills the drain with
W's: (p - 1)/(3 m + p - 1) when F = B = W. DualPipeV (DeepSeek-V3's DualPipe folded onto p
ranks in ZB-V's V; torch's ScheduleDualPipeV) pairs the forward of one micro-batch with the
backward of another (an F&B) and defers W's as zero bubble does; it needs m >= 2p, so it is
measured at m = 2p where the lesson's m is fewer (up to p = 4; p = 8 would need m = 16 and
skips it), beside ZB-H1's equal bubble.

Part 3: PipeDream (Narayanan et al. 2019) drops the flush: every stage updates its weights after
each backward. Weight stashing makes a micro-batch's backward use the weights its forward used,
but stage r runs p - 1 - r versions behind the last stage: the staleness printed per micro-batch.

Read next: minipar/parallel/pipeline/schedules.py, zero_bubble.py, dualpipe.py, runtime.py, then
pipedream.py; proved by tests/test_pipeline_schedules.py, tests/test_pipeline_zb.py and
tests/test_pipeline_dualpipev.py.
"""
import dataclasses
import os

os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")  # a waiting rank sleeps, not spins

import numpy as np  # noqa: E402

import minipar  # noqa: E402
from minipar import nn, optim  # noqa: E402
from minipar.console import terminal_width  # noqa: E402
from minipar.parallel.pipeline import Pipeline, bubble_theory, build, text_gantt  # noqa: E402
from minipar.parallel.pipeline.measure import measure_bubble  # noqa: E402
from minipar.parallel.pipeline.actions import weight_versions  # noqa: E402

from _kit import (BUBBLE_BAND, arguments, bubble_with_messages, check, check_bubble,  # noqa: E402
                  figure, finish, mpi_world, note_load, progress, say)

args = arguments(__doc__, ("--unit", 0.02, "seconds per stage forward"),
                 quick="short units, a smaller model", plot=True)
world = mpi_world(__doc__, ranks=(2, 4) if args.quick else (2, 4, 8))  # p divides m = 4 or 8
rank, p = world.rank, world.size
# each measured bubble is checked against theory plus what this run's messages cost, within
# _kit.BUBBLE_BAND of it (the band's measurements and reason are there)
GAP = 0.1  # interleaved below 1F1B is asserted where theory separates them by this much (p >= 4)
DUAL_M = 8  # dualpipev runs at m = max(m, 2p) up to this many micro-batches: p <= 4, short runs


def mse(out, target):
    return ((out - target) ** 2).mean()


def model(width, n_blocks):
    minipar.manual_seed(0)
    return nn.Sequential(*[nn.Block(width, n_head=4) for _ in range(n_blocks)])


def part1_memory(m, shape):
    batch, seq, width = shape
    x = np.random.default_rng(0).standard_normal((batch, seq, width)).astype("float32")
    say(f"Part 1. Activation memory per rank: {p} stages of 2 GPT blocks (width {width}), "
        f"m = {m} micro-batches")
    stats = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        pipe = Pipeline(model(width, 2 * p), build(name, p, m), world, mse, memory=True)
        pipe.step(x, x)
        stats[name] = world.gather_object(pipe.stats)
    say(f"{'rank':>4}{'GPipe live':>12}{'MB':>7}{'1F1B live':>11}{'MB':>7}{'theory p-r':>12}"
        f"{'ZB-H1 live':>12}{'MB':>7}")
    for r in range(p if rank == 0 else 0):
        g, o, z = (stats[name][r] for name in ("gpipe", "1f1b", "zb-h1"))
        check(f"rank {r}: GPipe holds m = {m} micro-batches, 1F1B p - r = {p - r}",
              (g["peak_live"], o["peak_live"]) == (m, p - r), (m, p - r),
              (g["peak_live"], o["peak_live"]))
        say(f"{r:>4}{g['peak_live']:>12}{g['peak_bytes'] / 1e6:>7.2f}{o['peak_live']:>11}"
            f"{o['peak_bytes'] / 1e6:>7.2f}{p - r:>12}{z['peak_live']:>12}"
            f"{z['peak_bytes'] / 1e6:>7.2f}")
        if r:  # rank 0 runs its W's at once; later ranks hold W's inputs r backwards longer
            check(f"rank {r}: ZB-H1 holds fewer bytes than GPipe (B frees all W does not need)",
                  z["peak_bytes"] < g["peak_bytes"], f"< {g['peak_bytes'] / 1e6:.2f} MB",
                  f"{z['peak_bytes'] / 1e6:.2f} MB")
    say("GPipe holds all m micro-batches on every rank; 1F1B p - r on rank r. ZB-H1 counts the "
        "same live micro-batches;\nbetween a B and its W it keeps only what W needs (each "
        "weight's layer input and output gradient),\nso a few more bytes than 1F1B, as rank r "
        "runs its W's r backwards late.")


SCHEDULES = (("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None))


def as_run(schedule):
    """The schedule with each DualPipeV F&B pair written as its two parts, F then B: the
    actions one per trace event, as the runtime runs and traces them (the replay is the same)."""
    return dataclasses.replace(schedule, actions=[[q for a in actions for q in a.parts]
                                                  for actions in schedule.actions])


def part2_bubbles(unit, m, repeats):
    """Measure each schedule's bubble at m; on rank 0 returns the figures' data: the points
    (label, m, measured, theory) and each schedule's measured events with its theory."""
    say(f"\nPart 2. Bubbles on p = {p} ranks, m = {m}, measured from traces (unit "
        f"{unit * 1e3:g} ms per stage forward, F = 1, B = 2 or B = W = 1)",
        f"{'schedule':<18}{'formula':<22}{'theory':>12}{'+ messages':>12}{'measured':>10}")
    runs, points, bubbles, theory, costs = {}, [], {}, {}, {}
    for name, v in SCHEDULES:
        schedule = build(name, p, m, v)
        measured = measure_bubble(world, schedule, unit, repeats)
        if rank == 0:
            formula, num, den = bubble_theory(schedule)
            label = name + (f" v={v}" if v else "")
            expected, costs[label] = bubble_with_messages(schedule, measured[1], unit)
            say(f"{label:<18}{formula.split(' if')[0]:<22}{f'{num}/{den} = {num / den:.3f}':>12}"
                f"{expected:>12.3f}{measured[0]:>10.3f}")
            runs[label] = (measured[1], f"{formula.split(' if')[0]} = {num}/{den}", num / den,
                           v, m)
            points.append((label, m, measured[0], num / den))
            bubbles[name], theory[name] = measured[0], num / den
            check_bubble(label, measured[0], num / den, expected)
    points += part2_dualpipev(unit, m, repeats, runs, costs)
    if rank == 0:
        send, ready, wake = (max(c[i] for c in costs.values()) for i in range(3))
        say(f"+ messages: the schedule replayed (simulate.py) with the textbook's F, B, W and "
            f"each message at this run's mean\ncosts: a send up to {send * 1e3:.2f} ms, a "
            f"receive whose data had come {ready * 1e3:.2f} ms, a sleeping receiver's wake-up "
            f"{wake * 1e3:.2f} ms.\nEach extra half-stage chunk adds messages: interleaving "
            f"and DualPipeV's V pay the most of them.")
    if rank == 0 and theory["1f1b"] - theory["interleaved"] >= GAP:
        check("the interleaved bubble (v = 2) is below 1F1B's, measured",
              bubbles["interleaved"] < bubbles["1f1b"], f"< {bubbles['1f1b']:.3f}",
              f"{bubbles['interleaved']:.3f}")

    def gantt(label):
        events, _, _, v, _ = runs[label]
        return text_gantt(events, p, unit=unit / (v or 1), width=terminal_width(), legend=True)
    say("\nmeasured interleaved v=2 (each chunk half a stage's cost):",
        gantt("interleaved v=2") if rank == 0 else "",
        "\nmeasured zb-h1 (W: weight gradients, run late on later ranks to fill the drain):",
        gantt("zb-h1") if rank == 0 else "")
    dualpipev_gantt(gantt, m)
    return points, runs


def dualpipev_gantt(gantt, m):
    """The measured DualPipeV timeline and what its pairs are, where it ran (p <= DUAL_M / 2)."""
    if 2 * p > DUAL_M:
        return
    say(f"\nmeasured dualpipev, m = {max(m, 2 * p)} (an F&B pair: a forward, then at once "
        f"another micro-batch's BW, whole backward):", gantt("dualpipev") if rank == 0 else "",
        "DualPipeV pairs the forward of one micro-batch with the backward of another (F&B, run "
        "here as its F then its B) and\ndefers W's as zero bubble does. A pair costing its two "
        "halves, every rank idles p - 1 stage passes, ZB-H1's\n(p-1)/(3m+p-1): what a pair buys "
        "is one half's messages hidden under the other's compute, which these\nunit costs do "
        "not model.")


def part2_dualpipev(unit, m, repeats, runs, costs):
    """DualPipeV's row of the table, at m or, below its m >= 2p, at m = 2p (skipped where that
    is above DUAL_M); on rank 0 returns its point and adds its measured run to ``runs`` and its
    message costs to ``costs``."""
    k = max(m, 2 * p)
    if k > DUAL_M:
        say(f"{'dualpipev':<18}skipped: it needs m >= 2p = {k} micro-batches (torch's rule), "
            f"this lesson runs m <= {DUAL_M}")
        return []
    schedule = build("dualpipev", p, k)
    measured = measure_bubble(world, schedule, unit, repeats)
    if rank != 0:
        return []
    formula, num, den = bubble_theory(schedule)
    expected, costs["dualpipev"] = bubble_with_messages(as_run(schedule), measured[1], unit)
    label = "dualpipev" + (f" m={k}" if k != m else "")
    say(f"{label:<18}{formula:<22}{f'{num}/{den} = {num / den:.3f}':>12}{expected:>12.3f}"
        f"{measured[0]:>10.3f}")
    if k != m:
        say(f"  (dualpipev needs m >= 2p = {k} micro-batches, torch's rule: measured at m = {k}, "
            f"not this run's m = {m})")
    runs["dualpipev"] = (measured[1], f"{formula} = {num}/{den}", num / den, 2, k)
    check_bubble("dualpipev", measured[0], num / den, expected)
    _, zb_num, zb_den = bubble_theory(build("zb-h1", p, k))
    check(f"dualpipev's bubble on these unit costs is ZB-H1's at m = {k}",
          num * zb_den == zb_num * den, f"{zb_num}/{zb_den}", f"{num}/{den}")
    return [("dualpipev", k, measured[0], num / den)]


def bubbles_against_m(unit, m, repeats):
    """With --plot: every schedule's bubble also at m/2 and 2m (multiples of p), for the
    figure of bubble against m. Rank 0 gets the points."""
    points = []
    others = [k for k in (m // 2, 2 * m) if k >= p and k % p == 0]
    for k, (name, v) in progress([(k, s) for k in others for s in SCHEDULES], "bubble against m"):
        schedule = build(name, p, k, v)
        measured = measure_bubble(world, schedule, unit, repeats)
        if rank == 0:
            _, num, den = bubble_theory(schedule)
            points.append((name + (f" v={v}" if v else ""), k, measured[0], num / den))
    return points


def part3_pipedream(m, width):
    say(f"\nPart 3. PipeDream on p = {p} ranks, m = {m}: the weight version each micro-batch's F "
        f"and B used, per stage")
    x = np.random.default_rng(1).standard_normal((2 * m, width))
    minipar.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(p)]).double()
    pipe = Pipeline(layers, build("pipedream", p, m), world, mse,
                    optimizer=lambda ps: optim.SGD(ps, lr=0.01))
    pipe.step(x, x)
    parts = world.gather_object(pipe.versions_used) or []
    used = {key: versions for part in parts for key, versions in part.items()}
    say("  mb " + "".join(f"{f'stage {s} F/B':>14}" for s in range(p)) + f"{'staleness':>22}")
    for k in range(m if rank == 0 else 0):
        cells = "".join(f"{'v%d/v%d' % used[(s, k)]:>14}" for s in range(p))
        stale = [used[(p - 1, k)][0] - used[(s, k)][0] for s in range(p)]
        say(f"{k:>4} {cells}{str(stale):>22}")
    if rank == 0:
        check("PipeDream: the runtime's weight versions are the schedule's", used ==
              weight_versions(build("pipedream", p, m)), "weight_versions(schedule)",
              "other versions")
    say("F and B of a micro-batch use the same stashed version; stage r lags the last stage by "
        "up to p - 1 - r updates.")


def main():
    note_load()
    if args.quick:
        m, unit, repeats = 4, 0.01, 4  # long units, the least disturbed of 4 steps: robust
        part1_memory(m, (8, 8, 32))
    else:
        m, unit, repeats = 8, args.unit, 2
        part1_memory(m, (16, 32, 64))
    points, runs = part2_bubbles(unit, m, repeats)
    part3_pipedream(m, 4 if args.quick else 8)
    if args.plot:
        points += bubbles_against_m(unit, m, repeats)
    if rank == 0:
        draw_figures(args.plot, points, runs)
    return finish(f"1F1B holds p - r micro-batches; the bubbles are theory plus their messages "
                  f"within {BUBBLE_BAND:.0%}, interleaving's below 1F1B's (p >= 4); PipeDream's "
                  f"versions")


def draw_figures(directory, points, runs):
    for label, (events, formula, theory, _, m) in runs.items():
        figure(directory, f"09_schedule_{label.split()[0]}", lambda figures: figures.schedule_chart(
            events, p, title=f"{label} on {p} ranks, m = {m}, measured",
            theory=(formula, theory), time_unit="ms"))
    figure(directory, "09_bubble", lambda figures: figures.bubble_chart(
        points, title=f"Bubble against micro-batches m on {p} ranks: measured beside theory"))


if __name__ == "__main__":
    raise SystemExit(main())
