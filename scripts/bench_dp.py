"""Data-parallel throughput: minipar DDP, overlap on and off, against torch DDP (gloo), 1-2 ranks.

    python scripts/bench_dp.py            (about a minute)
    python scripts/bench_dp.py --quick    (a smoke run)

Weak scaling: every rank trains on its own 64 samples a step, so N ranks process 64·N samples a
step and perfect scaling is N times the throughput. One launch of ``mpiexec -n N`` per rank
count runs, in the same processes and on the same model (an MLP 512-1024-1024-1024-10, 2.6 M
float32 parameters, SGD with momentum, 2 MB gradient buckets in both libraries), one BLAS
thread per rank:

    no comm         minipar under ``no_sync()``: forward + backward + step, no gradient traffic
                    (what the step would cost if communication were free)
    overlap on      minipar DDP, buckets all-reduced (``--algorithm``, default ring) during
                    backward: hand-coded ones on a background thread, "mpi" by MPI_Iallreduce
    overlap off     minipar DDP, the same buckets reduced one after another after backward
    torch DDP       torch.nn.parallel.DistributedDataParallel, gloo over loopback TCP; torch
                    ranks find each other through MASTER_ADDR=127.0.0.1 and a free port, and read
                    their rank and size from mpiexec's PMI_RANK / PMI_SIZE

Step time is the median over steps of the slowest rank; throughput = 64·N / step time. The
closing lines give 2-rank/1-rank throughput (goal >= 1.8 on a 2-core machine), minipar over
torch step time (goal <= 1.2), the gain from overlap, and where the time goes (exposed
communication = overlap-on step minus no-comm step). On a machine shared with other jobs the
figures are noisy: the table says how many cores and what load average it ran with.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

LOCAL_BATCH, SIZES, BUCKET_MB = 64, (512, 1024, 1024, 1024, 10), 2.0


# ----------------------------------------------------------------------------------------------
# The rank side: python scripts/bench_dp.py --worker STEPS (under mpiexec)
# ----------------------------------------------------------------------------------------------

def timed(world, step, steps):
    """Median seconds per step of the slowest rank (after two warm-up steps)."""
    import numpy as np

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        world.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = world.all_reduce(np.array(times), op="max", algorithm="mpi")
    return statistics.median(slowest.tolist())


def minipar_runs(world, steps, algorithm):
    import numpy as np

    import minipar
    import minipar.nn as nn
    from minipar import functional as F
    from minipar import optim
    from minipar.parallel.data import DistributedDataParallel

    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal((LOCAL_BATCH, SIZES[0])).astype("float32")
    y = rng.integers(0, SIZES[-1], LOCAL_BATCH)
    results = {}
    for name, overlap in (("no comm", True), ("overlap on", True), ("overlap off", False)):
        minipar.manual_seed(0)
        layers = []
        for i in range(len(SIZES) - 1):
            layers += [nn.Linear(SIZES[i], SIZES[i + 1]), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        ddp = DistributedDataParallel(model, world, bucket_cap_mb=BUCKET_MB, overlap=overlap,
                                      algorithm=algorithm)
        opt = optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad()
            F.cross_entropy(ddp(minipar.tensor(x)), y).backward()
            opt.step()
        if name == "no comm":
            with ddp.no_sync():
                results[name] = timed(world, step, steps)
        else:
            results[name] = timed(world, step, steps)
    return results


def torch_run(world, steps):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=int(os.environ["PMI_RANK"]),
                            world_size=int(os.environ["PMI_SIZE"]))
    torch.manual_seed(0)
    layers = []
    for i in range(len(SIZES) - 1):
        layers += [torch.nn.Linear(SIZES[i], SIZES[i + 1]), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers[:-1]),
                                                      bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(LOCAL_BATCH, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (LOCAL_BATCH,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    result = timed(world, step, steps)
    dist.destroy_process_group()
    return result


def worker(steps, with_torch, algorithm):
    from minipar import comm

    world = comm.world()
    results = minipar_runs(world, steps, algorithm)
    if with_torch:
        try:
            results["torch DDP"] = torch_run(world, steps)
        except ImportError:
            pass  # PyTorch is optional
    if world.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


# ----------------------------------------------------------------------------------------------
# The driver: one mpiexec launch per rank count, then the table
# ----------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nprocs, steps, with_torch, algorithm):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from minipar.testing import RANK_ENV, mpiexec

    env = {**os.environ, **RANK_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    command = [mpiexec(), "-n", str(nprocs), sys.executable, os.path.abspath(__file__),
               "--worker", str(steps), "--algorithm", algorithm] + ([] if with_torch else
                                                                    ["--no-torch"])
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"mpiexec -n {nprocs} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(line[0][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 timed steps")
    parser.add_argument("--no-torch", action="store_true", help="skip torch DDP")
    parser.add_argument("--algorithm", default="ring", help="minipar's all-reduce (default ring)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, not args.no_torch, args.algorithm)
    steps = 3 if args.quick else 20
    report({n: launch(n, steps, not args.no_torch, args.algorithm) for n in (1, 2)}, steps)


def report(runs, steps):
    ms = {n: {name: t * 1e3 for name, t in run.items()} for n, run in runs.items()}
    params = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    print(f"MLP {'-'.join(map(str, SIZES))}: {params / 1e6:.2f} M parameters, {LOCAL_BATCH} "
          f"samples per rank per step, {steps} timed steps; {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f}")
    print(f"{'':14s}" + "".join(f"{f'{n} rank(s): ms/step  samples/s':>32s}" for n in ms))
    for name in ms[1]:
        cells = [f"{ms[n][name]:20.1f} {LOCAL_BATCH * n * 1e3 / ms[n][name]:11.0f}" for n in ms]
        print(f"{name:14s}" + "".join(cells))
    one, two = ms[1], ms[2]
    print(f"\n2-rank / 1-rank throughput, overlap on: "
          f"{2 * one['overlap on'] / two['overlap on']:.2f} (goal >= 1.8; bound with free "
          f"communication {2 * one['no comm'] / two['no comm']:.2f})")
    if "torch DDP" in two:
        print(f"minipar / torch DDP step time, 2 ranks: {two['overlap on'] / two['torch DDP']:.2f} "
              f"(goal <= 1.2); 1 rank: {one['overlap on'] / one['torch DDP']:.2f}")
    print(f"gain from overlap, 2 ranks: {two['overlap off'] / two['overlap on']:.2f}x "
          f"({two['overlap off'] - two['overlap on']:.1f} ms a step)")
    print(f"where the 2-rank step goes: {two['no comm']:.1f} ms compute, "
          f"{two['overlap on'] - two['no comm']:.1f} ms exposed communication; the 1-rank compute "
          f"is {one['no comm']:.1f} ms, so {two['no comm'] - one['no comm']:.1f} ms is lost to two "
          f"ranks sharing cores, caches and memory bandwidth (and to other jobs)")

if __name__ == "__main__":
    main()
