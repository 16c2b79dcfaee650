"""Benchmark: pipeline bubbles measured from real runs, and GPipe's throughput grid.

    python scripts/bench_pipeline.py            (under a minute; --quick for a smoke run)

Part 1: each schedule's bubble, measured from the runtime's own trace, against theory (p = 4,
m = 8); part 2: GPipe's K x M speed-up grid; part 3: the split backward's B and W against the
whole backward. The stages' cost is a waiting kernel (parallel/pipeline/measure.py), so the
timeline is the schedule's whatever the core count: docs/benchmarks.md explains how, and what
``--plot DIR`` draws.
"""
import argparse
import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy loads:
    os.environ.setdefault(_var, "1")  # one BLAS thread, as each rank has (minipar.testing)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUBBLE_SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None),
                    ("zb-v", None), ("zb-interleaved", 2)]
CHART_MS = (4, 8, 16)  # micro-batches measured for the bubble chart (multiples of p = 4)


def measure_schedules(unit, p, ms, repeats, schedules=BUBBLE_SCHEDULES):
    """On p ranks, rank 0: a dict per m and schedule: label, m, formula, fraction ("num/den"),
    theory, bubbles (one per step) and events (the least disturbed step's, as tuples: they
    travel as JSON); [] elsewhere."""
    from minipar import comm
    from minipar.parallel.pipeline import bubble_fraction, bubble_theory, build
    from minipar.parallel.pipeline.measure import timed_steps

    world = comm.world()
    rows = []
    for m in ms:
        for name, v in schedules:
            schedule = build(name, p, m, v)
            runs = timed_steps(world, schedule, unit, repeats)
            if world.rank == 0:
                formula, num, den = bubble_theory(schedule)
                bubbles = [bubble_fraction(events, schedule.ranks) for events in runs]
                best = runs[bubbles.index(min(bubbles))]
                rows.append({"label": name + (f" v={v}" if v else ""), "m": m, "formula": formula,
                             "fraction": f"{num}/{den}", "theory": num / den, "bubbles": bubbles,
                             "events": [(e.rank, e.start, e.end, e.kind, e.mb, e.chunk)
                                        for e in best]})
    return rows


def measure_bubbles(unit, p, m, repeats, schedules=BUBBLE_SCHEDULES):
    """On p ranks: [(label, "num/den", theory, measured)] on rank 0. The measured bubble is
    the smallest of ``repeats`` steps, the least disturbed (see measure.py)."""
    return [(r["label"], r["fraction"], r["theory"], min(r["bubbles"]))
            for r in measure_schedules(unit, p, [m], repeats, schedules)]


def measure_throughput(model_cost, k, ms, repeats):
    """On k ranks: [(M, [measured speed-up over one device, one per step])] on rank 0, GPipe
    schedule."""
    from minipar import comm
    from minipar.parallel.pipeline import build, makespan
    from minipar.parallel.pipeline.measure import timed_steps

    world = comm.world()
    rows = []
    for m in ms:
        runs = timed_steps(world, build("gpipe", k, m), model_cost / k, repeats)
        if world.rank == 0:
            one_device = m * 3 * model_cost  # F + B = 3 forwards' worth per micro-batch
            rows.append((m, [one_device / makespan(r) for r in runs]))
    return rows


def time_backward_passes(width, depth, batch, repeats):
    """Seconds (the fastest of ``repeats``) of one stage's whole backward, its B and W, and the
    old split (B, then W as a second backward with the input switched off), one process."""
    import time

    from minipar import Tensor, backend, manual_seed, nn
    from minipar.graph import WeightPass, run_backward

    manual_seed(0)
    stage = nn.Sequential(*[layer for _ in range(depth)
                            for layer in (nn.Linear(width, width), nn.GELU())])
    xp = backend.xp()
    x, dy = xp.ones((batch, width), dtype="float32"), xp.ones((batch, width), dtype="float32")
    params = stage.parameters()

    def forward():
        for q in params:
            q.grad = None
        inp = Tensor(x, requires_grad=True)
        return inp, stage(inp)

    def timed(fn):
        start = time.perf_counter()
        fn()
        backend.synchronize()
        return time.perf_counter() - start

    def switched(tensors, on):
        for t in tensors:
            t.requires_grad = on

    def whole():
        _, y = forward()
        best["full"].append(timed(lambda: run_backward([y], [dy])))

    def split():
        _, y = forward()
        weights = WeightPass(params)
        best["B"].append(timed(lambda: run_backward([y], [dy], defer=weights)))
        best["W"].append(timed(weights.run))

    def old_split():
        inp, y = forward()
        switched(params, False)
        best["old B"].append(timed(lambda: run_backward([y], [dy], retain_graph=True)))
        switched(params, True)
        switched([inp], False)
        best["old W"].append(timed(lambda: run_backward([y], [dy])))

    best = {"full": [], "B": [], "W": [], "old B": [], "old W": []}
    variants = [whole, split, old_split]
    for i in range(repeats):  # each variant goes first in turn: none gets the warm caches
        for run in variants[i % 3:] + variants[:i % 3]:
            run()
    return {k: min(v) for k, v in best.items()}


def report_backward_passes(width, depth, batch, repeats):
    """Part 3's lines; True when B + W is within 1.1 x the whole backward."""
    t = time_backward_passes(width, depth, batch, repeats)
    ratio = (t["B"] + t["W"]) / t["full"]
    print(f"\nSplit backward, one stage of {depth} x (Linear {width}x{width} + GELU), batch "
          f"{batch}, float32, fastest of {repeats}: ms, and / the whole backward")
    for label, sec in [("whole backward", t["full"]), ("B (input gradients)", t["B"]),
                       ("W (weight gradients only)", t["W"]), ("B + W", t["B"] + t["W"]),
                       ("old split: B", t["old B"]), ("old split: W (a 2nd backward)", t["old W"]),
                       ("old split: B + W", t["old B"] + t["old W"])]:
        print(f"  {label:<32}{sec * 1e3:>9.2f} ms {sec / t['full']:>7.2f}")
    print(f"B + W = {ratio:.2f} x the whole backward (goal <= 1.1): "
          + ("met" if ratio <= 1.1 else "NOT met (a busy machine: run it again on a quiet one)")
          + f"; W / B = {t['W'] / t['B']:.2f}")
    return ratio <= 1.1


def charts(p, m, unit, rows, grid):
    """name -> Figure: the bubble chart of ``rows`` (measure_schedules'), the speed-up chart of
    ``grid`` (K -> M -> speed-ups, the best drawn) and the timeline of the measured 1F1B step
    at ``m``."""
    from minipar import figures
    from minipar.parallel.pipeline import Event, bubble_theory, build

    theory_ms = sorted(set(CHART_MS) | {2 * max(CHART_MS)})  # the theory's curve a little beyond
    points = [(r["label"], r["m"], min(r["bubbles"]), r["theory"]) for r in rows]
    for name, v in BUBBLE_SCHEDULES:
        _, num, den = bubble_theory(build(name, p, theory_ms[-1], v))
        points.append((name + (f" v={v}" if v else ""), theory_ms[-1], None, num / den))
    one = next(r for r in rows if r["label"] == "1f1b" and r["m"] == m)
    return {
        "pipeline_bubble": figures.bubble_chart(
            points, title=f"pipeline bubble against micro-batches m, p = {p} ranks: measured "
                          f"(best of the steps) beside theory"),
        "pipeline_speedup": figures.speedup_chart(
            {k: {mb: max(s) for mb, s in row.items()} for k, row in grid.items()},
            title="GPipe speed-up over one device, K stages x M micro-batches: measured beside "
                  "K·M/(M+K−1)"),
        "pipeline_1f1b": figures.schedule_chart(
            [Event(*e) for e in one["events"]], n_ranks=p, time_unit="ms",
            title=f"1F1B measured, p = {p}, m = {m}, {unit * 1e3:g} ms per stage forward",
            theory=(one["formula"], one["theory"])),
    }


def draw(directory, *measured):
    """charts(*measured) saved into ``directory``, each path printed; their paths (none without
    matplotlib, which it says in one line)."""
    from minipar import figures

    return figures.write_figures(directory, lambda: charts(*measured))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=float, default=0.04, help="seconds per F of one stage")
    parser.add_argument("--model-cost", type=float, default=0.04,
                        help="seconds per forward of the whole model (the throughput grid)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short units, one step each")
    parser.add_argument("--width", type=int, default=512, help="Part 3: the Linear layers' width")
    parser.add_argument("--plot", metavar="DIR", help="draw the bubble chart, the speed-up grid "
                                                      "and a measured 1F1B step into DIR")
    args = parser.parse_args()
    if args.quick:
        args.unit, args.model_cost, args.repeats, args.width = 0.005, 0.016, 1, 256
    from minipar.console import note_load, progress, spread
    from minipar.testing import run_on_ranks

    note_load()
    me = os.path.abspath(__file__)
    p, m = 4, 8
    measured_ms = sorted(set(CHART_MS) | {m}) if args.plot else [m]
    every = run_on_ranks(f"{me}:measure_schedules", p,
                         args=(args.unit, p, measured_ms, args.repeats),
                         heavy_yield=True, timeout=600)[0]
    rows = [r for r in every if r["m"] == m]
    many = args.repeats > 1  # a spread to show
    print(f"Bubble, p={p} ranks, m={m} micro-batches, measured from the runtime's traces "
          f"(unit {args.unit * 1e3:g} ms per stage forward, best of {args.repeats} steps)")
    print(f"{'schedule':<20}{'theory':>14}{'measured':>10}{'difference':>12}"
          + (f"  {'steps: median [min-max]'}" if many else ""))
    missed = []
    for r in rows:
        label, fraction, theory = r["label"], r["fraction"], r["theory"]
        measured = min(r["bubbles"])
        print(f"{label:<20}{fraction:>6} = {theory:.3f}{measured:>10.3f}"
              f"{100 * (measured - theory):>+10.1f} pt"
              + (f"  {spread(r['bubbles'])}" if many else ""))
        if abs(measured - theory) >= 0.02:
            missed.append(label)
    print("within 2 points of theory: " + ("all" if not missed else f"NOT {', '.join(missed)} "
          "(a busy machine adds message latency: run it again on a quiet one)"))

    ks, ms = (2, 4, 8), (1, 4, 32)
    grid = {k: dict(run_on_ranks(f"{me}:measure_throughput", k,
                                 args=(args.model_cost, k, ms, args.repeats),
                                 heavy_yield=True, timeout=300)[0])
            for k in progress(ks, "GPipe grid, K stages")}
    print(f"\nGPipe speed-up over one device, measured (model K*M/(M+K-1)); model forward "
          f"{args.model_cost * 1e3:g} ms split over K ranks")
    print("K \\ M" + "".join(f"{m:>16}" for m in ms))
    for k in ks:
        print(f"{k:<5}" + "".join(f"{max(grid[k][m]):>9.2f} ({k * m / (m + k - 1):.2f})"
                                  for m in ms))
    if many:
        print(f"over the {args.repeats} steps, median [min-max]:")
        for k in ks:
            print(f"{k:<5}" + "  ".join(f"M={m} {spread(grid[k][m], '{:.2f}')}" for m in ms))
    split_ok = report_backward_passes(args.width, 4, args.width, max(5, args.repeats))
    if args.plot:
        draw(args.plot, p, m, args.unit, every, grid)
    return 1 if missed or not split_ok else 0


if __name__ == "__main__":
    sys.exit(main())
