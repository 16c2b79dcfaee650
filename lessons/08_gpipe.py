"""Lesson 8: GPipe: the bubble against the number of micro-batches, and memory re-materialised.

    mpiexec -n 4 python lessons/08_gpipe.py        (add --quick for a smoke run)

GPipe (Huang et al. 2019) runs all m forwards of a step, then all m backwards, on p stages.
Rank r starts r slots late and finishes r slots early, so with F = 1 and B = 2 per stage each
rank idles (p - 1) of the (m + p - 1) slots of each phase:

    bubble = (p - 1) / (m + p - 1)        -> 0 as m grows

Part 1 measures it from the runtime's own trace: the stages do almost nothing and every action
is padded to a fixed duration by a waiting kernel (minipar/parallel/pipeline/measure.py), so
four ranks run side by side on two cores and what is measured is the schedule.

The price of a large m is memory: every stage keeps the activations of all m micro-batches until
their backwards come. Re-materialisation (Chen et al. 2016; GPipe's choice) keeps only each
stage's input and re-computes the forward just before the backward (the R actions): peak
memory falls from m micro-batches' activations to m inputs plus one micro-batch's activations,
for one more forward per micro-batch. Part 2 measures it on GPT blocks with ActivationMemory.

Read next: minipar/parallel/pipeline/schedules.py, simulate.py, then runtime.py; proved by
tests/test_pipeline_runtime_bubble.py.
"""
import os

os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")  # a waiting rank sleeps, not spins

import numpy as np  # noqa: E402

import minipar  # noqa: E402
from minipar import nn  # noqa: E402
from minipar.console import terminal_width  # noqa: E402
from minipar.parallel.pipeline import Pipeline, bubble_theory, build, text_gantt  # noqa: E402
from minipar.parallel.pipeline.measure import measure_bubble  # noqa: E402

from _kit import (BUBBLE_BAND, arguments, bubble_with_messages, check, check_bubble,  # noqa: E402
                  figure, finish, mpi_world, note_load, say)

args = arguments(__doc__, ("--unit", 0.01, "seconds per stage forward"),
                 quick="short units, fewer settings", plot=True)
world = mpi_world(__doc__, at_least=2)
rank, p = world.rank, world.size
# each measured bubble is checked against theory plus what this run's messages cost, within
# _kit.BUBBLE_BAND of it (the band's measurements and reason are there)


def part1_bubble(unit, ms, repeats):
    """Measure the bubble for each m; on rank 0 returns the figures' data: the points
    (label, m, measured, theory) and the measured events of m = 4."""
    say(f"Part 1. GPipe's bubble on p = {p} ranks, measured from traces (unit {unit * 1e3:g} ms)",
        f"{'m':>4}{'theory (p-1)/(m+p-1)':>24}{'+ messages':>12}{'measured':>10}")
    points, shown = [], None
    for m in ms:
        schedule = build("gpipe", p, m)
        measured = measure_bubble(world, schedule, unit, repeats)
        if rank == 0:
            formula, num, den = bubble_theory(schedule)
            expected, _ = bubble_with_messages(schedule, measured[1], unit)
            say(f"{m:>4}{f'{num}/{den} = {num / den:.3f}':>24}{expected:>12.3f}"
                f"{measured[0]:>10.3f}")
            check_bubble(f"m = {m}", measured[0], num / den, expected)
            points.append(("GPipe", m, measured[0], num / den))
            if m == 4:
                shown = (measured[1], f"{formula.split(' if')[0]} = {num}/{den}", num / den)
    if rank == 0:  # the theory's line also through the powers of 2 that were not measured
        for k in (k for k in (1, 2, 4, 8, 16) if k <= max(ms) and k not in ms):
            _, num, den = bubble_theory(build("gpipe", p, k))
            points.append(("GPipe", k, None, num / den))
    say("+ messages: the schedule replayed (simulate.py) with F = 1, B = 2 and each message at "
        "this run's mean costs\n(a send, a receive, a sleeping receiver's wake-up): what the "
        "textbook leaves out.",
        "\nThe measured timeline of m = 4, one column per unit:",
        text_gantt(shown[0], p, unit=unit, width=terminal_width(), legend=True)
        if rank == 0 else "")
    return points, shown


def gpt_blocks(width, n_blocks, dropout):
    minipar.manual_seed(0)
    return nn.Sequential(*[nn.Block(width, n_head=4, dropout=dropout) for _ in range(n_blocks)])


def part2_memory(m, shape):
    batch, seq, width = shape
    x = np.random.default_rng(0).standard_normal((batch, seq, width)).astype("float32")
    loss = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    say(f"\nPart 2. Memory: {2 * p} GPT blocks (width {width}, dropout 0.1), 2 per rank, "
        f"m = {m} micro-batches of {batch // m} x {seq} tokens")

    def run(schedule, data):
        pipe = Pipeline(gpt_blocks(width, 2 * p, 0.1), schedule, world, loss, memory=True)
        pipe.step(data, data)
        return world.gather_object(pipe.stats), [q.grad.copy() for q in pipe.parameters()]

    one, _ = run(build("gpipe", p, 1), x[: batch // m])  # a: one micro-batch alone
    plain, plain_grads = run(build("gpipe", p, m), x)
    remat, remat_grads = run(build("gpipe", p, m, remat=True), x)
    diff = max(world.all_gather_object(max(float(abs(a - b).max())
                                           for a, b in zip(plain_grads, remat_grads))))
    kept = m * x[: batch // m].nbytes / 1e6
    say(f"{'':4}{'plain GPipe':^28}{'re-materialised':^28}",
        f"{'rank':>4}{'live mb':>9}{'peak MB':>9}{'m x a':>10}{'live mb':>9}{'peak MB':>9}"
        f"{'a':>10}")
    for r in range(p if rank == 0 else 0):
        a = one[r]["peak_bytes"] / 1e6
        check(f"rank {r}: plain GPipe holds m = {m} micro-batches, re-materialised 1",
              (plain[r]["peak_live"], remat[r]["peak_live"]) == (m, 1), (m, 1),
              (plain[r]["peak_live"], remat[r]["peak_live"]))
        check(f"rank {r}: plain peak = m × a within 10 %",
              abs(plain[r]["peak_bytes"] / 1e6 - m * a) <= 0.1 * m * a, f"{m * a:.2f} MB",
              f"{plain[r]['peak_bytes'] / 1e6:.2f} MB")
        say(f"{r:>4}{plain[r]['peak_live']:>9}{plain[r]['peak_bytes'] / 1e6:>9.2f}{m * a:>10.2f}"
            f"{remat[r]['peak_live']:>9}{remat[r]['peak_bytes'] / 1e6:>9.2f}{a:>10.2f}")
    say(f"\na = one micro-batch's activations, measured alone (ActivationMemory: bytes held for "
        f"backward).\nRe-materialised, a stage also keeps its m inputs ({kept:.2f} MB on ranks "
        f"1..{p - 1}; leaves, so not in the count)\nand pays one more forward per micro-batch (R). "
        f"The gradients are the plain run's (max |diff| = {diff:.1e}):\nR replays the forward's "
        f"dropout masks.")
    return diff


def main():
    note_load()
    if args.quick:
        points, shown = part1_bubble(0.006, (1, 4), 2)  # long units, the least disturbed of 2
        diff = part2_memory(4, (8, 8, 32))
    else:
        points, shown = part1_bubble(args.unit, (1, 2, 4, 8, 16), 2)
        diff = part2_memory(8, (16, 32, 64))
    if rank == 0:
        events, formula, theory = shown
        figure(args.plot, "08_schedule", lambda figures: figures.schedule_chart(
            events, p, title=f"GPipe on {p} ranks, m = 4, measured", theory=(formula, theory),
            time_unit="ms"))
        figure(args.plot, "08_bubble", lambda figures: figures.bubble_chart(
            points, title=f"GPipe's bubble on {p} ranks against micro-batches m: measured "
                          f"beside (p-1)/(m+p-1)"))
    check("re-materialised GPipe gives the plain run's gradients bit for bit", diff == 0.0,
          0.0, f"{diff:.1e}")
    return finish(f"GPipe's bubble is (p-1)/(m+p-1) plus its messages within {BUBBLE_BAND:.0%}; "
                  f"re-materialising keeps one micro-batch and the same gradients")


if __name__ == "__main__":
    raise SystemExit(main())
