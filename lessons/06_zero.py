"""Lesson 06: ZeRO: shard the optimizer state, the gradients, then the parameters; same loss.

    mpiexec -n 4 python lessons/06_zero.py
    mpiexec -n 2 python lessons/06_zero.py --quick   (a few seconds: the smoke run)

Plain data parallelism keeps a full copy of everything on every rank: for Adam in float32 that is
4 bytes of parameters, 4 of gradients and 8 of optimizer state per parameter; in mixed precision,
the paper's case, 2 + 2 + 12 (16-bit parameters and gradients, float32 master copies and
moments): 16 either way, however many ranks share the work. ZeRO (Rajbhandari et al. 2020) cuts
the redundant copies: stage 1 gives each rank 1/N of the optimizer state (it updates only its
1/N of the parameters, then an all-gather shares them), stage 2 also keeps only 1/N of the
reduced gradients, and stage 3 (fully sharded data parallel, ``ZeRO3``) 1/N of the parameters as
well: each layer is all-gathered just before its forward, freed, gathered again for its
backward, and its gradient reduce-scattered. Part 1 measures the bytes per parameter one rank
holds after backward, by kind, for N = 1 .. world size (groups carved out with ``split``),
beside the paper's formulas, (2+2+12)Ψ, (2+2+12/N)Ψ, (2+(2+12)/N)Ψ, 16Ψ/N: exact to the byte,
padding counted. Part 2 trains a tiny GPT with DDP and ZeRO-1, 2, 3: one loss curve. Part 3
counts the bytes a rank sends per step: stages 1 and 2 send plain DP's 2 (N-1)/N of the
parameters (reduce-scatter + all-gather = all-reduce); stage 3 gathers twice, 1.5x; 16 bits: half.

Read next: minipar/parallel/data/zero.py, then zero3.py; proved by tests/test_zero.py,
tests/test_zero3.py and tests/test_zero_16bit.py.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import optim
from minipar.data import CharTokenizer, load_text
from minipar.parallel.data import DistributedDataParallel, ZeRO, ZeRO3, local_batch_size
from minipar.parallel.data.allreduce_optimizer import optimizer_memory

from _kit import arguments, check, figure, finish, mpi_world, progress, say

CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
GLOBAL_BATCH = 24  # divides among 1, 2, 3, 4, 6 or 8 ranks
KINDS = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
COPIES = {"DP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}  # x (N-1)/N of the parameters sent
PARTS = ("parameters", "gradients", "master", "moments")
MIXED = "float16"  # the paper's mixed precision: a 16-bit model, AdamW's float32 master copies
PRECISIONS = ("float32", "mixed")
BYTES = {"float32": (4, 8), "mixed": (2, 12)}  # a parameter's (and its gradient's), state's
FORMULAS = {"float32": {"DP": "4+4+8", "ZeRO-1": "4+4+8/N", "ZeRO-2": "4+(4+8)/N",
                        "ZeRO-3": "(4+4+8)/N"},
            "mixed": {"DP": "2+2+12", "ZeRO-1": "2+2+12/N", "ZeRO-2": "2+(2+12)/N",
                      "ZeRO-3": "(2+2+12)/N"}}


def make(kind, group, vocab, dtype="float32"):
    """(model, step, zero_grad, memory) functions for plain data parallel or ZeRO stage 1/2/3;
    ``memory()``: bytes by kind and ``padded``, the elements of the flat vectors it shards."""
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=vocab, **CONFIG)).to(getattr(minipar, dtype))
    adamw = lambda params: optim.AdamW(params, lr=3e-3)  # noqa: E731
    if kind == "DP":
        net = DistributedDataParallel(model, group, bucket_cap_mb=0.25, algorithm="ring")
        opt = adamw(model.parameters())
        psi = sum(p.size for p in model.parameters())
        return model, opt.step, opt.zero_grad, lambda: dict(
            parameters=opt.memory_bytes()["params"], gradients=net.gradient_bytes(),
            **optimizer_memory(opt), padded=psi)
    if kind == "ZeRO-3":
        zero = ZeRO3(model, adamw, group)  # one unit per layer (Linear, LayerNorm, Embedding)
        return model, zero.step, zero.zero_grad, lambda: dict(
            zero.memory_bytes(), peak_gathered=zero.peak_gathered_bytes,
            padded=sum(seg.numel for seg in zero.segments))
    zero = ZeRO(model, adamw, group, stage=int(kind[-1]), bucket_cap_mb=0.25)
    return model, zero.step, zero.zero_grad, lambda: dict(
        zero.memory_bytes(), padded=sum(int(flat.size) for flat in zero.flats))


def global_batch(data, step, size=GLOBAL_BATCH):
    """The step's global batch, the same on every rank (a seeded generator)."""
    starts = np.random.default_rng(step).integers(0, len(data) - CONFIG["block_size"] - 1,
                                                  size)
    windows = data[starts[:, None] + np.arange(CONFIG["block_size"] + 1)]
    return windows[:, :-1], windows[:, 1:]


def train_steps(kind, group, data, vocab, steps, desc=None, dtype="float32", batch=GLOBAL_BATCH):
    """Losses (mean over the global batch), this rank's memory after the last backward and the
    bytes it sent in the last step (forward, backward, update); a progress bar named ``desc``."""
    model, step, zero_grad, memory = make(kind, group, vocab, dtype)
    b = local_batch_size(batch, group.size)
    mine = slice(group.rank * b, (group.rank + 1) * b)
    losses = []
    for s in progress(range(steps), desc) if desc else range(steps):
        x, y = global_batch(data, s, batch)
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
    held = {}  # (precision, N, kind) -> this rank's bytes (rank 0 is in every group)
    for k in progress(range(1, world.size + 1), "memory for N = 1 ..", total=world.size):
        group = world.split(0 if world.rank < k else 1)
        if world.rank < k:
            for kind in KINDS:  # state after one step; a 16-bit model: one sequence per rank
                for precision, dtype, batch in (("float32", "float32", GLOBAL_BATCH),
                                                ("mixed", MIXED, k)):
                    _, memory, sent = train_steps(kind, group, data, vocab, steps=2,
                                                  dtype=dtype, batch=batch)
                    held[precision, k, kind] = dict(memory, sent=sent)  # and bytes sent
        world.barrier()
    psi = held["float32", world.size, "DP"]["padded"]  # Ψ: the model's parameters
    say("Part 1: bytes per parameter one rank holds after backward, measured from its arrays, "
        "beside the paper's formula",
        f"  (AdamW, tiny GPT, Ψ = {psi:,}; optimizer state = float32 master copies + moments)")
    say(f"  {'':7s} {'N':>2s} {'layout':8s} {'params':>7s} {'grads':>7s} {'master':>7s} "
        f"{'moments':>7s} {'total':>8s}  {'paper':10s} {'':>8s} {'padding':>7s}")
    for precision in PRECISIONS:
        for k in range(1, world.size + 1 if world.rank == 0 else 1):  # rank 0 holds every N
            for kind in KINDS:
                m = held[precision, k, kind]
                cells = " ".join(f"{m[key] / psi:7.3f}" for key in PARTS)
                say(f"  {precision:7s} {k:2d} {kind:8s} {cells} {total(m) / psi:8.4f}  "
                    f"{FORMULAS[precision][kind]:10s} {paper(precision, kind, k):8.4f} "
                    f"{m['padded'] - psi:7d}")
    say("  ZeRO-1 divides the optimizer state by N, ZeRO-2 the gradients too, ZeRO-3 the "
        "parameters as well. In mixed",
        "  precision (the paper's: 16-bit parameters and gradients, float32 master copies and "
        "moments) that is",
        "  2 + 2 + 12 bytes per parameter. Measured equals the formula to the byte once the "
        "padding of each",
        "  sharded vector is counted (at most N-1 elements per bucket or layer: the last "
        "column). While forward",
        "  and backward run, ZeRO-3 also holds at most two layers whole (the one computing, the "
        "one prefetched):",
        f"  {held['float32', 1, 'ZeRO-3']['peak_gathered'] / 1e3 if world.rank == 0 else 0:.0f}"
        f" kB here (float32), none once backward is over.")
    return held


def total(memory):
    """Parameters + gradients + optimizer state (master + moments), in bytes."""
    return sum(memory[key] for key in PARTS)


def part(memory, key):
    """The bytes of one kind, "optimizer_state" being master + moments."""
    return memory["master"] + memory["moments"] if key == "optimizer_state" else memory[key]


def paper(precision, kind, N):
    """The paper's bytes per parameter: DP keeps a + a + s (a bytes a parameter and a gradient,
    s of optimizer state); ZeRO-1 divides s by N, ZeRO-2 also the gradients, ZeRO-3 all."""
    a, s = BYTES[precision]
    return {"DP": a + a + s, "ZeRO-1": a + a + s / N, "ZeRO-2": a + (a + s) / N,
            "ZeRO-3": (a + a + s) / N}[kind]


def exact(m, precision, kind, N, psi):
    """Whether the measured bytes by kind are the paper's formula to the byte, the sharded
    vectors counted with their padding (``padded`` elements, 1/N of them on this rank; ZeRO-1
    and 2 hold the padded flat parameters whole)."""
    a, s = BYTES[precision]
    shard, padded = m["padded"] // N, m["padded"]
    want = {"DP": (a * psi, a * psi, s * psi), "ZeRO-1": (a * padded, a * psi, s * shard),
            "ZeRO-2": (a * padded, a * shard, s * shard),
            "ZeRO-3": (a * shard, a * shard, s * shard)}[kind]
    return (m["parameters"], m["gradients"], m["master"] + m["moments"]) == want


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


def part3_traffic(world, sent, parameters, held):
    """Bytes this rank sent in one step, measured, against c (N-1)/N of the parameters' bytes;
    in mixed precision (``held``: part 1's runs) against float32's."""
    N = world.size
    if N == 1:
        return say("\nPart 3: one rank sends nothing; run it on 2 or more ranks to see traffic")
    say(f"\nPart 3: kB one rank sends per step on {N} ranks (the comm counters), parameters "
        f"{parameters / 1e3:.0f} kB")
    say(f"  {'':8s} {'measured':>9s} {'theory':>9s} {'x DP':>6s} {'16-bit':>9s} {'x fp32':>6s}")
    for kind in KINDS:
        theory = COPIES[kind] * (N - 1) / N * parameters
        mixed = held["mixed", N, kind]["sent"]
        say(f"  {kind:8s} {sent[kind] / 1e3:9.1f} {theory / 1e3:9.1f} "
            f"{sent[kind] / sent['DP']:6.3f} {mixed / 1e3:9.1f} "
            f"{mixed / held['float32', N, kind]['sent']:6.3f}")
    say("  DP: all-reduce = reduce-scatter + all-gather, 2 (N-1)/N; ZeRO-1/2 use the two "
        "halves, the same bytes;",
        "  ZeRO-3 gathers every layer twice (forward, backward) and reduce-scatters once: "
        "3 (N-1)/N, 1.5x.",
        "  A 16-bit model's gradients and parameters travel as 16-bit messages: half the bytes.")


def draw_figures(directory, held, curves, N):
    psi = held["float32", N, "DP"]["padded"]
    labels = [f"{kind} N={k}" for k in range(1, N + 1) for kind in KINDS]
    # the table's unit, bytes per parameter: measured beside the paper's formula
    series = {"measured": [total(held["mixed", k, kind]) / psi for k in range(1, N + 1)
                           for kind in KINDS],
              "paper": [paper("mixed", kind, k) for k in range(1, N + 1) for kind in KINDS]}
    figure(directory, "06_memory", lambda figures: figures.bar_chart(
        labels, series, title="ZeRO in mixed precision: bytes per parameter one rank holds "
                              "after backward, beside the paper's (2+2+12, ...)",
        ylabel="bytes per parameter, one rank", xlabel="layout on N ranks"))
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
    parameters = held["float32", world.size, "DP"]["parameters"]  # DP's whole parameters
    part3_traffic(world, sent, parameters, held)
    N = world.size
    if world.rank == 0:  # it holds the memory of every N
        draw_figures(args.plot, held, curves, N)
    psi = held["float32", N, "DP"]["padded"]
    for precision in PRECISIONS:
        exacts = [exact(held[precision, k, kind], precision, kind, k, psi)
                  for k in range(1, N + 1 if world.rank == 0 else 1) for kind in KINDS]
        check(f"{precision} AdamW: the bytes a rank holds equal the paper's formulas for "
              f"every stage and N, to the byte (padding counted)", all(exacts),
              "exact", f"{sum(exacts)}/{len(exacts)} exact")
    for kind, key in (("ZeRO-1", "optimizer_state"), ("ZeRO-2", "optimizer_state"),
                      ("ZeRO-2", "gradients"), ("ZeRO-3", "parameters"), ("ZeRO-3", "gradients"),
                      ("ZeRO-3", "optimizer_state")):
        mine, dp = (part(held["float32", N, k], key) for k in (kind, "DP"))
        ratio, want = mine / dp, 1 / N
        check(f"{kind}: a rank holds 1/N = {want:.3f} of DP's {key.replace('_', ' ')} (± 0.01)",
              abs(ratio - want) <= 0.01, f"{want:.3f} ± 0.01", f"{ratio:.4f}")
    for kind in KINDS[1:] if N > 1 else ():
        want, ratio = COPIES[kind] / COPIES["DP"], sent[kind] / sent["DP"]
        check(f"{kind} sends {want:.1f}x DP's bytes per step (± 0.02)", abs(ratio - want) <= 0.02,
              f"{want:.2f} ± 0.02", f"{ratio:.4f}")
    for kind in KINDS if N > 1 else ():
        ratio = held["mixed", N, kind]["sent"] / held["float32", N, kind]["sent"]
        check(f"{kind} in mixed precision sends half float32's bytes (± 0.002)",
              abs(ratio - 0.5) <= 0.002, "0.500 ± 0.002", f"{ratio:.4f}")
    check("ZeRO-1, 2 and 3 follow plain DP's loss curve (float32, |diff| < 1e-5)", gap < 1e-5,
          "< 1e-5", f"{gap:.1e}")
    return finish(f"ZeRO keeps 1/{N} of the optimizer state (stage 2: and of the gradients, "
                  f"stage 3: of everything, for 1.5x the traffic) per rank, with DP's loss curve")


if __name__ == "__main__":
    raise SystemExit(main())
