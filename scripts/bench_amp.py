"""Benchmark: a mixed-precision GPT training step against the float32 step, minipar and PyTorch.

    python scripts/bench_amp.py [--repeats 20] [--quick]

One step (forward, backward, AdamW) of a small GPT in float32, in bf16 (bf16 weights with fp32
masters, autocast) and in fp16 with GradScaler, each as a ratio to float32's time measured in
the same run; PyTorch's float32 and bf16-autocast steps beside them when torch is installed.
On NumPy a 16-bit product is a float32 GEMM on rounded inputs plus the roundings (NumPy has no
bf16 GEMM), so mixed precision costs time here; on a GPU (CuPy) fp16 runs on tensor cores.
What the ratios mean: docs/benchmarks.md.
"""
import argparse
import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before NumPy and torch load their BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import minipar  # noqa: E402
from minipar import backend, nn, optim  # noqa: E402
from minipar.amp import GradScaler, autocast  # noqa: E402

from bench_autograd import median_times  # noqa: E402

# (batch, block, width, layers, heads, vocab)
SHAPES = {"full": (8, 128, 256, 2, 4, 512), "quick": (2, 16, 32, 1, 2, 64)}


def minipar_step(kind, shape):
    """A closure running one training step of the kind: "float32", "bf16", "fp16"."""
    B, T, C, L, H, V = shape
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
    low = {"bf16": minipar.bfloat16, "fp16": minipar.float16}.get(kind)
    if low is not None:
        model.to(low)
    opt = optim.AdamW(model.parameters(), lr=1e-4)
    scaler = GradScaler(enabled=kind == "fp16")
    ids = backend.asarray(np.random.default_rng(0).integers(0, V, (B, T)))

    def step():
        opt.zero_grad()
        with autocast(dtype=low, enabled=low is not None):
            loss = model(ids, ids)[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        backend.synchronize()
    return step


def torch_step(kind, shape):
    """The same step in PyTorch eager, float32 or bf16 autocast on the CPU; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    torch.set_num_threads(1)
    B, T, C, L, H, V = shape
    layer = torch.nn.TransformerEncoderLayer(C, H, 4 * C, dropout=0.0, batch_first=True,
                                             norm_first=True, activation="gelu")
    model = torch.nn.Sequential(torch.nn.Embedding(V, C),
                                torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False),
                                torch.nn.LayerNorm(C), torch.nn.Linear(C, V))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, V, (B, T))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(T)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
            h = model[1](model[0](ids), mask=mask, is_causal=True)
            logits = model[3](model[2](h))
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), ids.view(-1))
        loss.backward()
        opt.step()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, a smoke run")
    args = parser.parse_args(argv)
    shape = SHAPES["quick" if args.quick else "full"]
    kinds = ["float32", "fp16"] + (["bf16"] if backend.device() == "cpu" else [])
    steps = {f"minipar {k}": minipar_step(k, shape) for k in kinds}
    steps.update({f"torch {k}": s for k in ("float32", "bf16")
                  if (s := torch_step(k, shape)) is not None})
    times = dict(zip(steps, median_times(list(steps.values()), args.repeats, warmup=3)))
    print(f"bench_amp: GPT step (B, T, C, layers, heads, vocab) = {shape} on "
          f"{backend.device()}, median of {args.repeats}")
    print(f"  {'step':18s} {'ms':>9s} {'x its float32':>14s}")
    for name, seconds in times.items():
        base = times[name.split()[0] + " float32"]
        print(f"  {name:18s} {seconds * 1e3:9.2f} {seconds / base:14.2f}")
    if backend.device() == "cpu":
        print("  NumPy has no 16-bit GEMM: minipar's 16-bit products are float32 GEMMs on rounded "
              "inputs plus the roundings,\n  so mixed precision buys memory and bytes here, not "
              "time; torch's bf16 column shows what a bf16 kernel gives.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
