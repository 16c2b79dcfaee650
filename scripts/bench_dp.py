"""Data-parallel throughput: minipar DDP, overlap on and off, against torch DDP (gloo), 1-2 ranks.

    python scripts/bench_dp.py              (about 80 s: 64 and 256 samples per rank)
    python scripts/bench_dp.py --repeat 3   (three launches per rank count, medians)
    python scripts/bench_dp.py --quick      (a smoke run)

Weak scaling (``--batches`` samples per rank a step): no comm, overlap on, overlap off and
torch DDP take turns in one launch per rank count, with the compressing communication hooks
on 2 ranks at the largest batch (bytes per step by the counters); the closing lines give the
goals (2-rank / 1-rank throughput, overlap on and DDP's default beside the no-communication
ceiling, minipar / torch) and where the time goes. What each run is,
the goals and the summary: docs/benchmarks.md.
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys

SIZES, BUCKET_MB = (512, 1024, 1024, 1024, 10), 2.0


# ----------------------------------------------------------------------------------------------
# The rank side: python scripts/bench_dp.py --worker ... (under mpiexec)
# ----------------------------------------------------------------------------------------------

def timed(world, steps, rounds, runs):
    """Median seconds per step of the slowest rank, for each of ``runs`` (name -> step function).

    The runs take turns: ``rounds`` rounds of ``steps`` steps each (after a warm-up step), so a
    change of machine load in the middle hits every run alike instead of one of them."""
    from minipar.comm import fit

    times = {name: [] for name in runs}
    for name, step in runs.items():
        step()
    for _ in range(rounds):
        for name, step in runs.items():
            times[name] += fit.timed(world, step, steps, warmup=0, statistic=list)
    return {name: statistics.median(t) for name, t in times.items()}


def hook_runs():
    """The compressing hooks (docs/data_parallel.md), each a fresh (state, hook) by run name."""
    from minipar.parallel.data.hooks import (PowerSGDState, SignState, TopKState,
                                             fp16_compress_hook, powerSGD_hook, sign_hook,
                                             topk_hook)

    return {"fp16 hook": lambda: (None, fp16_compress_hook),
            "PowerSGD r1": lambda: (PowerSGDState(None, 1, start_powerSGD_iter=0),
                                    powerSGD_hook),
            "top-k 1%": lambda: (TopKState(ratio=0.01), topk_hook),
            "signs": lambda: (SignState(), sign_hook)}


def minipar_runs(world, batch, algorithm, hooks=False):
    """Step functions: no comm, overlap on, overlap off (three models, the same start), then
    with ``hooks`` (and more than one rank) overlap on with each compressing hook."""
    import numpy as np

    import minipar
    import minipar.nn as nn
    from minipar import functional as F
    from minipar import optim
    from minipar.parallel.data import DistributedDataParallel

    rng = np.random.default_rng(world.rank)
    x = minipar.tensor(rng.standard_normal((batch, SIZES[0])).astype("float32"))
    y = rng.integers(0, SIZES[-1], batch)
    runs = {}
    configs = [("no comm", True, None), ("overlap on", True, None), ("overlap off", False, None)]
    if hooks and world.size > 1:  # one rank has nothing to send: no rows to compare
        configs += [(name, True, make) for name, make in hook_runs().items()]
    for name, overlap, make in configs:
        minipar.manual_seed(0)
        layers = []
        for i in range(len(SIZES) - 1):
            layers += [nn.Linear(SIZES[i], SIZES[i + 1]), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        ddp = DistributedDataParallel(model, world, bucket_cap_mb=BUCKET_MB, overlap=overlap,
                                      algorithm=algorithm)
        if make is not None:
            ddp.register_comm_hook(*make())
        opt = optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(ddp=ddp, opt=opt, sync=name != "no comm"):
            opt.zero_grad()
            with contextlib.nullcontext() if sync else ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
            opt.step()
        runs[name] = step
    return runs


def torch_runs(world, batch):
    """The torch DDP step function (gloo), or none when PyTorch is not installed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {}
    torch.set_num_threads(1)
    if not dist.is_initialized():
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
    x = torch.randn(batch, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (batch,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"torch DDP": step}


def bytes_sent(world, runs):
    """Bytes rank 0 sends in the second step of each run (the counters; the first also carries
    a hook's agreement check)."""
    sent = {}
    for name, step in runs.items():
        step()
        world.barrier()
        world.counters.reset()
        step()
        sent[name] = world.counters.bytes_sent
    return sent


def worker(steps, rounds, batches, with_torch, algorithm, hooks):
    from minipar import comm
    from minipar.comm.node import overlap_default

    world = comm.world()
    default = overlap_default(world)  # what DDP(overlap="auto") chooses in this configuration
    results = {}
    for batch in batches:
        # the hooks at the largest batch only: their bytes and their own work do not depend on
        # the batch, and each costs as much as a run (top-k's argsort of 2.6 M entries)
        runs = minipar_runs(world, batch, algorithm, hooks and batch == max(batches))
        if with_torch:
            runs.update(torch_runs(world, batch))
        results[batch] = timed(world, steps, rounds, runs)
    # counted over the ring all-reduce: "auto" on one node takes shared memory, whose copies
    # the counters do not see (docs/comm.md); a network would carry the ring's bytes
    sent = bytes_sent(world, minipar_runs(world, max(batches), "ring", hooks))
    if world.rank == 0:
        print("DEFAULT " + json.dumps(default), flush=True)
        print("SENT " + json.dumps(sent), flush=True)
        print("RESULT " + json.dumps(results), flush=True)


# ----------------------------------------------------------------------------------------------
# The driver: one mpiexec launch per rank count, then the table
# ----------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nprocs, args, defaults=None, sent=None):
    """{batch: {run: seconds}} of one ``mpiexec -n nprocs`` launch; ``defaults``, a dict, gets
    {nprocs: (overlap, why)}: DDP's overlap default in that configuration; ``sent``, a dict,
    gets {nprocs: {run: bytes rank 0 sends in one step over the ring}} (minipar's runs)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from minipar.testing import RANK_ENV, mpiexec

    env = {**os.environ, **RANK_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    command = [mpiexec(), "-n", str(nprocs), sys.executable, os.path.abspath(__file__),
               "--worker", "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--batches", args.batches, "--algorithm", args.algorithm] + (
                   ["--no-torch"] if args.no_torch else []) + (
                   ["--no-hooks"] if getattr(args, "no_hooks", False) else [])
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"mpiexec -n {nprocs} failed:\n{out.stdout}\n{out.stderr}")
    if defaults is not None:
        default = [s for s in out.stdout.splitlines() if s.startswith("DEFAULT ")]
        defaults[nprocs] = tuple(json.loads(default[0][len("DEFAULT "):]))
    if sent is not None:
        counted = [s for s in out.stdout.splitlines() if s.startswith("SENT ")]
        sent[nprocs] = json.loads(counted[0][len("SENT "):])
    return {int(b): run for b, run in json.loads(line[0][len("RESULT "):]).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 3 steps")
    parser.add_argument("--no-torch", action="store_true", help="skip torch DDP")
    parser.add_argument("--no-hooks", action="store_true",
                        help="skip the compressing communication hooks' runs")
    parser.add_argument("--algorithm", default="auto",
                        help="minipar's all-reduce (default auto, DDP's default)")
    parser.add_argument("--batches", default="64,256", help="samples per rank (default 64,256)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the runs taking turns")
    parser.add_argument("--repeat", type=int, default=1, help="launches per rank count; the "
                                                              "table gives the medians")
    parser.add_argument("--plot", metavar="DIR", help="draw the throughput bars into DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.repeat = 3, 1, 1
    if args.worker:
        return worker(args.steps, args.rounds, [int(b) for b in args.batches.split(",")],
                      not args.no_torch, args.algorithm, not args.no_hooks)
    from minipar.console import note_load, progress

    note_load()
    load = [os.getloadavg()[0]]
    launches = [(i, n) for i in range(args.repeat) for n in (1, 2)]
    repeats, defaults, sent = [{} for _ in range(args.repeat)], {}, {}
    for i, n in progress(launches, "mpiexec launches"):
        repeats[i][n] = launch(n, args, defaults, sent)
        if n == 2:
            load.append(os.getloadavg()[0])
    per_batch = {batch: [{n: r[n][batch] for n in r} for r in repeats] for batch in repeats[0][1]}
    for batch, runs in per_batch.items():
        report(batch, runs, args, load, sent[2])
    summary(per_batch, defaults)
    default_scaling(per_batch, defaults)
    if args.plot:
        draw(args.plot, per_batch)


def median_table(repeats):
    """ms per step, the median over repeats, for every rank count and run."""
    return {n: {name: 1e3 * statistics.median(r[n][name] for r in repeats) for name in run}
            for n, run in repeats[0].items()}


def ratios(ms):
    """The three goals' ratios (and the scaling with free communication) from one table."""
    one, two = ms[1], ms[2]
    out = {"scaling": 2 * one["overlap on"] / two["overlap on"],
           "scaling, free comm": 2 * one["no comm"] / two["no comm"],
           "overlap gain": two["overlap off"] / two["overlap on"]}
    if "torch DDP" in two:
        out["minipar / torch"] = two["overlap on"] / two["torch DDP"]
    return out


def run_names(ms):
    """The table's rows: every run on 1 rank, then those on 2 ranks only (the hooks)."""
    return list(dict.fromkeys([*ms[1], *ms[2]]))


def report(batch, repeats, args, load, sent=None):
    """The table (``sent``: {run: bytes} of one 2-rank step over the ring, a last column), its
    goals' lines, and with ``sent`` a line of each hook's bytes and samples/s against overlap
    on's all-reduce."""
    ms = median_table(repeats)
    params = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    print(f"\nMLP {'-'.join(map(str, SIZES))}: {params / 1e6:.2f} M parameters, {batch} "
          f"samples per rank per step; median of {len(repeats)} launch(es) x {args.rounds} "
          f"rounds x {args.steps} steps; {os.cpu_count()} cores, load average "
          f"{' -> '.join(f'{x:.1f}' for x in load)}")
    print(f"{'':14s}" + "".join(f"{f'{n} rank(s): ms/step  samples/s':>32s}" for n in ms)
          + (f"{'2 ranks: bytes/step, ring':>28s}" if sent else ""))
    for name in run_names(ms):
        cells = [f"{ms[n][name]:20.1f} {batch * n * 1e3 / ms[n][name]:11.0f}" if name in ms[n]
                 else f"{'-':>20s} {'-':>11s}" for n in ms]
        if sent:
            cells.append(f"{sent[name]:28d}" if name in sent else f"{'-':>28s}")
        print(f"{name:14s}" + "".join(cells))
    per_launch = [ratios(median_table([r])) for r in repeats]
    spread = {k: f" (launches: {min(r[k] for r in per_launch):.2f}-"
                 f"{max(r[k] for r in per_launch):.2f})" if len(repeats) > 1 else ""
              for k in per_launch[0]}
    got, one, two = ratios(ms), ms[1], ms[2]
    hooks = [name for name in two if name not in one]
    if sent and hooks:
        print("hooks on 2 ranks against overlap on's all-reduce, bytes/step and samples/s: "
              + ", ".join(f"{name} {sent[name] / sent['overlap on']:.3f} and "
                          f"{two['overlap on'] / two[name]:.2f}" for name in hooks))
    print(f"2-rank / 1-rank throughput, overlap on: {got['scaling']:.2f}{spread['scaling']} "
          f"(goal >= 1.8; with free communication {got['scaling, free comm']:.2f})")
    if "minipar / torch" in got:
        print(f"minipar / torch DDP step time, 2 ranks: {got['minipar / torch']:.2f}"
              f"{spread['minipar / torch']} (goal <= 0.8); 1 rank: "
              f"{one['overlap on'] / one['torch DDP']:.2f}")
    print(f"gain from overlap, 2 ranks: {got['overlap gain']:.2f}x{spread['overlap gain']} "
          f"({two['overlap off'] - two['overlap on']:.1f} ms a step)")
    shared = two["no comm"] - one["no comm"]
    print(f"where the 2-rank step goes: {two['no comm']:.1f} ms compute, "
          f"{two['overlap on'] - two['no comm']:.1f} ms exposed communication; the 1-rank compute "
          f"is {one['no comm']:.1f} ms, so {shared:.1f} ms is lost to two ranks sharing cores, "
          f"caches and memory bandwidth (and to other jobs)")
    if len(repeats) > 1:
        from minipar.console import spread
        print(f"ms/step over the {len(repeats)} launches, median [min-max]:")
        for name in run_names(ms):
            print(f"  {name:14s}" + "".join(
                f"  {n} rank(s) {spread((1e3 * r[n][name] for r in repeats), '{:.1f}')}"
                for n in ms if name in ms[n]))


def summary(per_batch, defaults):
    """The goals across per-rank batches, after the tables: 2-rank / 1-rank with overlap on and
    minipar / torch DDP at each batch (with overlap on, and with DDP's default on 2 ranks),
    each with its range over launches; then DDP's overlap default in each configuration beside
    the measured step with overlap on / off."""
    def across(ratio, ok):
        cells = []
        for batch, repeats in per_batch.items():
            got = [ratio(median_table([r])) for r in repeats]
            if None in got:
                return None
            mid = ratio(median_table(repeats))
            cells.append(f"{batch}: {mid:.2f} (launches {min(got):.2f}-{max(got):.2f}"
                         f"{'' if ok(batch, mid, got) else ', goal missed'})")
        return ", ".join(cells)

    last = max(per_batch)
    print(f"\nsummary, samples per rank {', '.join(map(str, per_batch))}:")
    print("  2-rank / 1-rank throughput, overlap on: " + across(
        lambda ms: ratios(ms)["scaling"],
        lambda b, mid, got: b != last or (mid >= 1.8 and min(got) >= 1.7))
        + f" (goal >= 1.8 at {last}, no launch below 1.7)")
    default = "overlap on" if defaults.get(2, (True,))[0] else "overlap off"
    for run in dict.fromkeys(("overlap on", default)):
        torch = across(lambda ms: ms[2][run] / ms[2]["torch DDP"] if "torch DDP" in ms[2]
                       else None, lambda b, mid, got: mid <= 0.8)
        label = f"{run} (DDP's default)" if run == default else run
        if torch:
            print(f"  minipar / torch DDP step time, 2 ranks, {label}: {torch} (goal <= 0.8)")
    for n, (overlap, why) in sorted(defaults.items()):
        if n == 1:
            continue  # one rank: nothing to overlap
        gains = {b: median_table(r)[n] for b, r in per_batch.items()}
        measured = ", ".join(f"{b}: {ms['overlap off'] / ms['overlap on']:.2f}x"
                             for b, ms in gains.items())
        print(f"  DDP's overlap default on {n} ranks: {why}; measured gain from overlap "
              f"(off / on step time) {measured}: the default is " + ", ".join(
                  f"{verdict(ms, overlap)} at {b}" for b, ms in gains.items()))


def default_scaling(per_batch, defaults):
    """One line after the summary: 2-rank / 1-rank throughput with DDP's default settings (the
    overlap it chooses on each rank count, ``defaults``) at each batch, beside the ceiling of
    the same launches (no communication) and the ratio of the two, with that ratio's range
    over launches."""
    runs = {n: "overlap on" if overlap else "overlap off" for n, (overlap, _) in defaults.items()}

    def scaling(ms, run1, run2):
        return 2 * ms[1][run1] / ms[2][run2]

    def of_ceiling(ms):
        return scaling(ms, runs[1], runs[2]) / scaling(ms, "no comm", "no comm")

    cells, last = [], max(per_batch)
    for batch, repeats in per_batch.items():
        ms = median_table(repeats)
        got, ceiling = scaling(ms, runs[1], runs[2]), scaling(ms, "no comm", "no comm")
        each = [of_ceiling(median_table([r])) for r in repeats]
        missed = ", goal missed" if batch == last and (got < 1.8 or got / ceiling < 0.95) else ""
        cells.append(f"{batch}: {got:.2f}, ceiling {ceiling:.2f}, {got / ceiling:.2f} of it "
                     f"(launches {min(each):.2f}-{max(each):.2f}{missed})")
    print(f"  2-rank / 1-rank throughput, DDP's default settings (1 rank: {runs[1]}, 2 ranks: "
          f"{runs[2]}): " + ", ".join(cells) + f" (goal >= 1.8 and >= 0.95 of the "
          f"no-communication ceiling at {last})")


def verdict(ms, overlap, tie=0.05):
    """Whether the default (``overlap``) was the faster of the two measured steps ``ms``."""
    gain = ms["overlap off"] / ms["overlap on"]
    if abs(gain - 1) <= tie:
        return f"as fast (within {tie:.0%})"
    return "the faster" if (gain > 1) == overlap else "the slower"


def throughput_chart(batch, repeats):
    """Grouped bars: samples/s of each run (no comm, overlap on and off, torch DDP) on each rank
    count, from the median step times over ``repeats`` (one {n: {run: seconds}} per launch)."""
    from minipar import figures

    ms = median_table(repeats)
    runs = list(ms[1])
    series = {f"{n} rank{'s' if n > 1 else ''}": [batch * n * 1e3 / ms[n][name] for name in runs]
              for n in ms}
    return figures.bar_chart(runs, series, ylabel="throughput (samples/s)",
                             xlabel="run", title=f"data-parallel throughput, {batch} samples "
                                                 f"per rank per step (perfect scaling: 2 ranks "
                                                 f"at twice 1 rank's)")


def draw(directory, per_batch):
    """A throughput chart per batch into ``directory``, each path printed (without matplotlib,
    one line on how to get them)."""
    from minipar import figures

    return figures.write_figures(directory, lambda: {
        f"dp_throughput_b{batch}": throughput_chart(batch, repeats)
        for batch, repeats in per_batch.items()})


if __name__ == "__main__":
    main()
