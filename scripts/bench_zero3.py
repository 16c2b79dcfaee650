"""ZeRO-3 step time against plain DDP's, and what prefetching the next layer's gather buys.

    python scripts/bench_zero3.py            (2 ranks, about a minute)
    python scripts/bench_zero3.py -n 4 --quick

DDP, ZeRO-3 and ZeRO-3 without prefetch train the same MLP in one launch, taking turns;
printed: each run's ms and bytes sent per step, then ZeRO-3 / DDP (bytes 1.5 by the formula)
and no-prefetch / prefetch. The runs and the formula: docs/benchmarks.md.
"""
import argparse
import os
import sys

SIZES = (512, 1024, 1024, 1024, 10)
RUNS = ("DDP", "ZeRO-3", "ZeRO-3 no pre.")


def worker(batch, steps, rounds):
    """Per run: (median seconds per step of the slowest rank, bytes this rank sent per step)."""
    import numpy as np

    import minipar
    import minipar.nn as nn
    from minipar import comm, optim
    from minipar.comm import fit
    from minipar import functional as F
    from minipar.parallel.data import DistributedDataParallel, ZeRO3

    world = comm.world()
    rng = np.random.default_rng(world.rank)
    x = minipar.tensor(rng.standard_normal((batch, SIZES[0])).astype("float32"))
    y = rng.integers(0, SIZES[-1], batch)

    def build(kind):
        minipar.manual_seed(0)
        layers = []
        for a, b in zip(SIZES, SIZES[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        adamw = lambda ps: optim.AdamW(ps, lr=1e-4)  # noqa: E731
        if kind == "DDP":
            net = DistributedDataParallel(model, world, bucket_cap_mb=2.0, algorithm="ring")
            opt = adamw(model.parameters())
            return net, opt.zero_grad, opt.step
        zero = ZeRO3(model, adamw, world, prefetch=kind == "ZeRO-3")
        return model, zero.zero_grad, zero.step

    def one_step(run):
        net, clear, update = run
        clear()
        F.cross_entropy(net(x), y).backward()
        update()

    runs = {kind: build(kind) for kind in RUNS}
    times, sent = {kind: [] for kind in RUNS}, {}
    for kind in RUNS:
        one_step(runs[kind])  # warm-up
    for _ in range(rounds):
        for kind in RUNS:
            before = world.counters.bytes_sent
            times[kind] += fit.timed(world, lambda: one_step(runs[kind]), steps, warmup=0,
                                     statistic=list)
            sent[kind] = (world.counters.bytes_sent - before) / steps
    return {kind: (float(np.median(times[kind])), sent[kind]) for kind in RUNS}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="steps per run and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds the runs take in turn")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 2 steps")
    args = parser.parse_args()
    steps, rounds = (2, 1) if args.quick else (args.steps, args.rounds)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from minipar.testing import run_on_ranks

    result = run_on_ranks(f"{os.path.abspath(__file__)}:worker", args.n,
                          args=(args.batch, steps, rounds), timeout=600)[0]
    print(f"MLP {'-'.join(map(str, SIZES))}, float32, {args.n} ranks, {args.batch} samples per "
          f"rank, {rounds} x {steps} steps; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'run':16s} {'ms/step':>8s} {'MB sent/step':>13s}")
    for kind in RUNS:
        seconds, nbytes = result[kind]
        print(f"  {kind:16s} {seconds * 1e3:8.1f} {nbytes / 1e6:13.2f}")
    (t_dp, b_dp), (t_z, b_z), (t_np, _) = (result[k] for k in RUNS)
    print(f"ZeRO-3 / DDP: time {t_z / t_dp:.2f}, bytes {b_z / b_dp:.3f} (formula 1.5)")
    print(f"ZeRO-3 without / with prefetch: time {t_np / t_z:.2f} (above 1: prefetch hides "
          f"gathers)")


if __name__ == "__main__":
    main()
