"""Lesson 2: gradient checkpointing trades one extra forward pass for O(√n) activation memory.

    python lessons/02_checkpointing.py            (one process; add --quick for a smoke run)

Backward needs what the forward pass saved. For n layers that each save ``a`` bytes the plain
run peaks at about n·a. Chen et al. 2016 keep only the input (x bytes) of each of k segments and
re-run a segment's forward when backward reaches it:

    peak(k) ≈ k·x + (n/k)·a         smallest near k = √n:  about 2·√n·√(x·a)

The price is one more forward per step: with backward ≈ 2× forward, about a third more compute.
This lesson measures all of it on a stack of 16 GPT blocks (with dropout, so the recomputation
has to replay the random stream): peak bytes held for backward, the step time, and the gradients,
which must equal the plain run's exactly.
"""
import math
import statistics
import time

import minipar
from minipar import backend, nn
from minipar.checkpoint import checkpoint_sequential
from minipar.memory import ActivationMemory

from _kit import arguments, check, finish


def forward_seconds(model, x, repeats):
    """The plain forward alone (graph recorded, as in training): what a recomputation costs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step(model, x, segments):
    """One forward+backward; returns (seconds, peak activation bytes, gradients)."""
    model.zero_grad()
    minipar.manual_seed(1234)  # the same dropout masks in every setting
    with ActivationMemory() as mem:
        start = time.perf_counter()
        y = checkpoint_sequential(model, segments, x) if segments else model(x)
        (y * y).mean().backward()
        seconds = time.perf_counter() - start
    return seconds, mem.peak_bytes, [p.grad.copy() for p in model.parameters()]


def main():
    args = arguments(__doc__, ("--layers", 16), ("--batch", 8), ("--seq", 32), ("--width", 64),
                     ("--repeats", 3, "timed steps per setting (median)"),
                     quick="a tiny, fast configuration")
    if args.quick:
        args.layers, args.batch, args.seq, args.width, args.repeats = 4, 2, 8, 16, 1
    n = args.layers
    minipar.manual_seed(0)
    model = nn.Sequential(*[nn.Block(args.width, n_head=4, dropout=0.1) for _ in range(n)])
    x = minipar.randn(args.batch, args.seq, args.width)

    # What one block saves (a) and what one segment input costs (x): the theory's two numbers.
    _, one_block, _ = step(nn.Sequential(model[0]), x, 0)
    x_bytes = x.data.nbytes
    print(f"{n} GPT blocks, width {args.width}, batch {args.batch} x {args.seq} tokens, "
          f"dropout 0.1, {backend.device()}")
    print(f"one block saves a = {one_block / 1e6:.2f} MB for backward; one segment input "
          f"x = {x_bytes / 1e6:.3f} MB\n")

    root = max(1, round(math.sqrt(n)))
    settings = [("none", 0), (f"every layer (k={n})", n), (f"sqrt(n) (k={root})", root)]
    settings += [(f"k={k}", k) for k in (2, n // 2) if k not in (root, n) and 1 < k < n]
    step(model, x, 0)  # warm-up: the first step pays for allocations the others reuse
    fwd = forward_seconds(model, x, args.repeats)
    print(f"{'checkpointing':22s} {'peak MB':>9s} {'of plain':>9s} {'theory':>8s} "
          f"{'step ms':>9s} {'overhead':>9s} {'theory':>7s} {'max |dgrad|':>12s}")
    plain = None
    for name, k in settings:
        results = [step(model, x, k) for _ in range(args.repeats)]
        seconds = statistics.median(r[0] for r in results)
        peak, grads = results[0][1], results[0][2]
        if plain is None:
            plain = (seconds, peak, grads)
            theory, extra = 1.0, 0.0
        else:
            theory = (k * x_bytes + math.ceil(n / k) * one_block) / (n * one_block)
            recomputed = round((k - 1) * n / k)  # every segment but the last runs twice
            extra = fwd * recomputed / n / plain[0]
        diff = max(float(abs(g - p).max()) for g, p in zip(grads, plain[2]))
        print(f"{name:22s} {peak / 1e6:9.2f} {peak / plain[1]:9.2f} {theory:8.2f} "
              f"{seconds * 1e3:9.1f} {seconds / plain[0] - 1:+9.0%} {extra:+7.0%} {diff:12.1e}")
        if k:
            check(f"{name}: the plain run's gradients bit for bit", diff == 0.0, 0.0, diff)
            check(f"{name}: peak / plain peak within 0.05 of (k·x + ⌈n/k⌉·a) / (n·a)",
                  abs(peak / plain[1] - theory) <= 0.05, f"{theory:.2f} ± 0.05",
                  f"{peak / plain[1]:.2f}")
    print(f"\nplain forward {fwd * 1e3:.1f} ms of a {plain[0] * 1e3:.1f} ms step: the time theory "
          f"is the share of the step spent re-running forwards.")
    print("The gradients are bit-for-bit those of the plain run: recomputation replays the same "
          "dropout masks.\nsqrt(n) segments keep a fraction of the plain peak for about one extra "
          "forward pass of time.")
    return finish(f"{len(settings) - 1} checkpointed runs: the plain gradients, less peak memory")


if __name__ == "__main__":
    raise SystemExit(main())
