"""Benchmark: one training step (forward, backward, AdamW) in minipar and in PyTorch eager, on CPU.

    python scripts/bench_autograd.py [--repeats 30] [--clock wall|cpu] [--plot DIR]

Two workloads, gpt-block and tiny-mlp, the same shapes in both frameworks, measured in the same
run; then the goals (issues 15 and 27), the engine's efficiency (the GEMM-only time over the
step's) and where minipar's step went (forward, backward, AdamW). PyTorch is optional;
without it its column reads "skipped". The workloads, the goals and the figures:
docs/benchmarks.md.
"""
import argparse
import os
import statistics
import sys
import time

THREADS = "1"
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, THREADS)  # before NumPy and torch load their BLAS

import numpy as np  # noqa: E402  (benchmarks may use NumPy directly)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import minipar  # noqa: E402
import minipar.nn as nn  # noqa: E402
from minipar import backend, optim  # noqa: E402
from minipar import functional as F  # noqa: E402

B, T, C, HEADS = 8, 64, 128, 4
MLP_BATCH, MLP_IN, MLP_HIDDEN, MLP_OUT = 32, 64, 128, 10


def step_times(steps, repeats, warmup=5, desc=None, clock=time.perf_counter):
    """Seconds of each call of each step, ``repeats`` calls each; the steps take turns, so a
    change in the machine's load during the run hits all of them alike. ``desc``: a progress
    label (standard error, terminals only); ``clock``: wall time, or ``time.process_time`` (this
    process's CPU time: on a machine shared with other jobs, what waiting for a core adds to
    the wall time is left out)."""
    from minipar.console import progress

    for step in steps:
        for _ in range(warmup):
            step()
    times = [[] for _ in steps]
    for _ in progress(range(repeats), desc) if desc else range(repeats):
        for step, record in zip(steps, times):
            start = clock()
            step()
            record.append(clock() - start)
    return times


def median_times(steps, repeats, warmup=5):
    """Median seconds per call of each step (step_times')."""
    return [statistics.median(record) for record in step_times(steps, repeats, warmup)]


def charts(results):
    """name -> Figure from ``results`` (workload -> {"minipar": ms list, "PyTorch": ms list or
    None}): the median times side by side, and minipar / PyTorch beside the goal when PyTorch
    was measured."""
    from minipar import figures

    names = list(results)
    median = lambda ms: ms and statistics.median(ms)  # noqa: E731
    series = {"minipar": [median(results[n]["minipar"]) for n in names]}
    if any(results[n]["PyTorch"] for n in names):
        series["PyTorch"] = [median(results[n]["PyTorch"]) for n in names]
    times = figures.bar_chart(
        names, series, xlabel="workload", ylabel="ms per step (median, log scale)",
        title="one training step (forward + backward + AdamW), CPU, median ms"
              + ("" if "PyTorch" in series else " (PyTorch not installed)"))
    times.axes[0].set_yscale("log")  # a GPT block takes 100x the tiny MLP's step
    times.axes[0].legend(loc="upper right")  # above the tiny MLP's short bars
    out = {"autograd_times": times}
    compared = [n for n in names if results[n]["PyTorch"]]
    if compared:
        out["autograd_ratio"] = figures.bar_chart(
            compared, {"minipar / PyTorch": [median(results[n]["minipar"]) /
                                             median(results[n]["PyTorch"]) for n in compared],
                       "goal (at most)": [GOALS[n] for n in compared]},
            title="minipar's step time over PyTorch eager's, beside the goal",
            ylabel="minipar / PyTorch (step time)", xlabel="workload")
    return out


def draw(directory, results):
    """charts(results) into ``directory``, each path printed (without matplotlib, one line on
    how to get them)."""
    from minipar import figures

    return figures.write_figures(directory, lambda: charts(results))


# --- minipar ------------------------------------------------------------------------------------
def minipar_phases():
    """Each workload's step as its three phases, run in turn on one model: zero_grad and the
    forward, backward, AdamW's update (``minipar_steps`` chains them; the summary times each)."""
    rng = np.random.default_rng(0)
    minipar.manual_seed(0)
    block = nn.Block(C, HEADS)
    x = minipar.tensor(rng.standard_normal((B, T, C)).astype(np.float32))
    r = backend.asarray(rng.standard_normal((B, T, C)).astype(np.float32))
    opt_block = optim.AdamW(block.parameters(), lr=1e-4)
    mlp = nn.Sequential(nn.Linear(MLP_IN, MLP_HIDDEN), nn.ReLU(), nn.Linear(MLP_HIDDEN, MLP_OUT))
    xm = minipar.tensor(rng.standard_normal((MLP_BATCH, MLP_IN)).astype(np.float32))
    ym = backend.asarray(rng.integers(0, MLP_OUT, MLP_BATCH))
    opt_mlp = optim.AdamW(mlp.parameters(), lr=1e-4)
    losses = []  # the forward's loss, until backward takes it

    def phases(opt, loss):
        def forward():
            opt.zero_grad()
            losses.append(loss())
        return [forward, lambda: losses.pop().backward(), opt.step]

    return {"gpt-block": phases(opt_block, lambda: (block(x) * r).sum()),
            "tiny-mlp": phases(opt_mlp, lambda: F.cross_entropy(mlp(xm), ym))}


def minipar_steps(phases=None):
    def chained(phases):
        def step():
            for phase in phases:
                phase()
        return step

    return {name: chained(p) for name, p in (phases or minipar_phases()).items()}


def gemm_only():
    """The GPT-block step's matrix products and nothing else, as the engine calls them: each
    Linear (N = B·T rows) forward x Wᵀ, backward g W and gᵀ x; attention per (batch, head)
    q kᵀ and P v, backward Pᵀ dO, dO vᵀ, dS k and dSᵀ q, with q, k, v strided views of c_attn's
    output (B, T, 3C) as in ``minipar.attention``."""
    rng = np.random.default_rng(1)
    xp = backend.xp()

    def rand(*shape):
        return backend.asarray(rng.standard_normal(shape).astype(np.float32))

    N, d, pairs = B * T, C // HEADS, []
    for n_out, n_in in [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]:  # c_attn, c_proj, c_fc, c_proj
        x, w, g = rand(N, n_in), rand(n_out, n_in), rand(N, n_out)
        pairs += [(x, w.T), (g, w), (g.T, x)]
    qkv = rand(B, T, 3, HEADS, d)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    p, ds, do = rand(B, HEADS, T, T), rand(B, HEADS, T, T), rand(B, HEADS, T, d)
    pairs += [(q, k.swapaxes(-1, -2)), (p, v), (p.swapaxes(-1, -2), do), (do, v.swapaxes(-1, -2)),
              (ds, k), (ds.swapaxes(-1, -2), q)]

    def gemms():
        for a, b in pairs:
            xp.matmul(a, b)

    return gemms


# --- PyTorch ------------------------------------------------------------------------------------
def torch_steps(torch):
    TF = torch.nn.functional
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
            self.c_attn, self.attn_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
            self.c_fc, self.c_proj = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)

        def forward(self, x):
            q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, HEADS, C // HEADS).permute(
                2, 0, 3, 1, 4)
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.c_proj(TF.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    block = Block()
    x, r = torch.randn(B, T, C), torch.randn(B, T, C)
    opt_block = torch.optim.AdamW(block.parameters(), lr=1e-4)

    def gpt_block():
        opt_block.zero_grad()
        (block(x) * r).sum().backward()
        opt_block.step()

    mlp = torch.nn.Sequential(torch.nn.Linear(MLP_IN, MLP_HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(MLP_HIDDEN, MLP_OUT))
    xm, ym = torch.randn(MLP_BATCH, MLP_IN), torch.randint(0, MLP_OUT, (MLP_BATCH,))
    opt_mlp = torch.optim.AdamW(mlp.parameters(), lr=1e-4)

    def tiny_mlp():
        opt_mlp.zero_grad()
        TF.cross_entropy(mlp(xm), ym).backward()
        opt_mlp.step()

    return {"gpt-block": gpt_block, "tiny-mlp": tiny_mlp}


GOALS = {"gpt-block": 1.2, "tiny-mlp": 2.0}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
ISSUE_GOALS = {15: ({"gpt-block": 0.9, "tiny-mlp": 0.5}, 0.6),  # issue: (ratios, efficiency)
               27: ({"gpt-block": 0.8, "tiny-mlp": 0.5}, 0.8)}


def goals_of_issue(issue, results, gemm_ms):
    """The lines after the spread: each workload against PyTorch and the issue's goal, then the
    engine efficiency: GEMM-only ms / step ms (PyTorch's step against the same GEMMs beside)."""
    def verdict(ok):
        return "met" if ok else "missed"

    goals, efficiency_goal = ISSUE_GOALS[issue]
    print(f"issue {issue} goals, measured in this run:")
    for name, times in results.items():
        ms = statistics.median(times["minipar"])
        if times["PyTorch"]:
            ratio = ms / statistics.median(times["PyTorch"])
            print(f"  {name:12s} minipar / PyTorch {ratio:5.2f}  (goal <= "
                  f"{goals[name]}: {verdict(ratio <= goals[name])})")
    if "gpt-block" in results and gemm_ms:
        ms = statistics.median(results["gpt-block"]["minipar"])
        torch_ms = results["gpt-block"]["PyTorch"]
        theirs = (f"; PyTorch's step {statistics.median(torch_ms):.2f} ms: "
                  f"{gemm_ms / statistics.median(torch_ms):.2f}") if torch_ms else ""
        print(f"  engine efficiency, gpt-block: GEMMs alone {gemm_ms:.2f} ms / step {ms:.2f} ms "
              f"= {gemm_ms / ms:.2f}  (goal >= {efficiency_goal}: "
              f"{verdict(gemm_ms / ms >= efficiency_goal)}){theirs}")


def where_the_time_went(phases, theirs, repeats, clock, gemm_ms):
    """minipar's step of each workload split into its phases, each timed apart (median ms),
    PyTorch's step run between them as in the table; the GPT block's GEMMs beside."""
    print("where minipar's step went, median ms (each phase timed apart):")
    for name, parts in phases.items():
        steps = parts + ([theirs[name]] if name in theirs else [])
        ms = [1000 * statistics.median(t) for t in step_times(steps, repeats, 0, clock=clock)]
        gemms = (f";  GEMMs alone {gemm_ms:.2f}, the rest {sum(ms[:3]) - gemm_ms:.2f}"
                 if name == "gpt-block" and gemm_ms else "")
        print(f"  {name:12s} forward {ms[0]:.3f}  backward {ms[1]:.3f}  AdamW {ms[2]:.3f}"
              + gemms)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", choices=sorted(GOALS), help="cProfile minipar's step instead")
    parser.add_argument("--plot", metavar="DIR", help="draw the times (and ratios) into DIR")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default) or this process's CPU time (a loaded machine)")
    args = parser.parse_args(argv)
    phases = minipar_phases()
    ours = minipar_steps(phases)
    if args.profile:
        import cProfile
        import pstats

        step = ours[args.profile]
        median_times([step], 3)
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(args.repeats)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        return 0
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        theirs = torch_steps(torch)
    except ImportError:
        torch, theirs = None, {}
    from minipar.console import note_load, spread

    note_load()
    threads = os.environ["OMP_NUM_THREADS"]
    print(f"one training step (forward + backward + AdamW), float32, CPU, {threads} thread(s), "
          f"median of {args.repeats}" + ("" if args.clock == "wall" else ", CPU time"))
    print(f"  gpt-block: (B, T, C) = ({B}, {T}, {C}), {HEADS} heads;  tiny-mlp: batch "
          f"{MLP_BATCH}, {MLP_IN}-{MLP_HIDDEN}-{MLP_OUT}")
    print(f"{'workload':12s} {'minipar ms':>11s} {'PyTorch ms':>11s} {'ratio':>7s} {'goal':>6s}")
    failed, results, gemm_ms = False, {}, None
    for name, step in ours.items():
        steps = [step] + ([theirs[name]] if name in theirs else [])
        steps += [gemm_only()] if name == "gpt-block" else []
        times = [[1000 * t for t in record] for record in step_times(
            steps, args.repeats, desc=name, clock=CLOCKS[args.clock])]
        if name == "gpt-block":
            gemm_ms = statistics.median(times.pop())
        results[name] = {"minipar": times[0], "PyTorch": times[1] if name in theirs else None}
        ms = statistics.median(times[0])
        if name in theirs:
            ref = statistics.median(times[1])
            ratio = ms / ref
            failed |= ratio > GOALS[name]
            print(f"{name:12s} {ms:11.2f} {ref:11.2f} {ratio:7.2f} {GOALS[name]:6.1f}"
                  f"{'' if ratio <= GOALS[name] else '  (missed)'}")
        else:
            print(f"{name:12s} {ms:11.2f} {'skipped':>11s}")
    print(f"ms per step over the {args.repeats} steps, median [min-max]:")
    for name, times in results.items():
        print(f"  {name:12s} minipar {spread(times['minipar'], '{:.2f}')}"
              + (f"   PyTorch {spread(times['PyTorch'], '{:.2f}')}" if times["PyTorch"] else ""))
    goals_of_issue(15, results, gemm_ms)
    goals_of_issue(27, results, gemm_ms)
    where_the_time_went(phases, theirs, args.repeats, CLOCKS[args.clock], gemm_ms)
    if args.plot:
        draw(args.plot, results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
