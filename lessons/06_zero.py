"""Lesson 06: ZeRO: shard the optimizer state, the gradients, then the parameters; same loss.

    mpiexec -n 4 python lessons/06_zero.py
    mpiexec -n 2 python lessons/06_zero.py --quick   (a few seconds: the smoke run)

Plain data parallelism keeps a full copy of everything on every rank: for Adam in float32 that is
4 bytes of parameters, 4 of gradients and 8 of optimizer state per parameter, 16 in all, however
many ranks share the work. ZeRO (Rajbhandari et al. 2020) cuts the redundant copies: stage 1
gives each rank 1/N of the optimizer state (it updates only its 1/N of the parameters, then an
all-gather shares them), stage 2 also keeps only 1/N of the reduced gradients, and stage 3
(fully sharded data parallel, ``ZeRO3``) keeps only 1/N of the parameters as well: each layer is
all-gathered just before its forward (the next layer's gather already under way), freed, gathered
again for its backward, and its gradient reduce-scattered. Part 1 measures the bytes one rank
holds, right after backward, for N = 1 .. world size (groups carved out of the world with
``split``). Part 2 trains a tiny GPT on the Python documentation with plain DDP and ZeRO-1, 2, 3
on all ranks and prints the loss curves side by side: the same numbers. Part 3 counts the bytes
each rank sends per step (the communicator's counters): stages 1 and 2 send what plain DP sends,
2 (N-1)/N of the parameters (a reduce-scatter plus an all-gather is an all-reduce); stage 3
gathers twice, 3 (N-1)/N: 1.5x, the price of holding 1/N of everything.

Read next: minipar/parallel/data/zero.py, then zero3.py; proved by tests/test_zero.py and
tests/test_zero3.py.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import optim
from minipar.data import CharTokenizer, load_text
from minipar.parallel.data import DistributedDataParallel, ZeRO, ZeRO3, local_batch_size

from _kit import arguments, check, figure, finish, mpi_world, progress, say

CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
GLOBAL_BATCH = 24  # divides among 1, 2, 3, 4, 6 or 8 ranks
KINDS = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
COPIES = {"DP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}  # x (N-1)/N of the parameters sent
PARTS = ("parameters", "gradients", "optimizer_state")


def make(kind, group, vocab):
    """(model, step, zero_grad, memory) functions for plain data parallel or ZeRO stage 1/2/3."""
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=vocab, **CONFIG))
    adamw = lambda params: optim.AdamW(params, lr=3e-3)  # noqa: E731
    if kind == "DP":
        net = DistributedDataParallel(model, group, bucket_cap_mb=0.25, algorithm="ring")
        opt = adamw(model.parameters())
        return model, opt.step, opt.zero_grad, lambda: {"parameters": sum(p.data.nbytes for p in
                                                         model.parameters()),
                                         "gradients": net.gradient_bytes(),
                                         "optimizer_state": opt.state_bytes()}
    if kind == "ZeRO-3":
        zero = ZeRO3(model, adamw, group)  # one unit per layer (Linear, LayerNorm, Embedding)
        return model, zero.step, zero.zero_grad, lambda: dict(
            zero.memory_bytes(), peak_gathered=zero.peak_gathered_bytes)
    else:
        zero = ZeRO(model, adamw, group, stage=int(kind[-1]), bucket_cap_mb=0.25)
    return model, zero.step, zero.zero_grad, zero.memory_bytes


def global_batch(data, step):
    """The step's global batch, the same on every rank (a seeded generator)."""
    starts = np.random.default_rng(step).integers(0, len(data) - CONFIG["block_size"] - 1,
                                                  GLOBAL_BATCH)
    windows = data[starts[:, None] + np.arange(CONFIG["block_size"] + 1)]
    return windows[:, :-1], windows[:, 1:]


def train_steps(kind, group, data, vocab, steps, desc=None):
    """Losses (mean over the global batch), this rank's memory after the last backward and the
    bytes it sent in the last step (forward, backward, update); a progress bar named ``desc``."""
    model, step, zero_grad, memory = make(kind, group, vocab)
    b = local_batch_size(GLOBAL_BATCH, group.size)
    mine = slice(group.rank * b, (group.rank + 1) * b)
    losses = []
    for s in progress(range(steps), desc) if desc else range(steps):
        x, y = global_batch(data, s)
        zero_grad()
        before = group.counters.bytes_sent
        loss = model(x[mine], y[mine])[1]
        loss.backward()
        held = memory()  # after backward, before the step: gradients at their largest
        step()
        sent = group.counters.bytes_sent - before
        losses.append(group.all_reduce(np.array([loss.item()]), op="avg")[0])
    return losses, held, sent


def part1_memory(world, data, vocab):
    held = {}  # (N, kind) -> this rank's bytes (rank 0 is in every group)
    for k in progress(range(1, world.size + 1), "memory for N = 1 ..", total=world.size):
        group = world.split(0 if world.rank < k else 1)
        if world.rank < k:
            for kind in KINDS:
                held[k, kind] = train_steps(kind, group, data, vocab, steps=2)[1]  # state after 1
        world.barrier()
    say("Part 1: kB one rank holds after backward (parameters / gradients / optimizer "
        "state), float32 AdamW, tiny GPT")
    say(f"  {'N':>2s}  {'plain DP':>16s}  {'ZeRO-1':>16s}  {'ZeRO-2':>16s}  {'ZeRO-3':>16s}"
        f"  {'ZeRO-3/DP':>9s}")
    for k in range(1, world.size + 1 if world.rank == 0 else 1):  # rank 0 holds every N
        ratio = total(held[k, "ZeRO-3"]) / total(held[k, "DP"])
        say(f"  {k:2d}  " + "  ".join(f"{cell:>16s}" for cell in (
            "/".join(f"{held[k, kind][key] / 1e3:.0f}" for key in PARTS) for kind in KINDS))
            + f"  {ratio:9.3f}")
    say("  ZeRO-1 divides the optimizer state by N, ZeRO-2 the gradients too, ZeRO-3 the "
        "parameters as well:",
        "  its total is 1/N of DP's (plus at most N-1 padding elements per layer). DP's "
        "gradients live in its",
        "  bucket buffers. While forward and backward run, ZeRO-3 also holds at most two "
        "layers whole (the one",
        f"  computing, the one prefetched): "
        f"{held[1, 'ZeRO-3']['peak_gathered'] / 1e3 if world.rank == 0 else 0:.0f} kB here, "
        f"none once backward is over.")
    return held


def total(memory):
    """Parameters + gradients + optimizer state, in bytes."""
    return sum(memory[key] for key in PARTS)


def part2_same_curve(world, data, vocab, steps):
    runs = {kind: train_steps(kind, world, data, vocab, steps, desc=f"{kind} training")
            for kind in KINDS}
    curves = {kind: run[0] for kind, run in runs.items()}
    say(f"\nPart 2: the loss curve on {world.size} ranks, global batch {GLOBAL_BATCH}")
    say(f"  {'step':>4s} {'plain DP':>10s} {'ZeRO-1':>10s} {'ZeRO-2':>10s} {'ZeRO-3':>10s}")
    for s in range(0, steps, max(1, steps // 8)):
        say(f"  {s:4d} " + " ".join(f"{curves[k][s]:10.5f}" for k in curves))
    gap = largest_gap(curves)
    say(f"  largest loss difference from plain DP over {steps} steps: {gap:.1e} "
        f"(float32 rounding)")
    return gap, curves, {kind: run[2] for kind, run in runs.items()}


def largest_gap(curves):
    return max(abs(a - b) for k in KINDS[1:] for a, b in zip(curves["DP"], curves[k]))


def part3_traffic(world, sent, parameters):
    """Bytes this rank sent in one step, measured, against c (N-1)/N of the parameters' bytes."""
    N = world.size
    if N == 1:
        return say("\nPart 3: one rank sends nothing; run it on 2 or more ranks to see traffic")
    say(f"\nPart 3: kB one rank sends per step on {N} ranks (the comm counters), parameters "
        f"{parameters / 1e3:.0f} kB")
    say(f"  {'':8s} {'measured':>9s} {'theory':>9s} {'x DP':>6s}")
    for kind in KINDS:
        theory = COPIES[kind] * (N - 1) / N * parameters
        say(f"  {kind:8s} {sent[kind] / 1e3:9.1f} {theory / 1e3:9.1f} "
            f"{sent[kind] / sent['DP']:6.3f}")
    say("  DP: all-reduce = reduce-scatter + all-gather, 2 (N-1)/N; ZeRO-1/2 use the two "
        "halves, the same bytes;",
        "  ZeRO-3 gathers every layer twice (forward, backward) and reduce-scatters once: "
        "3 (N-1)/N, 1.5x.")


def theory_bytes(kind, parameters, N):
    """Adam in float32: parameters P, gradients P, optimizer state 2P; ZeRO-1 keeps 1/N of the
    state, ZeRO-2 also 1/N of the gradients, ZeRO-3 1/N of all three (Rajbhandari et al. 2020).
    ``parameters``: DP's (whole) parameter bytes."""
    gradients = parameters / N if kind in ("ZeRO-2", "ZeRO-3") else parameters
    state = 2 * parameters / (1 if kind == "DP" else N)
    return (parameters / N if kind == "ZeRO-3" else parameters) + gradients + state


def draw_figures(directory, held, curves, N):
    bars = []
    for k in range(1, N + 1):
        for kind in KINDS:
            label = f"{'DP' if kind == 'DP' else kind} N={k}"
            measured = total(held[k, kind])
            bars.append((label, measured, theory_bytes(kind, held[k, "DP"]["parameters"], k)))
    figure(directory, "06_memory", lambda figures: figures.memory_chart(
        bars, title="ZeRO: what one rank holds after backward (parameters + gradients + "
                    "optimizer state)", unit="kB", xlabel="layout on N ranks"))
    gap = largest_gap(curves)
    figure(directory, "06_loss", lambda figures: figures.loss_chart(
        {"plain DP" if k == "DP" else k: curves[k] for k in KINDS},
        title=f"ZeRO-1, 2 and 3 on {N} ranks: the four curves lie on one another "
              f"(largest gap {gap:.0e}), each marked on other steps"))


def main():
    args = arguments(__doc__, plot=True)
    world = mpi_world(__doc__, ranks=(1, 2, 3, 4, 6, 8))
    text = load_text("pydoc")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    held = part1_memory(world, data, tok.vocab_size)
    gap, curves, sent = part2_same_curve(world, data, tok.vocab_size,
                                         steps=4 if args.quick else 40)
    parameters = held[world.size, "DP"]["parameters"]  # DP's whole parameters, on every rank
    part3_traffic(world, sent, parameters)
    N = world.size
    if world.rank == 0:  # it holds the memory of every N
        draw_figures(args.plot, held, curves, N)
    for kind, key in (("ZeRO-1", "optimizer_state"), ("ZeRO-2", "optimizer_state"),
                      ("ZeRO-2", "gradients"), ("ZeRO-3", "parameters"), ("ZeRO-3", "gradients"),
                      ("ZeRO-3", "optimizer_state")):
        ratio, want = held[N, kind][key] / held[N, "DP"][key], 1 / N
        check(f"{kind}: a rank holds 1/N = {want:.3f} of DP's {key.replace('_', ' ')} (± 0.01)",
              abs(ratio - want) <= 0.01, f"{want:.3f} ± 0.01", f"{ratio:.4f}")
    for kind in KINDS[1:] if N > 1 else ():
        want, ratio = COPIES[kind] / COPIES["DP"], sent[kind] / sent["DP"]
        check(f"{kind} sends {want:.1f}x DP's bytes per step (± 0.02)", abs(ratio - want) <= 0.02,
              f"{want:.2f} ± 0.02", f"{ratio:.4f}")
    check("ZeRO-1, 2 and 3 follow plain DP's loss curve (float32, |diff| < 1e-5)", gap < 1e-5,
          "< 1e-5", f"{gap:.1e}")
    return finish(f"ZeRO keeps 1/{N} of the optimizer state (stage 2: and of the gradients, "
                  f"stage 3: of everything, for 1.5x the traffic) per rank, with DP's loss curve")


if __name__ == "__main__":
    raise SystemExit(main())
