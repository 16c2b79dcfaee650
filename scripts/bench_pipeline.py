"""Benchmark: pipeline bubbles measured from real runs, and GPipe's throughput grid.

    python scripts/bench_pipeline.py            (under a minute; --quick for a smoke run)

Each schedule runs for real: p processes under mpiexec, the pipeline runtime executing its action
lists, activations and gradients sent between ranks. The bubble is measured from the runtime's
own trace (``bubble_fraction``: idle over ranks x makespan), not simulated.

How the stage cost is made. A machine with 2 cores cannot run 4 or 8 busy ranks side by side,
so the stages do almost no arithmetic (one 4x4 Linear per stage) and each action is padded to a
fixed duration by a *waiting kernel* (minipar/parallel/pipeline/measure.py): the runtime's
``delay(action)`` sleeps out the rest of ``unit x unit_cost(action)`` (F = 1, B = 2, or B = W = 1
when split; 1/v per interleaved chunk).
A sleeping rank uses no core, and MPICH's ranks sleep while they wait for a message too
(``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``), so the timeline is the schedule's, whatever the core count.
Messages are tiny, so they cost far less than a unit: the textbook's "messages are free".

Part 1: p = 4, m = 8, bubble theory vs measured for GPipe and 1F1B (3/11), interleaved v = 2
(3/19) and ZB-H1 (3/27), each the least disturbed of a few steps.
Part 2: GPipe (Huang et al. 2019, its normalised-throughput table): K partitions x M micro-batches,
the speed-up over one device running the whole model, measured, beside K*M/(M+K-1). The model's
cost per micro-batch is fixed; each of the K stages gets 1/K of it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUBBLE_SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None)]


def measure_bubbles(unit, p, m, repeats, schedules=BUBBLE_SCHEDULES):
    """On p ranks: [(label, "num/den", theory, measured)] on rank 0. The measured bubble is
    the smallest of ``repeats`` steps, the least disturbed (see measure.py)."""
    from minipar import comm
    from minipar.parallel.pipeline import bubble_theory, build
    from minipar.parallel.pipeline.measure import measure_bubble

    world = comm.world()
    rows = []
    for name, v in schedules:
        schedule = build(name, p, m, v)
        measured = measure_bubble(world, schedule, unit, repeats)
        if world.rank == 0:
            _, num, den = bubble_theory(schedule)
            rows.append((name + (f" v={v}" if v else ""), f"{num}/{den}", num / den, measured[0]))
    return rows


def measure_throughput(model_cost, k, ms, repeats):
    """On k ranks: [(M, measured speed-up over one device)] on rank 0, GPipe schedule."""
    from minipar import comm
    from minipar.parallel.pipeline import build, makespan
    from minipar.parallel.pipeline.measure import timed_steps

    world = comm.world()
    rows = []
    for m in ms:
        runs = timed_steps(world, build("gpipe", k, m), model_cost / k, repeats)
        if world.rank == 0:
            one_device = m * 3 * model_cost  # F + B = 3 forwards' worth per micro-batch
            rows.append((m, one_device / min(makespan(r) for r in runs)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=float, default=0.04, help="seconds per F of one stage")
    parser.add_argument("--model-cost", type=float, default=0.04,
                        help="seconds per forward of the whole model (the throughput grid)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short units, one step each")
    args = parser.parse_args()
    if args.quick:
        args.unit, args.model_cost, args.repeats = 0.005, 0.016, 1
    from minipar.testing import run_on_ranks

    me = os.path.abspath(__file__)
    p, m = 4, 8
    rows = run_on_ranks(f"{me}:measure_bubbles", p, args=(args.unit, p, m, args.repeats),
                        heavy_yield=True, timeout=300)[0]
    print(f"Bubble, p={p} ranks, m={m} micro-batches, measured from the runtime's traces "
          f"(unit {args.unit * 1e3:g} ms per stage forward, best of {args.repeats} steps)")
    print(f"{'schedule':<16}{'theory':>14}{'measured':>10}{'difference':>12}")
    missed = []
    for label, fraction, theory, measured in rows:
        print(f"{label:<16}{fraction:>6} = {theory:.3f}{measured:>10.3f}"
              f"{100 * (measured - theory):>+10.1f} pt")
        if abs(measured - theory) >= 0.02:
            missed.append(label)
    print("within 2 points of theory: " + ("all" if not missed else f"NOT {', '.join(missed)} "
          "(a busy machine adds message latency: run it again on a quiet one)"))

    ks, ms = (2, 4, 8), (1, 4, 32)
    grid = {k: dict(run_on_ranks(f"{me}:measure_throughput", k,
                                 args=(args.model_cost, k, ms, args.repeats),
                                 heavy_yield=True, timeout=300)[0]) for k in ks}
    print(f"\nGPipe speed-up over one device, measured (model K*M/(M+K-1)); model forward "
          f"{args.model_cost * 1e3:g} ms split over K ranks")
    print("K \\ M" + "".join(f"{m:>16}" for m in ms))
    for k in ks:
        print(f"{k:<5}" + "".join(f"{grid[k][m]:>9.2f} ({k * m / (m + k - 1):.2f})" for m in ms))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
