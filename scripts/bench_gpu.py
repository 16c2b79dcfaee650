"""GPU benchmark: a GPT training step against PyTorch, all-reduce on GPU buffers, the 3D demo.

    python scripts/bench_gpu.py                  (on a GPU: the three parts, a few minutes)
    python scripts/bench_gpu.py --parts step     (some of: step, allreduce, demo)
    python scripts/bench_gpu.py --cpu            (a smoke run of the same code on NumPy, tiny sizes)

Without a GPU (CuPy that sees a device) it says so in one line and exits 0. The parts (step,
allreduce, demo) and what each measures: docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import subprocess
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before NumPy and torch load their BLAS (the smoke run)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# (B, T, C, layers, heads, vocab): GPT-2 small's width, 4 layers; and a smoke size
GPT_SHAPES = {"gpu": (8, 256, 768, 4, 12, 8192), "cpu": (2, 16, 32, 2, 4, 64)}
SIZES = {"gpu": "4096,262144,4194304,67108864", "cpu": "4096,65536"}  # all-reduce bytes
GOAL = 1.5


def median_times(steps, repeats, sync):
    """Median seconds of each step, each timed to a device synchronise; the steps take turns
    (bench_autograd.median_times, with the synchronise that GPU timing needs)."""
    from bench_autograd import median_times as cpu_median_times

    return cpu_median_times([lambda step=step: (step(), sync()) for step in steps], repeats, 3)


# --- step: minipar against PyTorch -------------------------------------------------------------
def minipar_step(shape):
    import numpy as np

    import minipar
    from minipar import backend, nn, optim

    B, T, C, L, H, V = shape
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
    rng = np.random.default_rng(0)
    ids = backend.asarray(rng.integers(0, V, (B, T)))
    targets = backend.asarray(rng.integers(0, V, (B, T)))
    opt = optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        model(ids, targets)[1].backward()
        opt.step()
    return step


def torch_step(torch, shape, device):
    """The same GPT in PyTorch (nanoGPT's layout, scaled_dot_product_attention)."""
    B, T, C, L, H, V = shape
    nn, TF = torch.nn, torch.nn.functional
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.c_proj(TF.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    model = nn.Sequential(*[Block() for _ in range(L)], nn.LayerNorm(C),
                          nn.Linear(C, V, bias=False)).to(device)
    wte, wpe = nn.Embedding(V, C).to(device), nn.Embedding(T, C).to(device)
    ids = torch.randint(0, V, (B, T), device=device)
    targets = torch.randint(0, V, (B, T), device=device)
    pos = torch.arange(T, device=device)
    params = [*model.parameters(), *wte.parameters(), *wpe.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        opt.zero_grad()
        logits = model(wte(ids) + wpe(pos))
        TF.cross_entropy(logits.view(B * T, V), targets.view(B * T)).backward()
        opt.step()
    return step


def part_step(device, repeats):
    from minipar import backend

    shape = GPT_SHAPES[device]
    ours = minipar_step(shape)
    print(f"\nGPT training step (forward + backward + AdamW), float32, (B, T, C, layers, heads, "
          f"vocab) = {shape}, median of {repeats}")
    try:
        import torch
        if device == "cpu":  # one thread, as minipar's NumPy gets (OMP_NUM_THREADS below)
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        theirs = torch_step(torch, shape, "cuda" if device == "gpu" else "cpu")

        def sync():
            backend.synchronize()
            if device == "gpu":
                torch.cuda.synchronize()
    except ImportError:
        theirs, sync = None, backend.synchronize
    if theirs is None:
        ms = 1e3 * median_times([ours], repeats, sync)[0]
        print(f"  minipar {ms:.2f} ms; PyTorch skipped (not installed)")
        return True
    ms, ref = (1e3 * t for t in median_times([ours, theirs], repeats, sync))
    ratio = ms / ref
    judged = device == "gpu"  # a smoke run's ratio measures Python overhead, not the GPU path
    print(f"  minipar {ms:.2f} ms, PyTorch {ref:.2f} ms: ratio {ratio:.2f} (goal <= {GOAL}"
          f"{'' if judged else ', judged on a GPU only'})"
          f"{'  (missed)' if judged and ratio > GOAL else ''}")
    return not judged or ratio <= GOAL


# --- allreduce: busbw on device buffers, CUDA-aware, staged, MPI's own --------------------------
def worker_allreduce(sizes, repeats):
    """On every rank (under mpiexec): busbw of each algorithm and size; rank 0 prints RESULT."""
    from minipar import backend, comm
    from minipar.comm import fit, staging

    world = comm.world()
    xp, p = backend.xp(), world.size
    rows = []
    for nbytes in sizes:
        x = xp.ones(max(1, nbytes // 4), dtype="float32")
        out = xp.empty_like(x)
        for algorithm in ("ring", "mpi"):
            for _ in range(2):
                world.all_reduce(x, algorithm=algorithm, out=out)
            before = staging.stats()["bytes_to_host"]

            def calls():  # back to back after one barrier: the time of a call is their mean
                for _ in range(repeats):
                    world.all_reduce(x, algorithm=algorithm, out=out)
            slowest = fit.timed(world, calls, 1, warmup=0) / repeats
            staged = (staging.stats()["bytes_to_host"] - before) / repeats
            assert float(backend.to_numpy(out[:1])[0]) == p
            rows.append([algorithm, x.nbytes, float(slowest), staged])
    if world.rank == 0:
        print("RESULT " + json.dumps({"rows": rows, "aware": world.is_cuda_aware(),
                                      "device": backend.device(), "ranks": p}), flush=True)


def launch(nprocs, args, env):
    """Run this script's worker on ``nprocs`` ranks; rank 0's RESULT, or None with why."""
    from minipar.testing import RANK_ENV, launch_command

    env = {**os.environ, **RANK_ENV, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    command = launch_command(nprocs, sys.executable, os.path.abspath(__file__), *args)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    found = [s for s in done.stdout.splitlines() if s.startswith("RESULT ")]
    if done.returncode or not found:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return None, f"exit {done.returncode}: " + " | ".join(tail)
    return json.loads(found[0][len("RESULT "):]), None


def part_allreduce(device, args):
    from minipar.bench import busbw  # nccl-tests' bus bandwidth, as minipar bench prints it

    p = args.ranks
    print(f"\nall-reduce on {p} ranks, {device} buffers: bus bandwidth GB/s (2(p-1)/p bytes / "
          f"time of the slowest rank, {args.repeats} calls); staged = MINIPAR_CUDA_AWARE=0")
    worker = ["--worker", "--sizes", args.sizes, "--repeats", str(args.repeats)]
    base = {"MINIPAR_DEVICE": device}
    runs = {"aware": launch(p, worker, base), "staged": launch(p, worker, {
        **base, "MINIPAR_CUDA_AWARE": "0"})}
    failed = [f"{mode}: {why}" for mode, (result, why) in runs.items() if result is None]
    if runs["aware"][0] and not runs["aware"][0]["aware"]:
        runs["aware"] = (None, "MPI is not CUDA-aware here (minipar doctor says why)")
    table = {}
    for mode, (result, why) in runs.items():
        if result is None:
            print(f"  {mode}: not measured: {why}")
            continue
        for algorithm, nbytes, seconds, staged in result["rows"]:
            table.setdefault(nbytes, {})[f"{algorithm} {mode}"] = (busbw(nbytes, seconds, p),
                                                                   staged)
    columns = [f"{a} {m}" for m in ("aware", "staged") for a in ("ring", "mpi")]
    print(f"  {'bytes':>10s}" + "".join(f"{c:>14s}" for c in columns) + "   staged bytes/call")
    for nbytes, cells in sorted(table.items()):
        row = "".join(f"{cells[c][0]:14.3f}" if c in cells else f"{'-':>14s}" for c in columns)
        staged = cells.get("ring staged", (0, 0))[1]
        print(f"  {nbytes:10d}{row}   {staged:.0f}")
    return not failed


# --- demo: the 3D lesson's step time ------------------------------------------------------------
def part_demo(device, args):
    from minipar.testing import RANK_ENV, launch_command

    lesson = os.path.join(ROOT, "lessons", "11_3d_parallel.py")
    extra = ["--quick"] if device == "cpu" else ["--steps", str(args.demo_steps)]
    command = launch_command(args.demo_ranks, sys.executable, lesson, *extra)
    env = {**os.environ, **RANK_ENV, "MINIPAR_DEVICE": device}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    found = re.search(r"(\d+) ms per step", done.stdout)
    header = done.stdout.splitlines()[:1]
    print(f"\n3D demo (lessons/11, {args.demo_ranks} ranks, {' '.join(extra)}): "
          + (f"{found.group(1)} ms per step" if found and not done.returncode else
             f"failed (exit {done.returncode}): {(done.stdout + done.stderr)[-400:]}"))
    if header:
        print(f"  {header[0]}")
    return bool(found) and not done.returncode


def describe(device):
    """One line: the GPU (or the CPU smoke run), CuPy, PyTorch and the MPI library."""
    from mpi4py import MPI

    from minipar import backend

    parts = ["device cpu (a smoke run: tiny sizes, NumPy)"]
    if device == "gpu":
        cupy = backend.xp()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        parts = [f"GPU {name.decode() if isinstance(name, bytes) else name} "
                 f"(x{cupy.cuda.runtime.getDeviceCount()})", f"CuPy {cupy.__version__}"]
    try:
        import torch
        parts.append(f"PyTorch {torch.__version__}")
    except ImportError:
        parts.append("PyTorch not installed")
    parts.append(" ".join(MPI.Get_library_version().split()[:3]))
    print("; ".join(parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="smoke run on NumPy, tiny sizes")
    parser.add_argument("--parts", default="step,allreduce,demo")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the all-reduce part")
    parser.add_argument("--sizes", help="all-reduce sizes in bytes, comma-separated")
    parser.add_argument("--demo-ranks", type=int, default=4)
    parser.add_argument("--demo-steps", type=int, default=40)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from minipar import backend

    if args.cpu:
        backend.set_device("cpu")
        os.environ["MINIPAR_DEVICE"] = "cpu"
    device = backend.device()
    args.sizes = args.sizes or SIZES["cpu" if device == "cpu" else "gpu"]
    if args.worker:
        return worker_allreduce([int(s) for s in args.sizes.split(",")], args.repeats)
    if device != "gpu" and not args.cpu:
        print("bench_gpu: no GPU here (CuPy with a CUDA device): nothing measured; "
              "--cpu runs a smoke test of the same code on NumPy")
        return 0
    if args.cpu:
        args.repeats = min(args.repeats, 3)
    describe(device)
    parts = {"step": lambda: part_step(device, args.repeats),
             "allreduce": lambda: part_allreduce(device, args),
             "demo": lambda: part_demo(device, args)}
    ok = [parts[name]() for name in args.parts.split(",")]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
