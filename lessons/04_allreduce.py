"""Lesson 4: all-reduce nine ways: the steps of each, then time, peak node and total bandwidth.

    mpiexec -n 4 python lessons/04_allreduce.py

All-reduce gives every rank the sum of all ranks' vectors: the gradient step of data parallel
training. minipar.comm writes it by hand in nine ways, seven over send/recv and two over a
shared-memory window of the node (shm, hierarchical); each is proved equal to MPI_Allreduce by
the tests. Part 1 draws each algorithm's messages for a tiny vector, from the communicator's
trace. Part 2 fills the lecture's comparison table from the counters: time, peak bandwidth per
node (the busiest rank's bytes in and out) and total bandwidth (bytes sent by all ranks), beside
the cost model's formula for the time. Part 3 shows why, on one node, shared memory wins: the
bytes each rank moves through memory and the synchronisations, beside the times.

Read next: minipar/comm/allreduce.py, shm.py, hierarchical.py, cost.py, then fit.py; proved by
tests/test_comm_collectives.py.
"""
import os
import statistics
import textwrap

from minipar import backend
from minipar.bench import busbw
from minipar.comm import ALGORITHMS, cost, fit, shm
from minipar.console import spread, terminal_width

from _kit import arguments, check, figure, finish, mpi_world, note_load, progress, say

args = arguments(__doc__, quick="a 256 KiB vector instead of 4 MiB", plot=True)
world = mpi_world(__doc__, at_least=2)
note_load()
REPEATS = 5  # timed runs of each all-reduce: the median and [min-max] of the slowest rank's
p, rank = world.size, world.rank
xp = backend.xp()  # the vectors live where training would put them: NumPy, or CuPy on a GPU
ALGOS = [a for a in ALGORITHMS["all_reduce"] if a not in ("mpi",)]

# ---- Part 1: the steps, drawn from trace events --------------------------------------------
x = xp.full(p * 2, rank + 1, xp.float32)  # 2 elements per rank: 8 bytes per chunk
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
    mine = mine or ["(no message: the ranks read one another's shared memory)"]
    lines = world.gather_object(mine) or []
    say(f"\n  {algo}", *(f"    rank {r}: " + " ".join(steps) for r, steps in enumerate(lines)))

# ---- Part 2: the comparison table, measured ------------------------------------------------
n_bytes = (256 << 10) if args.quick else (4 << 20)
model = fit.fit(world, sizes=(n_bytes // 8, n_bytes // 4, n_bytes // 2, n_bytes),
                algorithms=ALGOS,  # each algorithm its own alpha (its Python per step)
                progress=lambda steps: progress(steps, "fitting the cost model"))
exact = {}  # every algorithm's sum of p vectors of ones is p, exactly
optimal = 2 * (p - 1) / p * n_bytes  # bytes a rank must send, at least (Patarasuk & Yuan 2009)
most_sent = {}  # algorithm -> the bytes the busiest sender sent in one all-reduce
widest = 1.0  # the largest max/min of one algorithm's runs: how noisy a single timing is
table, rows = [], []  # the lines at n; every size's row for the figure (minipar.bench's keys)
sizes = (n_bytes // 8, n_bytes // 4, n_bytes // 2, n_bytes) if args.plot else (n_bytes,)
for size, algo in progress([(m, a) for m in sizes for a in ALGOS + ["mpi"]], "all-reduces"):
    x = xp.ones(size // 4, xp.float32)
    world.all_reduce(x, algorithm=algo)  # warm up
    sums = []

    def run():
        world.counters.reset()  # the counters below hold one all-reduce's bytes
        sums.append(world.all_reduce(x, algorithm=algo))
    times = [fit.timed(world, run, 1, warmup=0) for _ in range(REPEATS)]  # each the slowest rank's
    exact[algo] = exact.get(algo, True) and all(bool((s == p).all()) for s in sums)
    seconds = statistics.median(times)
    predicted = cost.predict("all_reduce", algo, p, size, model) if algo != "mpi" else None
    rows.append({"bytes": size, "algorithm": algo, "time_us": seconds * 1e6,
                 "busbw_GBps": busbw(size, seconds, p),
                 "model_us": predicted and predicted * 1e6})
    if size != n_bytes:
        continue
    c = world.counters.snapshot()
    peak = max(world.all_gather_object(c["bytes_sent"] + c["bytes_received"]))
    total = sum(world.all_gather_object(c["bytes_sent"]))
    model_text = (f"{predicted * 1e3:9.1f} {seconds / predicted:8.2f}" if predicted
                  else f"{'-':>9s} {'-':>8s}")
    moved = f"{peak / 1e6:13.1f} {total / 1e6:9.1f}" if algo != "mpi" else \
        f"{'(inside MPI)':>13s} {'':9s}"
    table.append(f"  {algo:18s} {spread([t * 1e3 for t in times], '{:.1f}'):>18s} {model_text} "
                 f"{moved}")
    most_sent[algo] = max(world.all_gather_object(c["bytes_sent"]))
    widest = max(widest, max(times) / min(times))
ratios = [r["time_us"] / r["model_us"] for r in rows if r["model_us"] and r["bytes"] == n_bytes]
cores = os.cpu_count() or 1
vector = f"{n_bytes >> 20} MiB" if n_bytes >= 1 << 20 else f"{n_bytes >> 10} KiB"
say(f"\nPart 2. All-reduce of {vector} on {p} ranks "
    f"(fitted: ring alpha {model.alpha * 1e6:.1f} us; for {n_bytes // p >> 10} KiB messages "
    f"1/beta {1 / model.beta(n_bytes / p) / 1e9:.2f} GB/s, "
    f"1/gamma {1 / model.gamma(n_bytes / p) / 1e9:.2f} GB/s)",
    f"  {'algorithm':18s} {'time ms [min-max]':>18s} {'model ms':>9s} {'meas/mod':>8s} "
    f"{'peak node MB':>13s} {'total MB':>9s}  (n = {n_bytes / 1e6:.1f} MB, {REPEATS} runs)",
    *table,
    textwrap.fill(
        f"meas/mod {min(ratios):.2f}-{max(ratios):.2f}, while one algorithm's own {REPEATS} "
        f"runs differ by up to {widest:.1f}x: "
        + (f"{p} ranks share {cores} cores, and " if p > cores else "")
        + "the fitted constants hold for the traffic the fit timed (every rank sending at once, "
          "under that moment's load); ranks that take turns beat them, other work on the "
          "machine slows any run past them.", width=terminal_width()))
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

# ---- Part 3: why shared memory wins on one node ----------------------------------------------
if "shm" in exact and world.local.nodes == 1:
    t = {r["algorithm"]: r["time_us"] / 1e3 for r in rows if r["bytes"] == n_bytes}
    # in place, as DDP reduces its buckets: MPI's own, and shm on a bucket that lives in the
    # window from the start (shm.shared_array, as DDP lays its buckets out): nothing copied in
    private = xp.ones(n_bytes // 4, xp.float32)
    bucket = shm.shared_array(world, n_bytes).view(xp.float32)
    # ms: the median over REPEATS of the slowest rank's time, after one warm-up run
    t["mpi, in place"] = 1e3 * fit.timed(
        world, lambda: world.all_reduce(private, algorithm="mpi", out=private), REPEATS, warmup=1)
    t["shm, bucket"] = 1e3 * fit.timed(
        world, lambda: world.all_reduce(bucket, algorithm="shm", out=bucket), REPEATS, warmup=1)
    bucket[...] = 1
    world.all_reduce(bucket, algorithm="shm", out=bucket)
    exact["shm, bucket"] = bool((bucket == p).all())
    traffic = {"ring": 11 * (p - 1) / p, "shm": shm.traffic(p),  # x n, per rank
               "shm, bucket": shm.traffic(p, bucket=True)}
    syncs = {"ring": f"{2 * (p - 1)} messages, each through MPI's cells",
             "shm": "2 barriers, whatever p", "shm, bucket": "3 barriers, whatever p"}
    reference = {"ring": "mpi", "shm": "mpi", "shm, bucket": "mpi, in place"}
    say(f"\nPart 3. Why shared memory wins on one node ({vector}, {p} ranks)",
        f"  {'algorithm':13s} {'time ms':>8s} {'vs mpi':>6s} {'memory traffic per rank':>24s}"
        f"  synchronisation",
        *(f"  {a:13s} {t[a]:8.2f} {t[a] / t[reference[a]]:6.2f} {traffic[a]:7.2f} n = "
          f"{traffic[a] * n_bytes / 1e6:7.1f} MB  {syncs[a]}" for a in ("ring", "shm")),
        f"  {'mpi':13s} {t['mpi']:8.2f} {1:6.2f}   (inside MPI: its ring or halving through "
        f"the same cells)",
        f"  {'shm, bucket':13s} {t['shm, bucket']:8.2f} "
        f"{t['shm, bucket'] / t['mpi, in place']:6.2f} {traffic['shm, bucket']:7.2f} n = "
        f"{traffic['shm, bucket'] * n_bytes / 1e6:7.1f} MB  {syncs['shm, bucket']}",
        f"  {'mpi, in place':13s} {t['mpi, in place']:8.2f} {1:6.2f}   (the reference of the "
        f"line above)",
        textwrap.fill(
            "Between ranks of one node a message is copied twice: into a shared cell by the "
            "sender, out of it by the receiver, the two taking turns on the cells; per step "
            "of n/p that is 4n/p bytes read and written, plus 3n/p for a reduction, so a ring "
            "moves 11(p-1)/p n. The shm all-reduce maps one window on every rank: each copies "
            "its vector in, reduces its 1/p reading the peers' copies where they lie, and "
            "copies the peers' slices of the result out: fewer bytes, fewer "
            "synchronisations, no message. "
            "DDP's gradient buckets live in such a window from the start ('shm, bucket', in "
            "place): each rank reduces its slice into its own bucket and copies the peers' "
            "slices from theirs.", width=terminal_width()))
    check("shm: no byte went through a message (counters)", most_sent["shm"] == 0, "0 B",
          f"{most_sent['shm']:,} B")
    check(f"shm on a bucket in the window: every element is the exact sum {p}",
          exact["shm, bucket"], p, "another value")
figure(args.plot, "04_busbw", lambda figures: figures.busbw_chart(
    rows, p, title=f"All-reduce on {p} ranks: measured (solid) and the fitted model (dashed)"))
raise SystemExit(finish(f"all {len(ALGOS)} hand-written all-reduces returned MPI's exact sum, "
                        f"ring{' and halving' if p & (p - 1) == 0 else ''} at the optimal bytes"))
