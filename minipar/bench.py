"""All-reduce benchmark in the conventions of nccl-tests and the OSU micro-benchmarks.

    mpiexec -n 4 python -m minipar.bench          (or: minipar bench allreduce -n 4)

A header (MPI library, mpi4py, p, oversubscription, CUDA-aware status, memory-copy bandwidth,
allocator setting, fitted cost constants), then one row per size and algorithm:

    time     median over iterations of the slowest rank's time, in microseconds
    algbw    n / time                         (bytes of the vector per second)
    busbw    algbw * 2(p-1)/p                 (nccl-tests: comparable with the link speed)
    vs mpi   time / MPI_Allreduce's time in the same run
    model    the cost model's prediction (the formula beside its code, constants fitted by comm/fit.py)
    wrong    ranks whose result differed from the exact sum

MPICH allocates a full-size temporary buffer on every large MPI_Allreduce; glibc serves large
blocks with mmap, so each call maps and unmaps (and page-faults) it afresh. Run with
``MALLOC_MMAP_MAX_=0`` (heap only) for a fair comparison; the header prints the setting and
``minipar bench allreduce`` sets it when it launches mpiexec itself.
"""
import argparse
import json
import os
import socket
import sys
import time

import mpi4py
from mpi4py import MPI

from minipar import backend
from minipar.comm import ALGORITHMS, cost, cuda_aware, fit, world
from minipar.comm.allreduce import AUTO_CANDIDATES
from minipar.testing import RANK_ENV, mpiexec

DEFAULT_SIZES = [8] + [16 << (2 * k) for k in range(12)]  # 8 B, 16 B, 64 B, ... 64 MiB
SLOW = ("sequential", "parallel", "parameter_server")  # O(p n) per link: only up to --slow-max


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
        "gamma_GBps": {_size(m): _gbps(g) for m, g in model.gammas.items()},
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
    out = backend.xp().empty_like(x)
    times = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, algorithm=algorithm, out=out)
        backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    exact = comm.size * (comm.size + 1) / 2  # every rank sends rank + 1: the sum is exact
    wrong = sum(comm.all_gather_object(int(not bool((out == exact).all()))))
    return fit.slowest_median(comm, times), wrong


def iterations(nbytes, budget=0.2):
    """Fewer iterations for bigger messages (about budget seconds at 1 GB/s, 10 to 200)."""
    return int(min(200, max(10, budget * 1e9 / max(nbytes, 1))))


def run_bench(comm, sizes, algorithms, slow_max, as_json):
    fit_sizes = [m for m in fit.FIT_SIZES if m <= max(sizes)] or fit.FIT_SIZES[:1]
    fitted = [a for a in algorithms if a not in ("mpi", "auto")] + list(
        AUTO_CANDIDATES)  # each its own alpha
    model = fit.fit(comm, fit_sizes, algorithms=fitted)  # no message beyond the largest vector
    info = header(comm, model)
    p, rows = comm.size, []
    if comm.rank == 0 and not as_json:
        print("# minipar all-reduce benchmark (float32, op=sum)")
        for key, value in info.items():
            print(f"# {key:18s} {value}")
        print(f"#{'bytes':>10s} {'algorithm':>18s} {'time_us':>10s} {'algbw':>7s} {'busbw':>7s}"
              f" {'vs_mpi':>7s} {'model_us':>10s} {'meas/mod':>8s} {'wrong':>5s}")
    for nbytes in sizes:
        x = backend.xp().full(max(nbytes // 4, 1), comm.rank + 1, dtype="float32")
        mpi_time = None
        for algorithm in ["mpi"] + [a for a in algorithms if a != "mpi"]:
            if algorithm in SLOW and nbytes > slow_max:
                continue
            seconds, wrong = time_all_reduce(comm, x, algorithm, iterations(x.nbytes))
            mpi_time = seconds if algorithm == "mpi" else mpi_time
            predicted = None
            if algorithm not in ("mpi", "auto"):
                predicted = cost.predict("all_reduce", algorithm, p, x.nbytes, model)
            algbw = x.nbytes / seconds / 1e9
            row = {"bytes": x.nbytes, "algorithm": algorithm, "time_us": seconds * 1e6,
                   "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (p - 1) / p,
                   "vs_mpi": seconds / mpi_time, "model_us": predicted and predicted * 1e6,
                   "measured_over_model": predicted and seconds / predicted, "wrong": wrong}
            rows.append(row)
            if comm.rank == 0 and not as_json:
                model_text = (f"{predicted * 1e6:10.1f} {seconds / predicted:8.2f}" if predicted
                              else f"{'-':>10s} {'-':>8s}")
                print(f"{x.nbytes:11d} {algorithm:>18s} {seconds * 1e6:10.1f} {algbw:7.3f} "
                      f"{row['busbw_GBps']:7.3f} {row['vs_mpi']:7.2f} {model_text} {wrong:5d}",
                      flush=True)
    if comm.rank == 0 and as_json:
        print(json.dumps({"header": info, "rows": rows}, indent=1))
    return rows


def add_arguments(parser):
    parser.add_argument("-n", "--nprocs", type=int, default=4,
                        help="ranks to launch when not already under mpiexec (default 4)")
    parser.add_argument("--algorithms", default=",".join(a for a in ALGORITHMS[
        "all_reduce"] if a != "mpi"), help="comma-separated all-reduce algorithms")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes in bytes (default 8 B to 64 MiB)")
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest size")
    parser.add_argument("--slow-max", type=int, default=4 << 20,
                        help=f"largest size for {', '.join(SLOW)} (O(p n) traffic)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _under_mpi():
    return any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                         "PMIX_RANK", "MPI_LOCALNRANKS"))


def run(args):
    """Benchmark under the running MPI job, or launch one of ``--nprocs`` ranks first."""
    if not _under_mpi():
        env = {**os.environ, **RANK_ENV, "MALLOC_MMAP_MAX_": os.environ.get(
            "MALLOC_MMAP_MAX_", "0")}
        command = [mpiexec(), "-n", str(args.nprocs), sys.executable, "-m", "minipar.bench"]
        return os.spawnve(os.P_WAIT, command[0], command + _forward(args), env)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    sizes = [s for s in sizes if s <= args.max_bytes]
    run_bench(world(), sizes, args.algorithms.split(","), args.slow_max, args.json)
    return 0


def _forward(args):
    """The options to pass on to the ranks (everything but --nprocs)."""
    forwarded = ["--algorithms", args.algorithms, "--max-bytes", str(args.max_bytes),
                 "--slow-max", str(args.slow_max)]
    if args.sizes:
        forwarded += ["--sizes", args.sizes]
    return forwarded + (["--json"] if args.json else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
