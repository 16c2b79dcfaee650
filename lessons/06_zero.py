"""Lesson 06: ZeRO: shard the optimizer state and the gradients, keep the same loss curve.

    mpiexec -n 4 python lessons/06_zero.py
    mpiexec -n 2 python lessons/06_zero.py --quick   (a few seconds: the smoke run)

Plain data parallelism keeps a full copy of everything on every rank: for Adam in float32 that is
4 bytes of parameters, 4 of gradients and 8 of optimizer state per parameter, 16 in all, however
many ranks share the work. ZeRO (Rajbhandari et al. 2020) cuts the redundant copies: stage 1
gives each rank 1/N of the optimizer state (it updates only its 1/N of the parameters, then an
all-gather shares them), stage 2 also keeps only 1/N of the reduced gradients. Part 1 measures
the bytes one rank holds, right after backward, for N = 1 .. world size (groups carved out of the
world with ``split``). Part 2 trains a tiny GPT on the Python documentation with plain DDP, ZeRO-1
and ZeRO-2 on all ranks and prints the three loss curves side by side: the same numbers.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import optim
from minipar.data import CharTokenizer, load_text
from minipar.parallel.data import DistributedDataParallel, ZeRO, local_batch_size

from _kit import arguments, check, figure, finish, mpi_world, progress, say

CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
GLOBAL_BATCH = 24  # divides among 1, 2, 3, 4, 6 or 8 ranks
KINDS = ("DP", "ZeRO-1", "ZeRO-2")
PARTS = ("parameters", "gradients", "optimizer_state")


def make(kind, group, vocab):
    """(model, step, zero_grad, memory) functions for plain data parallel or ZeRO stage 1/2."""
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=vocab, **CONFIG))
    adamw = lambda params: optim.AdamW(params, lr=3e-3)  # noqa: E731
    if kind == "DP":
        net = DistributedDataParallel(model, group, bucket_cap_mb=0.25)
        opt = adamw(model.parameters())
        return model, opt.step, opt.zero_grad, lambda: {"parameters": sum(p.data.nbytes for p in
                                                         model.parameters()),
                                         "gradients": net.gradient_bytes(),
                                         "optimizer_state": opt.state_bytes()}
    zero = ZeRO(model, adamw, group, stage=int(kind[-1]), bucket_cap_mb=0.25)
    return model, zero.step, zero.zero_grad, zero.memory_bytes


def global_batch(data, step):
    """The step's global batch, the same on every rank (a seeded generator)."""
    starts = np.random.default_rng(step).integers(0, len(data) - CONFIG["block_size"] - 1,
                                                  GLOBAL_BATCH)
    windows = data[starts[:, None] + np.arange(CONFIG["block_size"] + 1)]
    return windows[:, :-1], windows[:, 1:]


def train_steps(kind, group, data, vocab, steps, desc=None):
    """Losses (mean over the global batch) and this rank's memory after the last backward;
    a progress bar named ``desc`` when given."""
    model, step, zero_grad, memory = make(kind, group, vocab)
    b = local_batch_size(GLOBAL_BATCH, group.size)
    mine = slice(group.rank * b, (group.rank + 1) * b)
    losses = []
    for s in progress(range(steps), desc) if desc else range(steps):
        x, y = global_batch(data, s)
        zero_grad()
        loss = model(x[mine], y[mine])[1]
        loss.backward()
        held = memory()  # after backward, before the step: gradients at their largest
        step()
        losses.append(group.all_reduce(np.array([loss.item()]), op="avg")[0])
    return losses, held


def part1_memory(world, data, vocab):
    held = {}  # (N, kind) -> this rank's bytes (rank 0 is in every group)
    for k in progress(range(1, world.size + 1), "memory for N = 1 ..", total=world.size):
        group = world.split(0 if world.rank < k else 1)
        if world.rank < k:
            for kind in KINDS:
                _, held[k, kind] = train_steps(kind, group, data, vocab, steps=2)  # state after 1
        world.barrier()
    say("Part 1: kB one rank holds after backward (parameters / gradients / optimizer "
        "state), float32 AdamW, tiny GPT")
    say(f"  {'N':>2s}  {'plain DP':>20s}  {'ZeRO-1':>20s}  {'ZeRO-2':>20s}")
    for k in range(1, world.size + 1 if world.rank == 0 else 1):  # rank 0 holds every N
        say(f"  {k:2d}  " + "  ".join(f"{cell:>20s}" for cell in (
            "/".join(f"{held[k, kind][key] / 1e3:.0f}" for key in PARTS) for kind in KINDS)))
    say("  ZeRO-1 divides the optimizer state by N, ZeRO-2 the gradients too; parameters "
        "stay whole (that is stage 3). DP's gradients live in its bucket buffers.")
    return held


def part2_same_curve(world, data, vocab, steps):
    curves = {kind: train_steps(kind, world, data, vocab, steps, desc=f"{kind} training")[0]
              for kind in KINDS}
    say(f"\nPart 2: the loss curve on {world.size} ranks, global batch {GLOBAL_BATCH}")
    say(f"  {'step':>4s} {'plain DP':>10s} {'ZeRO-1':>10s} {'ZeRO-2':>10s}")
    for s in range(0, steps, max(1, steps // 8)):
        say(f"  {s:4d} " + " ".join(f"{curves[k][s]:10.5f}" for k in curves))
    gap = max(abs(a - b) for k in ("ZeRO-1", "ZeRO-2") for a, b in zip(curves["DP"], curves[k]))
    say(f"  largest loss difference from plain DP over {steps} steps: {gap:.1e} "
        f"(float32 rounding)")
    return gap, curves


def theory_bytes(kind, parameters, N):
    """Adam in float32: parameters P, gradients P, optimizer state 2P; ZeRO-1 keeps 1/N of the
    state, ZeRO-2 also 1/N of the gradients (Rajbhandari et al. 2020)."""
    gradients = parameters / N if kind == "ZeRO-2" else parameters
    state = 2 * parameters / (1 if kind == "DP" else N)
    return parameters + gradients + state


def draw_figures(directory, held, curves, N):
    bars = []
    for k in range(1, N + 1):
        for kind in KINDS:
            label = f"{'DP' if kind == 'DP' else kind} N={k}"
            measured = sum(held[k, kind][key] for key in PARTS)
            bars.append((label, measured, theory_bytes(kind, held[k, kind]["parameters"], k)))
    figure(directory, "06_memory", lambda figures: figures.memory_chart(
        bars, title="ZeRO: what one rank holds after backward (parameters + gradients + "
                    "optimizer state)", unit="KiB", xlabel="layout on N ranks"))
    gap = max(abs(a - b) for k in ("ZeRO-1", "ZeRO-2") for a, b in zip(curves["DP"], curves[k]))
    figure(directory, "06_loss", lambda figures: figures.loss_chart(
        {"plain DP": curves["DP"], "ZeRO-1": curves["ZeRO-1"], "ZeRO-2": curves["ZeRO-2"]},
        title=f"ZeRO-1 and ZeRO-2 on {N} ranks: plain DP's loss curve (largest gap {gap:.0e})"))


def main():
    args = arguments(__doc__, plot=True)
    world = mpi_world(__doc__, ranks=(1, 2, 3, 4, 6, 8))
    text = load_text("pydoc")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    held = part1_memory(world, data, tok.vocab_size)
    gap, curves = part2_same_curve(world, data, tok.vocab_size, steps=4 if args.quick else 40)
    N = world.size
    if world.rank == 0:  # it holds the memory of every N
        draw_figures(args.plot, held, curves, N)
    for kind, key in (("ZeRO-1", "optimizer_state"), ("ZeRO-2", "optimizer_state"),
                      ("ZeRO-2", "gradients")):
        ratio, want = held[N, kind][key] / held[N, "DP"][key], 1 / N
        check(f"{kind}: a rank holds 1/N = {want:.3f} of DP's {key.replace('_', ' ')} (± 0.01)",
              abs(ratio - want) <= 0.01, f"{want:.3f} ± 0.01", f"{ratio:.4f}")
    check("ZeRO-1 and ZeRO-2 follow plain DP's loss curve (float32, |diff| < 1e-5)", gap < 1e-5,
          "< 1e-5", f"{gap:.1e}")
    return finish(f"ZeRO keeps 1/{N} of the optimizer state (stage 2: and of the gradients) "
                  f"per rank, with DP's loss curve")


if __name__ == "__main__":
    raise SystemExit(main())
