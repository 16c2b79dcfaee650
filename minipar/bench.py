"""All-reduce benchmark in the conventions of nccl-tests and the OSU micro-benchmarks.

    mpiexec -n 4 python -m minipar.bench          (or: minipar bench allreduce -n 4)
    minipar bench allreduce -n 4 --max-bytes 1048576 --json --plot busbw.png

A header (MPI library, p, oversubscription, CUDA-aware status, allocator setting, the fitted
cost constants), then one row per size and algorithm: time (the median of the slowest rank's),
algbw, busbw, time / MPI_Allreduce's, the cost model's prediction and the ranks with a wrong
sum; after the table, lines starting with ``#``: the model checked at sizes the fit never
measured, and the range of measured / model, overall and per algorithm. The columns, the check,
``MALLOC_MMAP_MAX_`` and ``--plot``: docs/benchmarks.md.
"""
import json
import os
import socket
import sys
import time

from minipar import backend, console
from minipar.cli.args import ArgumentParser, UsageError, nonnegative_int, positive_int, size_list
from minipar.distributed.process_group import launched_rank

# MPI and minipar.comm are imported inside the functions that measure: check() sees every
# argument before MPI starts or mpiexec is launched

DEFAULT_SIZES = [8] + [16 << (2 * k) for k in range(12)]  # 8 B, 16 B, 64 B, ... 64 MiB
MAX_BYTES = 1 << 30  # the largest vector the benchmark allocates (1 GiB per rank, three buffers)
SLOW = ("sequential", "parallel", "parameter_server")  # O(p n) per link: only up to --slow-max


def busbw(nbytes, seconds, p):
    """Bus bandwidth in GB/s of an all-reduce of ``nbytes`` on p ranks taking ``seconds``:
    n / t · 2(p-1)/p (nccl-tests), the rate each link of a ring carries, comparable with the
    link speed whatever p is."""
    return nbytes / seconds * 2 * (p - 1) / p / 1e9


def memcpy_bandwidth(nbytes=64 << 20):
    """Bytes per second of one large array copy on this rank (read + write counted once)."""
    xp = backend.xp()
    a, b = xp.ones(nbytes, xp.uint8), xp.empty(nbytes, xp.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        b[...] = a
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def header(comm, model):
    import mpi4py
    from mpi4py import MPI

    from minipar.comm import cuda_aware
    hosts = comm.all_gather_object(socket.gethostname())
    per_node, cores = hosts.count(hosts[comm.rank]), os.cpu_count()
    aware, why = cuda_aware()
    return {
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": mpi4py.__version__,
        "p": comm.size,
        "ranks_per_node": per_node,
        "cores": cores,
        "oversubscribed": per_node > cores,
        "device": backend.device(),
        "cuda_aware": f"{aware} ({why})",
        "memcpy_GBps": round(memcpy_bandwidth() / 1e9, 2),
        "MALLOC_MMAP_MAX_": os.environ.get("MALLOC_MMAP_MAX_", "unset"),
        "alpha_us": {a: round(s * 1e6, 2) for a, s in model.alphas.items()},
        "beta_GBps": {_size(m): _gbps(b) for m, b in model.betas.items()},
        "one_way_beta_GBps": {_size(m): _gbps(b) for m, b in model.one_way.items()} or "none",
        "gamma_GBps": {_size(m): _gbps(g) for m, g in model.gammas.items()},
        "fit_refitted": {_size(m): n for m, n in model.refitted.items()} or "none",
        "fit_unsettled": [_size(m) for m in model.unsettled] or "none",
    }


def _gbps(seconds_per_byte):
    """GB/s for a per-byte time (inf when a size cost no more than the tiny message)."""
    return round(1 / seconds_per_byte / 1e9, 2) if seconds_per_byte > 0 else float("inf")


def _size(nbytes):
    """8 B, 64 KiB, 16 MiB: a power of two in the unit that keeps it short."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def time_all_reduce(comm, x, algorithm, iters, warmup=2):
    """(median of the slowest rank's seconds, number of ranks with a wrong result)."""
    from minipar.comm import fit
    out = backend.xp().empty_like(x)
    seconds = fit.timed(comm, lambda: comm.all_reduce(x, algorithm=algorithm, out=out), iters,
                        warmup)
    exact = comm.size * (comm.size + 1) / 2  # every rank sends rank + 1: the sum is exact
    wrong = sum(comm.all_gather_object(int(not bool((out == exact).all()))))
    return seconds, wrong


def iterations(nbytes, budget=0.2):
    """Fewer iterations for bigger messages (about budget seconds at 1 GB/s, 10 to 200)."""
    return int(min(200, max(10, budget * 1e9 / max(nbytes, 1))))


HELD_OUT = (3 << 15, 3 << 19, 3 << 23)  # 96 KiB, 1.5 MiB, 24 MiB: between the fitted sizes
CHECKED_FROM = 64 << 10  # measured / model is checked from 64 KiB up (below: alpha-bound)
GOAL = (0.8, 1.25)


def measure(comm, nbytes, algorithm, model, mpi_time=None):
    """One row: ``algorithm`` timed on an n-byte vector, beside the model's prediction and
    MPI's time ``mpi_time`` (None: ``vs_mpi`` None)."""
    from minipar.comm import cost
    x = backend.xp().full(max(nbytes // 4, 1), comm.rank + 1, dtype="float32")
    seconds, wrong = time_all_reduce(comm, x, algorithm, iterations(x.nbytes))
    predicted = None
    if algorithm not in ("mpi", "auto"):
        predicted = cost.predict("all_reduce", algorithm, comm.size, x.nbytes, model)
    algbw = x.nbytes / seconds / 1e9
    return {"bytes": x.nbytes, "algorithm": algorithm, "time_us": seconds * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": busbw(x.nbytes, seconds, comm.size),
            "vs_mpi": 1.0 if algorithm == "mpi" else mpi_time and seconds / mpi_time,
            "model_us": predicted and predicted * 1e6,
            "measured_over_model": predicted and seconds / predicted, "wrong": wrong}


def run_bench(comm, sizes, algorithms, slow_max, as_json, held_out=None):
    """The table's rows (one per size and algorithm, MPI's first). ``held_out``, a list, gets
    the rows of the check at sizes the fit never measured (``HELD_OUT`` from 64 KiB up to the
    largest size), printed after the table with the range of measured / model."""
    from minipar.comm import fit
    from minipar.comm.allreduce import AUTO_CANDIDATES
    fit_sizes = [m for m in fit.FIT_SIZES if m <= max(sizes)] or fit.FIT_SIZES[:1]
    fitted = [a for a in algorithms if a not in ("mpi", "auto")] + list(
        AUTO_CANDIDATES)  # each its own alpha
    model = fit.fit(comm, fit_sizes, algorithms=fitted,  # no message beyond the largest vector
                    progress=lambda it: console.progress(it, "fitting the cost model",
                                                         rank=comm.rank))
    info = header(comm, model)
    rows, show = [], comm.rank == 0 and not as_json
    if show:
        print("# minipar all-reduce benchmark (float32, op=sum)")
        for key, value in info.items():
            print(f"# {key:18s} {value}")
        print(f"#{'bytes':>10s} {'algorithm':>18s} {'time_us':>10s} {'algbw':>7s} {'busbw':>7s}"
              f" {'vs_mpi':>7s} {'model_us':>10s} {'meas/mod':>8s} {'wrong':>5s}")
    # the table's rows show how far it got; a JSON document comes at the end: a bar meanwhile
    for nbytes in console.progress(sizes, "sizes", rank=comm.rank) if as_json else sizes:
        mpi_time = None
        for algorithm in ["mpi"] + [a for a in algorithms if a != "mpi"]:
            if algorithm in SLOW and nbytes > slow_max:
                continue
            row = measure(comm, nbytes, algorithm, model, mpi_time)
            mpi_time = mpi_time or row["time_us"] / 1e6
            rows.append(row)
            if show:
                model_text = (f"{row['model_us']:10.1f} {row['measured_over_model']:8.2f}"
                              if row["model_us"] else f"{'-':>10s} {'-':>8s}")
                print(f"{row['bytes']:11d} {algorithm:>18s} {row['time_us']:10.1f} "
                      f"{row['algbw_GBps']:7.3f} {row['busbw_GBps']:7.3f} {row['vs_mpi']:7.2f} "
                      f"{model_text} {row['wrong']:5d}", flush=True)
    modelled = [a for a in algorithms if a not in ("mpi", "auto")]
    checks = [(m, a) for m in HELD_OUT if CHECKED_FROM <= m <= max(sizes) for a in modelled
              if not (a in SLOW and m > slow_max)]
    if checks and show:
        print(f"# held out of the fit (sizes between its powers of two; fastest of {ROUNDS} "
              f"rounds, as the fit): measured / model", flush=True)
        print(f"#{'bytes':>10s} {'algorithm':>18s} {'time_us':>10s} {'model_us':>10s} "
              f"{'meas/mod':>8s}")
    extra = held_out_rows(comm, checks, model)
    for r in extra if show else ():
        print(f"#{r['bytes']:10d} {r['algorithm']:>18s} {r['time_us']:10.1f} "
              f"{r['model_us']:10.1f} {r['measured_over_model']:8.2f}")
    if show:
        print(model_summary(rows, extra))
    if show and extra:
        print(per_algorithm(extra))
    if held_out is not None:
        held_out.extend(extra)
    if comm.rank == 0 and as_json:
        print(json.dumps({"header": info, "rows": rows, "held_out": extra}, indent=1))
    return rows


ROUNDS = 3


def held_out_rows(comm, checks, model, rounds=ROUNDS, retries=3):
    """A row for each (size, algorithm) of ``checks``, its time the fastest of ``rounds``
    rounds taking turns, the stalled ones measured again (up to ``retries`` times): timed as
    the fit times its constants (comm/fit.py), so a busy machine slows the check no more than
    it slowed the fit, and what is checked is the model."""
    from minipar.comm import fit
    samples = {key: [] for key in checks}

    def once(key):
        samples[key].append(measure(comm, *key, model))

    def stalled():
        times = {}  # per algorithm: {size: [microseconds, ...]}, as fit.stalled() reads them
        for (nbytes, algorithm), rows in samples.items():
            times.setdefault(algorithm, {})[nbytes] = [r["time_us"] for r in rows]
        return [(m, a) for a, by_size in times.items() for m in fit.stalled(by_size)]

    fit.settle(checks, once, stalled, rounds, retries)
    return [min(samples[key], key=lambda row: row["time_us"]) for key in checks]


def model_summary(rows, held_out):
    """One line: the range of measured / model from 64 KiB up, in the table and held out of the
    fit, each with its worst row, beside the goal."""
    def span(rs, name):
        ratios = [(r["measured_over_model"], r["algorithm"], r["bytes"]) for r in rs
                  if r["measured_over_model"] and r["bytes"] >= CHECKED_FROM]
        if not ratios:
            return f"{name} -"
        worst = max(ratios, key=lambda q: max(q[0], 1 / q[0]))
        return (f"{name} {min(ratios)[0]:.2f}-{max(ratios)[0]:.2f} over {len(ratios)} rows "
                f"(worst {worst[1]} at {worst[2]} B: {worst[0]:.2f})")
    return (f"# measured / model from {_size(CHECKED_FROM)} up: {span(held_out, 'held out')}; "
            f"{span(rows, 'table')}; goal {GOAL[0]}-{GOAL[1]} on a quiet machine")


def per_algorithm(held_out):
    """One line: each algorithm's range of measured / model held out of the fit from 64 KiB up,
    and those outside the goal."""
    ratios = {}
    for r in held_out:
        if r["measured_over_model"] and r["bytes"] >= CHECKED_FROM:
            ratios.setdefault(r["algorithm"], []).append(r["measured_over_model"])
    missed = [a for a, q in ratios.items() if min(q) < GOAL[0] or max(q) > GOAL[1]]
    return (f"# held out, per algorithm: "
            + (", ".join(f"{a} {min(q):.2f}-{max(q):.2f}" for a, q in ratios.items()) or "-")
            + f"; outside the goal {GOAL[0]}-{GOAL[1]}: {', '.join(missed) or 'none'}")


def add_arguments(parser):
    parser.add_argument("-n", "--nprocs", type=positive_int, default=None,
                        help="ranks to launch when not already under mpiexec (default 4)")
    parser.add_argument("--algorithms", default=None,
                        help="comma-separated all-reduce algorithms (default: every one but mpi, "
                             "which is always measured as the reference)")
    parser.add_argument("--sizes", type=size_list, default=None,
                        help=f"comma-separated sizes in bytes, each 1 to {MAX_BYTES} "
                             f"(default 8 B to 64 MiB)")
    parser.add_argument("--max-bytes", type=positive_int, default=64 << 20,
                        help="largest size (drops the larger --sizes)")
    parser.add_argument("--slow-max", type=nonnegative_int, default=4 << 20,
                        help=f"largest size for {', '.join(SLOW)} (O(p n) traffic; 0 skips them)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of a table")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="draw bus bandwidth against message size into FILE (.png, .svg "
                             "or .pdf; without a suffix, a folder for allreduce_busbw.png; "
                             "needs matplotlib)")


def check(args):
    """What the parser cannot see: sizes within limits, known algorithm names. Returns the
    sizes to measure and the algorithms (names are looked up in minipar.comm only when given,
    which starts MPI)."""
    big = [s for s in args.sizes or () if s > MAX_BYTES]
    if big:
        raise UsageError(f"argument --sizes: {big[0]} bytes is above the largest size the "
                         f"benchmark allocates, {MAX_BYTES}")
    sizes = [s for s in args.sizes or DEFAULT_SIZES if s <= args.max_bytes]
    if not sizes:
        raise UsageError(f"argument --max-bytes: no size is <= --max-bytes {args.max_bytes} "
                         f"(the smallest is {min(args.sizes or DEFAULT_SIZES)})")
    if args.algorithms is None:
        return sizes, None
    from minipar.comm import ALGORITHMS
    valid = sorted(ALGORITHMS["all_reduce"]) + ["auto"]
    algorithms = [a.strip() for a in args.algorithms.split(",")]
    unknown = [a for a in algorithms if a not in valid]
    if unknown:
        raise UsageError(f"argument --algorithms: unknown all-reduce algorithm {unknown[0]!r}: "
                         f"choose from {', '.join(valid)}")
    return sizes, algorithms


def _under_mpi():
    return launched_rank() is not None or any(
        v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"))


def run(args):
    """Benchmark under the running MPI job, or launch one of ``--nprocs`` ranks first."""
    sizes, algorithms = check(args)
    if not _under_mpi():
        return launch(args)
    from minipar.comm import ALGORITHMS, world
    comm = world()
    if args.nprocs not in (None, comm.size) and comm.rank == 0:
        print(f"minipar bench: -n {args.nprocs} ignored: measuring the {comm.size} ranks "
              f"mpiexec started", file=sys.stderr, flush=True)
    if algorithms is None:
        algorithms = [a for a in ALGORITHMS["all_reduce"] if a != "mpi"]
    console.note_load(rank=comm.rank)
    rows = run_bench(comm, sizes, algorithms, args.slow_max, args.json)
    if args.plot and comm.rank == 0:
        plot(rows, comm.size, args.plot, sys.stderr if args.json else sys.stdout)
    return 0


def plot(rows, p, path, stream):
    """Draw ``rows`` (run_bench's) into ``path`` and print where; without matplotlib, say in one
    line how to get the picture. Returns the path written, or None."""
    from minipar import figures
    if os.path.isdir(path) or not os.path.splitext(path)[1]:
        path = os.path.join(path, "allreduce_busbw.png")
    title = (f"all-reduce bus bandwidth on {p} ranks ({backend.device()}, float32): measured, "
             f"and the cost model dashed")
    folder, name = os.path.split(path)
    written = figures.write_figures(
        folder, lambda: {name: figures.busbw_chart(rows, p, title=title)}, stream)
    return written[0] if written else None


def launch(args):
    """Run ``python -m minipar.bench`` on ``--nprocs`` ranks (default 4); its exit status."""
    from minipar.testing import RANK_ENV, launch_command
    try:
        command = launch_command(args.nprocs or 4, sys.executable, "-m", "minipar.bench")
    except RuntimeError as err:
        raise SystemExit(f"minipar bench: {err}") from None
    # heap only, so that MPICH's temporary buffer is not mapped afresh on every large all-reduce
    # (docs/benchmarks.md)
    env = {**os.environ, **RANK_ENV, "MALLOC_MMAP_MAX_": os.environ.get("MALLOC_MMAP_MAX_", "0")}
    env.update(console.terminal_env(env))  # mpiexec gives the ranks pipes, not this terminal
    return os.spawnve(os.P_WAIT, command[0], command + _forward(args), env)


def _forward(args):
    """The options to pass on to the ranks (everything but --nprocs)."""
    forwarded = ["--max-bytes", str(args.max_bytes), "--slow-max", str(args.slow_max)]
    if args.algorithms is not None:
        forwarded += ["--algorithms", args.algorithms]
    if args.sizes:
        forwarded += ["--sizes", ",".join(map(str, args.sizes))]
    if args.plot:
        forwarded += ["--plot", os.path.abspath(args.plot)]
    return forwarded + (["--json"] if args.json else [])


def main(argv=None, prog="python -m minipar.bench"):
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
