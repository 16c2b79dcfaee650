"""Expert parallelism's costs: the hand-coded all-to-all-v against MPI's, and the MoE layer.

    mpiexec -n 2 python scripts/bench_expert.py            (about 20 s; works with -n 4)
    mpiexec -n 2 python scripts/bench_expert.py --quick    (a smoke run)

1. ``all_to_all_v`` pairwise against MPI_Alltoallv, balanced and skewed counts.
2. One MoE layer, forward + backward: expert parallel against the serial MoE on the same tokens
   (the ratio is what the all-to-alls add). Details: docs/benchmarks.md.

Timings on a shared machine are noisy: compare the ratios, measured side by side in one run.
"""
import argparse
import os
import statistics

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy loads:
    os.environ.setdefault(_var, "1")  # ranks share the cores; more BLAS threads only fight

import numpy as np  # noqa: E402

import minipar  # noqa: E402
from minipar import Tensor, comm  # noqa: E402
from minipar.comm import fit  # noqa: E402
from minipar.nn.moe import MoE  # noqa: E402
from minipar.parallel.expert import ExpertParallelMoE  # noqa: E402


def rounds_of(world, runs, rounds):
    """{name: median seconds} over rounds in which every run takes its turn, each round's time
    the slowest rank's (all start together)."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(fit.timed(world, fn, 1, warmup=0))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_all_to_all_v(world, rows_list, width, rounds):
    p, r = world.size, world.rank
    say = print if r == 0 else (lambda *a, **k: None)
    say(f"all_to_all_v on {p} ranks, rows of {width} float32 ({width * 4} B); median of {rounds}")
    say(f"{'counts':>9s} {'rows/peer':>9s} {'KiB/rank':>9s} {'pairwise us':>12s} "
        f"{'MPI us':>9s} {'pairwise/MPI':>13s}")
    for rows in rows_list:
        for kind in ("balanced", "skewed"):
            table = np.full((p, p), rows)
            if kind == "skewed":  # rank 0 gets 4 shares, the rest share what is left
                table[:, 0] = min(4 * rows, rows * p)
                table[:, 1:] = max(rows * p - table[0, 0], 0) // max(p - 1, 1)
            send, recv = table[r].tolist(), table[:, r].tolist()
            x = np.random.default_rng(r).standard_normal((sum(send), width)).astype("float32")
            t = rounds_of(world, {a: (lambda a=a: world.all_to_all_v(x, send, recv, algorithm=a,
                                                                      check=False))
                                  for a in ("pairwise", "mpi")}, rounds)
            say(f"{kind:>9s} {rows:9d} {x.nbytes / 1024:9.0f} {t['pairwise'] * 1e6:12.0f} "
                f"{t['mpi'] * 1e6:9.0f} {t['pairwise'] / t['mpi']:13.2f}")


def bench_layer(world, B, T, C, E, rounds):
    minipar.manual_seed(0)
    serial = MoE(C, E, top_k=2, capacity_factor=1.25)
    layer = ExpertParallelMoE.from_serial(serial, world)
    x = np.random.default_rng(world.rank).standard_normal((B, T, C)).astype("float32")

    def step(module):
        return lambda: module(Tensor(x, requires_grad=True)).sum().backward()

    t = rounds_of(world, {"serial": step(serial), "expert parallel": step(layer)}, rounds)
    if world.rank == 0:
        print(f"\nMoE layer, C = {C}, E = {E} experts, top-2, {B * T} tokens per rank, "
              f"forward + backward (median of {rounds}):")
        print(f"  serial MoE, all {E} experts here  {t['serial'] * 1e3:8.2f} ms")
        print(f"  expert parallel, {E // world.size} experts here  "
              f"{t['expert parallel'] * 1e3:8.2f} ms")
        print(f"  expert parallel / serial: {t['expert parallel'] / t['serial']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="numbers per row")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    world = comm.world()
    rounds = 3 if args.quick else args.rounds
    rows = (1, 64) if args.quick else (1, 16, 256, 2048)
    bench_all_to_all_v(world, rows, args.width, rounds)
    B, T, C, E = (2, 8, 32, 2 * world.size) if args.quick else (8, 64, 128, 4 * world.size)
    bench_layer(world, B, T, C, E, rounds)


if __name__ == "__main__":
    main()
