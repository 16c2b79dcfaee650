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

Read next: minipar/checkpoint.py, then memory.py; proved by tests/test_checkpoint.py.
"""
import math
import statistics
import time

import minipar
from minipar import backend, nn
from minipar.checkpoint import checkpoint_sequential
from minipar.console import spread
from minipar.memory import ActivationMemory

from _kit import arguments, check, figure, finish, note_load, progress

# the measured peak / plain peak against the formula, relative (an absolute 0.05 was half of
# k = 16's 0.099): bytes are counted, not timed, so every run gives the same; measured 0.7-3.8 %
# below the formula at the quick and full sizes; 10 % keeps that margin and fails a peak off
# the formula by a tenth
PEAK_BAND = 0.1


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
                     ("--repeats", 5, "timed steps per setting (median [min-max])"),
                     quick="a tiny, fast configuration", plot=True)
    if args.quick:
        args.layers, args.batch, args.seq, args.width, args.repeats = 4, 2, 8, 16, 3
    n = args.layers
    note_load()
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
    for _, k in settings:  # warm-up: the first step pays for allocations the others reuse
        step(model, x, k)
    fwd = forward_seconds(model, x, args.repeats)
    # Each round times every setting once, back to back: a burst of other work on the machine
    # slows one round, and each setting's overhead is taken against the plain step of its round.
    rounds = [[step(model, x, k) for _, k in settings]
              for _ in progress(range(args.repeats), "timing steps")]
    print(f"{'checkpointing':20s} {'peak MB':>9s} {'of plain':>9s} {'theory':>8s} "
          f"{'step ms':>9s} {'overhead [min-max]':>19s} {'theory':>7s} {'max |dgrad|':>12s}")
    plain_seconds = [r[0][0] for r in rounds]
    plain_peak, plain_grads = rounds[0][0][1], rounds[0][0][2]
    rows = []  # (name, peak bytes, theory bytes, overheads, theory overhead): for the figures
    for i, (name, k) in enumerate(settings):
        seconds = [r[i][0] for r in rounds]
        peak, grads = rounds[0][i][1], rounds[0][i][2]
        if k == 0:
            theory, extra = 1.0, 0.0
        else:
            theory = (k * x_bytes + math.ceil(n / k) * one_block) / (n * one_block)
            recomputed = round((k - 1) * n / k)  # every segment but the last runs twice
            extra = fwd * recomputed / n / statistics.median(plain_seconds)
        overheads = [t / plain - 1 for t, plain in zip(seconds, plain_seconds)]
        diff = max(float(abs(g - p).max()) for g, p in zip(grads, plain_grads))
        overhead = spread(overheads, "{:+.0%}") if k else "(reference)"
        print(f"{name:20s} {peak / 1e6:9.2f} {peak / plain_peak:9.2f} {theory:8.2f} "
              f"{statistics.median(seconds) * 1e3:9.1f} {overhead:>19s} {extra:+7.0%} "
              f"{diff:12.1e}")
        rows.append((name, peak, theory * plain_peak, overheads, extra))
        if k:
            check(f"{name}: the plain run's gradients bit for bit", diff == 0.0, 0.0, diff)
            error = peak / plain_peak / theory - 1
            check(f"{name}: peak / plain peak within {PEAK_BAND:.0%} of (k·x + ⌈n/k⌉·a) / (n·a) "
                  f"= {theory:.3f}", abs(error) <= PEAK_BAND,
                  f"{theory:.3f} ± {PEAK_BAND * theory:.3f}",
                  f"{peak / plain_peak:.3f} ({error:+.1%})")
    print(f"\nplain forward {fwd * 1e3:.1f} ms of a {statistics.median(plain_seconds) * 1e3:.1f} "
          f"ms step: the time theory is the share of the step spent re-running forwards.")
    print(f"overhead: median [min-max] of {args.repeats} rounds, each timing every setting once "
          f"against its own plain step.\nA range wider than the gap to the theory is other work "
          f"on the machine, not the method: time is noisy,\nmemory is not.")
    print("The gradients are bit-for-bit those of the plain run: recomputation replays the same "
          "dropout masks.\nsqrt(n) segments keep a fraction of the plain peak for about one extra "
          "forward pass of time.")
    draw_figures(args.plot, rows)
    return finish(f"{len(settings) - 1} checkpointed runs: the plain gradients, less peak memory")


def draw_figures(directory, rows):
    """Peak memory of each setting beside its theory; step-time overhead, median with its
    [min-max] as a bar, beside the theory."""
    def memory(figures):
        fig = figures.memory_chart([(name, peak, theory) for name, peak, theory, _, _ in rows],
                                   title="Gradient checkpointing: peak activation memory",
                                   unit="MB", xlabel="checkpointing (k segments)")
        fig.axes[0].set_ylabel("peak activation memory (MB)")  # one process: not "per rank"
        return fig
    figure(directory, "02_memory", memory)

    def time_chart(figures):
        rows_k = rows[1:]  # the plain run is the reference: 0 by definition
        medians = [100 * statistics.median(r[3]) for r in rows_k]
        fig = figures.bar_chart([r[0] for r in rows_k],
                                {"measured, median": medians,
                                 "theory": [100 * r[4] for r in rows_k]},
                                title=f"Gradient checkpointing: step time over the plain step "
                                      f"(median of {len(rows[0][3])} rounds)",
                                ylabel="extra step time (%)", xlabel="checkpointing (k segments)")
        bars = fig.axes[0].containers[0]  # the measured bars: add each one's [min-max]
        for i, (bar, median, r) in enumerate(zip(bars, medians, rows_k)):
            low, high = 100 * min(r[3]), 100 * max(r[3])
            fig.axes[0].errorbar(bar.get_x() + bar.get_width() / 2, median,
                                 yerr=[[median - low], [high - median]], color="black",
                                 capsize=4, label=None if i else "min-max of the rounds")
        fig.axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # as bar_chart's
        return fig
    figure(directory, "02_step_time", time_chart)


if __name__ == "__main__":
    raise SystemExit(main())
