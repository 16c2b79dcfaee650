"""Benchmark: one training step (forward, backward, AdamW) in minipar and in PyTorch eager, on CPU.

    python scripts/bench_autograd.py [--repeats 30] [--threads 1]

Two workloads, the same shapes in both frameworks, float32, measured in the same run (warm-up,
then the median of ``--repeats`` steps):

    gpt-block   one GPT-2 block (pre-LN, 4 heads) on x of shape (B, T, C) = (8, 64, 128), loss
                = Σ block(x) ⊙ r for a fixed r: the shape the pipeline and tensor lessons use
    tiny-mlp    Linear(64, 128) -> ReLU -> Linear(128, 10), batch 32, cross-entropy: so small
                that per-op Python overhead is all that is measured

Goals: minipar / PyTorch ≤ 1.2 for the GPT block, ≤ 2.0 for the tiny MLP. PyTorch is optional
(``pip install torch``); without it its column reads "skipped".
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


def median_times(steps, repeats, warmup=5):
    """Median seconds per call of each step; the steps take turns, so a change in the machine's
    load during the run hits all of them alike."""
    for step in steps:
        for _ in range(warmup):
            step()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for step, record in zip(steps, times):
            start = time.perf_counter()
            step()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]


# --- minipar ------------------------------------------------------------------------------------
def minipar_steps():
    rng = np.random.default_rng(0)
    minipar.manual_seed(0)
    block = nn.Block(C, HEADS)
    x = minipar.tensor(rng.standard_normal((B, T, C)).astype(np.float32))
    r = backend.asarray(rng.standard_normal((B, T, C)).astype(np.float32))
    opt_block = optim.AdamW(block.parameters(), lr=1e-4)

    def gpt_block():
        opt_block.zero_grad()
        (block(x) * r).sum().backward()
        opt_block.step()

    mlp = nn.Sequential(nn.Linear(MLP_IN, MLP_HIDDEN), nn.ReLU(), nn.Linear(MLP_HIDDEN, MLP_OUT))
    xm = minipar.tensor(rng.standard_normal((MLP_BATCH, MLP_IN)).astype(np.float32))
    ym = backend.asarray(rng.integers(0, MLP_OUT, MLP_BATCH))
    opt_mlp = optim.AdamW(mlp.parameters(), lr=1e-4)

    def tiny_mlp():
        opt_mlp.zero_grad()
        F.cross_entropy(mlp(xm), ym).backward()
        opt_mlp.step()

    return {"gpt-block": gpt_block, "tiny-mlp": tiny_mlp}


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", choices=sorted(GOALS), help="cProfile minipar's step instead")
    args = parser.parse_args(argv)
    ours = minipar_steps()
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
    threads = os.environ["OMP_NUM_THREADS"]
    print(f"one training step (forward + backward + AdamW), float32, CPU, {threads} thread(s), "
          f"median of {args.repeats}")
    print(f"  gpt-block: (B, T, C) = ({B}, {T}, {C}), {HEADS} heads;  tiny-mlp: batch "
          f"{MLP_BATCH}, {MLP_IN}-{MLP_HIDDEN}-{MLP_OUT}")
    print(f"{'workload':12s} {'minipar ms':>11s} {'PyTorch ms':>11s} {'ratio':>7s} {'goal':>6s}")
    failed = False
    for name, step in ours.items():
        if name in theirs:
            ms, ref = (1000 * t for t in median_times([step, theirs[name]], args.repeats))
            ratio = ms / ref
            failed |= ratio > GOALS[name]
            print(f"{name:12s} {ms:11.2f} {ref:11.2f} {ratio:7.2f} {GOALS[name]:6.1f}"
                  f"{'' if ratio <= GOALS[name] else '  (missed)'}")
        else:
            ms = 1000 * median_times([step], args.repeats)[0]
            print(f"{name:12s} {ms:11.2f} {'skipped':>11s}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
