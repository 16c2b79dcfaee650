"""Lesson 4: all-reduce seven ways: the steps of each, then time, peak node and total bandwidth.

    mpiexec -n 4 python lessons/04_allreduce.py

All-reduce gives every rank the sum of all ranks' vectors: the gradient step of data parallel
training. minipar.comm writes it by hand over send/recv in seven ways; each is
proved equal to MPI_Allreduce by the tests. Part 1 draws each algorithm's messages for a tiny
vector, from the communicator's trace. Part 2 fills the lecture's comparison table from the
counters: time, peak bandwidth per node (the busiest rank's bytes in and out) and total
bandwidth (bytes sent by all ranks), beside the cost model's formula for the time.
"""
import time

import numpy as np

from minipar.comm import ALGORITHMS, cost, fit

from _kit import arguments, check, finish, mpi_world, say

args = arguments(__doc__, quick="a 256 KiB vector instead of 4 MiB")
world = mpi_world(__doc__, at_least=2)
p, rank = world.size, world.rank
ALGOS = [a for a in ALGORITHMS["all_reduce"] if a not in ("mpi",)]

# ---- Part 1: the steps, drawn from trace events --------------------------------------------
x = np.full(p * 2, rank + 1, np.float32)  # 2 elements per rank: 8 bytes per chunk
say(f"Part 1. The messages of each algorithm, p = {p}, a vector of {x.nbytes} bytes",
    "        (s>k: send to k, r<k: receive from k, x: sendrecv, number = bytes)")
for algo in ALGOS:
    world.trace = []
    world.all_reduce(x, algorithm=algo)
    mine = []
    for _, op, peer, _, _, nbytes in world.trace:
        if op == "sendrecv":
            mine.append(f"x>{peer[0]}<{peer[1]}:{nbytes // 2}")
        else:
            mine.append(f"{'s>' if 'send' in op else 'r<'}{peer}:{nbytes}")
    world.trace = None
    lines = world.mpi.gather(mine) or []
    say(f"\n  {algo}", *(f"    rank {r}: " + " ".join(steps) for r, steps in enumerate(lines)))

# ---- Part 2: the comparison table, measured ------------------------------------------------
n_bytes = (256 << 10) if args.quick else (4 << 20)
x = np.ones(n_bytes // 4, np.float32)
model = fit.fit(world, sizes=(n_bytes // 8, n_bytes // 4, n_bytes // 2, n_bytes),
                 algorithms=ALGOS)  # each algorithm its own alpha (its Python per step)
say(f"\nPart 2. All-reduce of {n_bytes >> 20} MiB on {p} ranks "
    f"(fitted: ring alpha {model.alpha * 1e6:.1f} us; for {n_bytes // p >> 10} KiB messages "
    f"1/beta {1 / model.beta(n_bytes / p) / 1e9:.2f} GB/s, "
    f"1/gamma {1 / model.gamma(n_bytes / p) / 1e9:.2f} GB/s)",
    f"  {'algorithm':18s} {'time ms':>8s} {'model ms':>9s} {'peak node MB':>13s} "
    f"{'total MB':>9s}  (n = {n_bytes / 1e6:.1f} MB)")
exact = {}  # every algorithm's sum of p vectors of ones is p, exactly
optimal = 2 * (p - 1) / p * n_bytes  # bytes a rank must send, at least (Patarasuk & Yuan 2009)
most_sent = {}  # algorithm -> the bytes the busiest sender sent in one all-reduce
for algo in ALGOS + ["mpi"]:
    world.all_reduce(x, algorithm=algo)  # warm up
    times = []
    for _ in range(3):
        world.counters.reset()
        world.barrier()
        t0 = time.perf_counter()
        total_of_ones = world.all_reduce(x, algorithm=algo)
        times.append(world.mpi.allreduce(time.perf_counter() - t0, op=max))
        exact[algo] = exact.get(algo, True) and bool((total_of_ones == p).all())
    seconds = sorted(times)[1]  # the median of 3 (of the slowest rank)
    c = world.counters.snapshot()
    peak = world.mpi.allreduce(c["bytes_sent"] + c["bytes_received"], op=max)
    total = world.mpi.allreduce(c["bytes_sent"])
    predicted = cost.predict("all_reduce", algo, p, n_bytes, model) if algo != "mpi" else None
    model_text = f"{predicted * 1e3:9.1f}" if predicted else f"{'-':>9s}"
    moved = f"{peak / 1e6:13.1f} {total / 1e6:9.1f}" if algo != "mpi" else \
        f"{'(inside MPI)':>13s} {'':9s}"
    say(f"  {algo:18s} {seconds * 1e3:8.1f} {model_text} {moved}")
    most_sent[algo] = world.mpi.allreduce(c["bytes_sent"], op=max)
say("\nRing and recursive halving move 2(p-1)/p n per rank, the least possible; the single",
    "parameter server's link moves 2(p-1) n. Recursive doubling moves n log p but needs only",
    "log p steps: it wins for small vectors, where alpha dominates.")
for algo in ALGOS + ["mpi"]:
    check(f"{algo}: every element is the exact sum {p}", exact[algo], p, "another value")
for algo in ("ring", "recursive_halving"):
    if algo in most_sent and (algo == "ring" or p & (p - 1) == 0):  # halving: a power of 2
        check(f"{algo}: each rank sent 2(p-1)/p·n = {optimal:,.0f} B (counters, within 1 %)",
              abs(most_sent[algo] - optimal) <= 0.01 * optimal, f"{optimal:,.0f} B",
              f"{most_sent[algo]:,} B")
raise SystemExit(finish(f"all {len(ALGOS)} hand-written all-reduces returned MPI's exact sum, "
                        f"ring{' and halving' if p & (p - 1) == 0 else ''} at the optimal bytes"))
