"""The planner against measurement: step time of small GPTs trained for real, beside the prediction.

    python scripts/bench_plan.py            (a few minutes: 1, 2, 4 and 8 ranks)
    python scripts/bench_plan.py --quick    (a smoke run: a smaller GPT, 3 steps, no 8 ranks)

For each layout (serial, DP, ZeRO-1/2/3, TP, PP with 1F1B, GPipe, interleaved, ZB-H1 and ZB-V,
CP, 3D, 4D with experts) one mpiexec launch per rank count trains the GPT with minipar's own
wrappers, one BLAS thread per rank, and times the median step of the slowest rank; beside it
``minipar.plan.time.predict`` with ``hardware.profile("here")`` (the engine measured now; the
α-β-γ fitted in the launch, what a collective waits for ranks coming from work,
``hardware.sync_seconds``, and how much slower the ranks compute together than one alone,
``hardware.contention``), and predicted / measured. Where a layout separates them: DP's compute
(a step without its all-reduce) and a pipeline's bubble (the runtime's trace). The summary line
counts the layouts within 0.75-1.33. Ranks beyond the cores share them: docs/plan.md.
"""
import argparse
import json
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    # one BLAS thread, as each rank runs: the here profile times the engine in this process
    os.environ.setdefault(_var, "1")
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOAL = (0.75, 1.33)
# name -> (ranks, the planner's layout sizes, micro-batches m); every layout trains on the same
# global batch, fp32, no recompute (minipar recomputes nothing unless asked)
LAYOUTS = {
    "serial": (1, dict(), 1),
    "DP 2": (2, dict(dp=2), 1),
    "TP 2": (2, dict(tp=2), 1),
    "PP 2 1F1B": (2, dict(pp=2, schedule="1f1b"), 4),
    "PP 2 GPipe": (2, dict(pp=2, schedule="gpipe"), 4),
    "PP 2 interleaved": (2, dict(pp=2, schedule="interleaved", chunks=2), 4),
    "PP 2 ZB-H1": (2, dict(pp=2, schedule="zb-h1"), 4),
    "PP 2 ZB-V": (2, dict(pp=2, schedule="zb-v"), 4),
    "CP 2": (2, dict(cp=2), 1),
    "DP 4": (4, dict(dp=4), 1),
    "ZeRO-1 4": (4, dict(dp=4, zero=1), 1),
    "ZeRO-2 4": (4, dict(dp=4, zero=2), 1),
    "ZeRO-3 4": (4, dict(dp=4, zero=3), 1),
    "3D tp2 pp2 dp2": (8, dict(tp=2, pp=2, dp=2, schedule="1f1b"), 4),
    # the GPT with a mixture of 4 experts (top 2) in each block, the 4D trainer
    "4D ep2 dp4": (4, dict(dp=4, ep=2, experts=4, top_k=2), 1),
    "4D ep2 pp2 dp2": (4, dict(pp=2, dp=2, ep=2, experts=4, top_k=2, schedule="1f1b"), 4),
}
MOE = ("experts", "top_k")  # a layout's sizes that are the model's
MODELS = {  # layers, hidden, heads, seq, vocab, global batch
    "default": (4, 64, 4, 64, 256, 16),
    "quick": (4, 32, 2, 16, 64, 8),
}
FIT_SIZES = tuple(1 << k for k in range(12, 22))  # 4 KiB ... 2 MiB: the gradients' sizes here


# ----------------------------------------------------------------------------------------------
# The rank side: python scripts/bench_plan.py --worker ... (under mpiexec)
# ----------------------------------------------------------------------------------------------

def batch(model, step):
    """The global batch (ids, targets) of ``step``, the same on every rank."""
    import numpy as np
    layers, hidden, heads, seq, vocab, size = model
    x = np.random.default_rng(step).integers(0, vocab, (size, seq + 1))
    return x[:, :-1], x[:, 1:]


def config(model):
    from minipar import nn
    layers, hidden, heads, seq, vocab, _ = model
    return nn.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads,
                        n_embd=hidden, dropout=0.0)


def adamw(params):
    from minipar import optim
    return optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def data_parallel_steps(world, model, sizes):
    """(step, step without communication or None): DDP (zero 0) or ZeRO-1/2/3 over the world,
    each rank on its dp-th of the global batch."""
    import minipar
    from minipar import backend, nn
    from minipar.parallel.data import DistributedDataParallel, ZeRO, ZeRO3

    minipar.manual_seed(0)
    gpt = nn.GPT(config(model))
    ids, targets = (backend.asarray(a[world.rank::world.size]) for a in batch(model, 0))
    zero = sizes.get("zero", 0)
    if zero == 0:
        net, opt = DistributedDataParallel(gpt, world), adamw(gpt.parameters())
    elif zero == 3:
        net, opt = gpt, ZeRO3(gpt, adamw, world)
    else:
        net, opt = gpt, ZeRO(gpt, adamw, world, stage=zero)

    def step():
        opt.zero_grad()
        net(ids, targets)[1].backward()
        opt.step()

    def no_comm():  # DDP's compute alone: the gradients stay local, AdamW steps on them
        opt.zero_grad()
        with net.no_sync():
            net(ids, targets)[1].backward()
        opt.step()
    return step, (no_comm if zero == 0 else None)


def trainer_steps(world, model, sizes, m):
    """(step, the trainer): Trainer3D with sequence parallelism under tp (as the planner
    assumes), or Trainer4D where the layout has experts."""
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig

    groups = ParallelGroups(world, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1),
                            cp=sizes.get("cp", 1), ep=sizes.get("ep", 1))
    common = dict(schedule=sizes.get("schedule", "1f1b"), microbatches=m,
                  chunks=sizes.get("chunks"), make_optimizer=adamw,
                  sequence_parallel=sizes.get("tp", 1) > 1)
    run = (Trainer4D(config(model), MoEConfig(sizes["experts"], sizes["top_k"]), groups,
                     **common) if "experts" in sizes else
           Trainer3D(config(model), groups, **common))
    ids, targets = batch(model, 0)
    return (lambda: run.step(ids, targets)), run


def serial_step(model):
    import minipar
    from minipar import backend, nn

    minipar.manual_seed(0)
    gpt = nn.GPT(config(model))
    opt = adamw(gpt.parameters())
    ids, targets = (backend.asarray(a) for a in batch(model, 0))

    def step():
        opt.zero_grad()
        gpt(ids, targets)[1].backward()
        opt.step()
    return step


def measured_bubble(run, step):
    """The bubble of one more step, traced (the timed steps are not: the tracer's barrier
    would add a wait), idle time over the makespan averaged over the ranks of this rank's
    pipeline, on its first stage's rank (world rank 0's among them)."""
    from minipar.parallel.pipeline import bubble_fraction
    from minipar.parallel.pipeline.timeline import gather_events
    run.pipe.trace = True
    step()
    events = gather_events(run.groups.pipeline, run.pipe.events)
    return None if events is None else bubble_fraction(events, run.schedule.ranks)


def cpu_timed(world, step, steps):
    """The median over ``steps`` of the busiest rank's CPU seconds in one step: what the step
    costs where the ranks are not descheduled by other jobs (a waiting rank polls, so its
    waits count too), a reading that a loaded machine inflates less than the wall clock."""
    spent = []
    for _ in range(steps):
        world.barrier()
        t0 = time.process_time()
        step()
        spent.append(max(world.all_gather_object(time.process_time() - t0)))
    return statistics.median(spent)


def worker(model, names, steps):
    """On rank 0, RESULT {layout: {median, best, cpu, compute, bubble}} (seconds per step of
    the slowest rank; compute and bubble None where the layout does not separate them) and FIT,
    the α-β-γ fitted over the world, ``sync_seconds`` and ``contention`` (none on one rank)."""
    from minipar import comm
    from minipar.comm import fit

    world = comm.world()
    fitted = None
    if world.size > 1:
        from minipar.plan.hardware import contention, sync_seconds
        m = fit.fit(world, sizes=FIT_SIZES, rounds=2, retries=1)
        fitted = [m.alpha, m.betas, m.gammas, m.alphas, sync_seconds(world), contention(world)]
    results = {}
    for name in names:
        ranks, sizes, micro = LAYOUTS[name]
        extra, run = None, None
        if ranks == 1:
            step = serial_step(model)
        elif {"tp", "pp", "cp", "ep"} & set(sizes):
            step, run = trainer_steps(world, model, sizes, micro)
        else:
            step, extra = data_parallel_steps(world, model, sizes)
        step()  # warm-up: optimizer state, buffers, the channels' first messages
        times = fit.timed(world, step, steps, warmup=1, statistic=list)
        row = {"median": statistics.median(times), "best": min(times),
               "cpu": cpu_timed(world, step, steps), "compute": None, "bubble": None}
        if extra is not None:
            row["compute"] = statistics.median(fit.timed(world, extra, steps, warmup=1,
                                                         statistic=list))
        if run is not None and sizes.get("pp", 1) > 1:
            fraction = measured_bubble(run, step)
            row["bubble"] = None if fraction is None else fraction * row["median"]
        results[name] = row
    if world.rank == 0:
        print("FIT " + json.dumps(fitted), flush=True)
        print("RESULT " + json.dumps(results), flush=True)


# ----------------------------------------------------------------------------------------------
# The driver: one mpiexec launch per rank count, the prediction beside each row, the table
# ----------------------------------------------------------------------------------------------

def launch(ranks, names, model, steps):
    """({layout: measured row}, the fitted cost.Model or None) of one ``mpiexec -n ranks``."""
    from minipar.comm import cost
    from minipar.testing import RANK_ENV, mpiexec

    env = {**os.environ, **RANK_ENV}
    if ranks > os.cpu_count():  # waiting ranks yield their core to the working ones
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    command = [mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__),
               "--worker", "--model", ",".join(map(str, model)), "--steps", str(steps),
               "--layouts", json.dumps(names)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    lines = {s.split(" ", 1)[0]: s.split(" ", 1)[1] for s in out.stdout.splitlines()
             if s.startswith(("RESULT ", "FIT "))}
    if out.returncode or "RESULT" not in lines:
        raise RuntimeError(f"mpiexec -n {ranks} failed:\n{out.stdout}\n{out.stderr}")
    fitted = json.loads(lines["FIT"])
    if fitted is not None:
        alpha, betas, gammas, alphas, sync, crowded = fitted
        fitted = cost.Model(alpha, {int(k): v for k, v in betas.items()},
                            {int(k): v for k, v in gammas.items()}, alphas)
        # what a collective waits for ranks coming from work, and how much slower the ranks
        # compute beside each other than one alone (hardware.py)
        fitted.sync, fitted.contention = sync, crowded
    return json.loads(lines["RESULT"]), fitted


def predicted(name, model, profile):
    """``plan.time.predict`` of layout ``name`` on ``profile``, one node of its ranks."""
    from minipar.plan.models import GPTShape
    from minipar.plan.time import Cluster, Layout, predict

    layers, hidden, heads, seq, vocab, size = model
    ranks, sizes, m = LAYOUTS[name]
    dp = sizes.get("dp", 1)
    layout = Layout(micro_batch=size // (dp * m), recompute="none", precision="fp32",
                    **{k: v for k, v in sizes.items() if k not in MOE})
    shape = GPTShape(layers, hidden, heads, seq, vocab, **{k: sizes[k] for k in MOE if k in sizes})
    return predict(shape, layout, Cluster(ranks, ranks, profile), size)


def rows(measured, fits, model):
    """One row per layout: measured and predicted seconds by kind, and predicted / measured."""
    import dataclasses

    from minipar.plan import hardware

    here = hardware.here()
    out = []
    for name, got in measured.items():
        ranks = LAYOUTS[name][0]
        fitted = fits.get(ranks)
        engine = dataclasses.replace(here.engine, contention=getattr(fitted, "contention", None))
        profile = dataclasses.replace(here, fitted=fitted or here.fitted, engine=engine,
                                      sync=getattr(fitted, "sync", 0.0))
        p = predicted(name, model, profile)["time_s"]
        out.append({"layout": name, "ranks": ranks, **{f"measured_{k}": v for k, v in got.items()},
                    "predicted": p["total"], "predicted_compute": p["compute"],
                    "predicted_comm": p["comm"], "predicted_bubble": p["bubble"],
                    "ratio": p["total"] / got["median"]})
    return out, here


def ms(value):
    return "-" if value is None else f"{1e3 * value:.1f}"


def report(table, here, model, steps, load, fits):
    layers, hidden, heads, seq, vocab, size = model
    engine = here.engine
    print(f"GPT {layers} layers, hidden {hidden}, {heads} heads, seq {seq}, vocab {vocab}, "
          f"global batch {size}, fp32; median of {steps} steps of the slowest rank; "
          f"{os.cpu_count()} cores, load average {' -> '.join(f'{x:.1f}' for x in load)}")
    print(f"here: GEMMs timed at the model's shapes (256^3: {here.peak('fp32') / 1e9:.1f} "
          f"GFLOP/s), {1e3 * engine.layer:.2f} ms a Block's ops, {1e9 * engine.activation:.2f} "
          f"ns per activation byte; {engine.cores} cores, a rank's compute x how much slower "
          f"the ranks compute together than one alone (turns alone: x max(1, ranks/"
          f"{engine.cores}))")
    alphas = ", ".join(f"{ranks} ranks {1e6 * model.alpha:.0f} + {1e6 * model.sync:.0f}"
                       for ranks, model in sorted(fits.items()) if model is not None)
    print(f"alpha + sync fitted in each launch (µs a collective): {alphas or '-'}")
    crowded = ", ".join(f"{ranks} ranks x {model.contention:.2f}"
                        for ranks, model in sorted(fits.items()) if model is not None)
    print(f"contention measured in each launch (a Block's step together / alone): "
          f"{crowded or '-'}")
    print(f"{'layout':18s}{'ranks':>6s}{'measured ms':>13s}{'best':>8s}{'cpu':>8s}"
          f"{'compute':>9s}"
          f"{'bubble':>8s} | {'predicted':>9s}{'compute':>9s}{'comm':>7s}{'bubble':>8s}"
          f"{'pred/meas':>11s}")
    for r in table:
        flag = "" if GOAL[0] <= r["ratio"] <= GOAL[1] else "  outside"
        print(f"{r['layout']:18s}{r['ranks']:6d}{ms(r['measured_median']):>13s}"
              f"{ms(r['measured_best']):>8s}{ms(r['measured_cpu']):>8s}"
              f"{ms(r['measured_compute']):>9s}"
              f"{ms(r['measured_bubble']):>8s} | {ms(r['predicted']):>9s}"
              f"{ms(r['predicted_compute']):>9s}{ms(r['predicted_comm']):>7s}"
              f"{ms(r['predicted_bubble']):>8s}{r['ratio']:>11.2f}{flag}")
    within = sum(GOAL[0] <= r["ratio"] <= GOAL[1] for r in table)
    print(f"summary: {within} of {len(table)} layouts predicted within {GOAL[0]}-{GOAL[1]} of "
          f"the measured median step time (--profile here)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: the quick GPT, 3 steps, up to 4 ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--layouts", default=None,
                        help="comma-separated layout names (default all; --quick: no 8 ranks)")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model = tuple(int(v) for v in args.model.split(","))
        return worker(model, json.loads(args.layouts), args.steps)
    model = MODELS["quick" if args.quick else "default"]
    steps = 3 if args.quick else args.steps
    names = (args.layouts.split(",") if args.layouts else
             [n for n in LAYOUTS if not (args.quick and LAYOUTS[n][0] > 4)])
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    from minipar.console import progress

    load, measured, fits = [os.getloadavg()[0]], {}, {}
    counts = sorted({LAYOUTS[n][0] for n in names})
    for ranks in progress(counts, "mpiexec launches"):
        here = [n for n in names if LAYOUTS[n][0] == ranks]
        got, fits[ranks] = launch(ranks, here, model, steps)
        measured.update(got)
        load.append(os.getloadavg()[0])
    table, here = rows({n: measured[n] for n in names}, fits, model)
    report(table, here, model, steps, load, fits)
    if args.json:
        print(json.dumps(table))


if __name__ == "__main__":
    main()
