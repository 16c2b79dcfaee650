"""Lesson 13: mixed precision: fp16 needs a loss scale, bf16 does not, both keep fp32 masters.

    mpiexec -n 2 python lessons/13_mixed_precision.py        (add --quick for a smoke run)

Every large run trains in 16 bits (Micikevicius et al. 2018, "Mixed Precision Training"): the
matrix products take 16-bit inputs and accumulate in float32, while softmax, layer norm and the
loss stay in float32 (``minipar.amp.autocast``), and the optimizer updates a float32 master copy
of each 16-bit weight. float16 keeps 10 mantissa bits but only 5 exponent bits: gradients below
2^-24 flush to zero, so the loss is scaled up before backward and the gradients down before the
step (``GradScaler``). bfloat16 keeps float32's exponent (no scale needed) but 7 mantissa bits,
so an update much smaller than a weight rounds away unless the weight lives in float32. This
lesson measures each claim on the tiny GPT: (1) the gradients' range against fp16's, with and
without a scale; (2) the updates a 16-bit weight loses; (3) training curves of fp32, bf16 and
fp16 with and without GradScaler; (4) bytes per parameter by kind, ZeRO's 16 for mixed-precision
Adam; (5) the all-reduce bytes of 16-bit gradients, half of float32's.

Read next: minipar/backend/dtypes.py, minipar/amp/autocast_mode.py, minipar/amp/grad_scaler.py,
minipar/optim/optimizer.py; proved by tests/test_precision_dtypes.py and tests/test_amp_scaler.py.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import backend, optim
from minipar.amp import GradScaler, autocast
from minipar.data import CharTokenizer, load_text
from minipar.parallel.data import DistributedDataParallel

from _kit import arguments, check, figure, finish, mpi_world, progress, say

CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
BATCH = 16
SCALES = (1.0, 2.0**8, 2.0**16, 2.0**24, 2.0**32)
LEARNING_RATES = (3e-3, 3e-4, 3e-5, 3e-6)  # warm-up peak to the end of a cosine decay
LR = 3e-3
# A real run's batch holds millions of tokens (GPT-3: 3.2M); each micro-batch's loss is its share
# of their mean, so its gradients are that much smaller. The lesson's batch stands in for one
# micro-batch of a 2^22-token batch: its loss times SHARE. Adam ignores a gradient's scale but
# for eps, so eps shrinks by SHARE too and the float32 run is the unscaled one.
SHARE = BATCH * CONFIG["block_size"] / 2**22
EPS = 1e-8 * SHARE
BF16_GAP, FP16_GAP = 0.05, 0.02  # the loss gaps to float32 the lesson accepts (measured below)
RUNS = ("float32", "bf16", "fp16 + GradScaler", "fp16, no scale")
FP16 = backend.finfo("float16")


def batch(data, step):
    """The step's batch, the same on every rank (a seeded generator)."""
    starts = np.random.default_rng(step).integers(0, len(data) - CONFIG["block_size"] - 1, BATCH)
    windows = data[starts[:, None] + np.arange(CONFIG["block_size"] + 1)]
    return windows[:, :-1], windows[:, 1:]


def gpt(vocab):
    minipar.manual_seed(0)
    return nn.GPT(nn.GPTConfig(vocab_size=vocab, **CONFIG))


def float32_gradients(data, vocab):
    """One float32 step's gradients: every weight's, and the logits' (dL/dlogits is where a
    mean over B·T tokens makes the values small)."""
    model = gpt(vocab)
    x, y = batch(data, 0)
    logits, loss = model(x, y)
    logits.retain_grad()
    (loss * SHARE).backward()
    weights = np.concatenate([backend.to_numpy(p.grad).ravel() for p in model.parameters()])
    return model, {"weights": weights, "logits": backend.to_numpy(logits.grad).ravel()}


def part1_range(grads):
    """Round each float32 gradient to fp16 after scaling by S: the share that flushes to zero
    (was not zero), lands among the subnormals (fewer mantissa bits), or overflows to inf."""
    say("Part 1: the range. One float32 step's gradients rounded to float16 after a loss scale S",
        f"  fp16: smallest subnormal {FP16.smallest_subnormal:.1e}, smallest normal "
        f"{FP16.tiny:.1e}, largest {FP16.max:.0f}; bf16 has float32's range",
        f"  {'gradient':>8s} {'S':>6s} {'zero':>8s} {'subnormal':>10s} {'inf':>8s}   "
        f"(share of the nonzero entries)")
    shares = {}
    for name, g in grads.items():
        g = g[g != 0].astype(np.float32)
        for s in SCALES:
            with np.errstate(over="ignore"):  # the overflow is what the table counts
                h = (g * np.float32(s)).astype(np.float16)
            zero, inf = np.mean(h == 0), np.mean(np.isinf(h))
            sub = np.mean((h != 0) & (np.abs(h) < FP16.tiny))
            shares[name, s] = (zero, sub, inf)
            say(f"  {name:>8s} {'2^%d' % np.log2(s):>6s} {zero:8.2%} {sub:10.2%} {inf:8.2%}")
        bf = g.astype(minipar.bfloat16)
        shares[name, "bf16"] = (np.mean(bf == 0), 0.0, np.mean(np.isinf(bf.astype(np.float32))))
    say("  Unscaled, fp16 flushes the smallest gradients to zero and keeps more only as "
        "subnormals; a scale",
        "  lifts them into the normal range until the largest overflow: GradScaler searches "
        "for that window.",
        f"  bf16 flushes {shares['logits', 'bf16'][0]:.2%} of the logits' gradients, unscaled.")
    return shares


def part2_mantissa(model):
    """AdamW's first update is lr times a direction d of entries near ±1 (m / sqrt(v)). Added to
    the weights W stored in 16 bits, how many entries of round(W) + lr·d round back to round(W)
    (the update is lost), and how far what lands is from lr·d, for lr from warm-up to decay."""
    weights = np.concatenate([backend.to_numpy(p.data).ravel() for p in model.parameters()])
    optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0, eps=EPS).step()
    direction = np.concatenate([backend.to_numpy(p.data).ravel() for p in model.parameters()])
    direction -= weights
    moved = direction != 0
    say("\nPart 2: the mantissa. AdamW's first update (lr · d, |d| about 1) added to weights "
        "stored in 16 bits",
        f"  {'lr':>7s} {'fp16 lost':>10s} {'bf16 lost':>10s} {'fp16 |err|/|u|':>15s} "
        f"{'bf16 |err|/|u|':>15s} {'fp32 master lost':>17s}")
    lost = {}
    for lr in LEARNING_RATES:
        update = (lr * direction).astype(np.float32)
        row = []
        for name in ("float16", "bfloat16"):
            w16 = weights.astype(backend.dtype(name)).astype(np.float32)
            landed = (w16 + update).astype(backend.dtype(name)).astype(np.float32) - w16
            lost[lr, name] = np.mean(landed[moved] == 0)
            error = np.mean(np.abs(landed[moved] - update[moved]) / np.abs(update[moved]))
            row.append((lost[lr, name], error))
        lost[lr, "master"] = np.mean((weights + update)[moved] == weights[moved])
        say(f"  {lr:7.0e} {row[0][0]:10.2%} {row[1][0]:10.2%} {row[0][1]:15.3f} "
            f"{row[1][1]:15.3f} {lost[lr, 'master']:17.2%}")
    small = LEARNING_RATES[-1]
    say(f"  At lr {small:.0e} bf16 weights lose {lost[small, 'bfloat16']:.0%} of the updates "
        f"(fp16 {lost[small, 'float16']:.0%}), a float32 master copy "
        f"{lost[small, 'master']:.0%}: the",
        "  optimizer adds the update to the master and rounds once when it writes the 16-bit "
        "weight (fp32 masters).")
    return lost


def train(kind, data, vocab, steps):
    """One run of the tiny GPT: "float32"; "bf16" (bf16 weights, fp32 masters, autocast);
    "fp16 + GradScaler"; "fp16, no scale". Losses, the share of zero gradient entries at the
    first step, and the scaler's scale after each step with the steps it skipped."""
    model = gpt(vocab)
    low = minipar.bfloat16 if kind == "bf16" else minipar.float16
    if kind != "float32":
        model.to(low)  # the optimizer keeps a float32 master copy of each 16-bit weight
    opt = optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    # torch's start, 2^16, growing after every 10 good steps (torch: 2000) so that a short run
    # shows the search: double while no inf appears; on an overflow skip the step and halve
    scaler = GradScaler(growth_interval=10, enabled=kind == "fp16 + GradScaler")
    run = {"loss": [], "scale": [], "skipped": 0, "zeros": None}
    for s in range(steps):
        x, y = batch(data, s)
        opt.zero_grad()
        with autocast(dtype=low, enabled=kind != "float32"):
            loss = model(x, y)[1]
        scaler.scale(loss * SHARE).backward()
        if s == 0:
            grads = np.concatenate([backend.to_numpy(p.grad).astype(np.float32).ravel()
                                    for p in model.parameters()])
            run["zeros"], run["grads"] = np.mean(grads == 0), grads / scaler.get_scale()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        run["skipped"] += scaler.get_scale() < before  # a backoff: this step found inf or NaN
        run["scale"].append(scaler.get_scale())
        run["loss"].append(float(loss.item()))
    return run


def part3_training(data, vocab, steps):
    kinds = [k for k in RUNS if k != "bf16" or backend.device() == "cpu"]
    runs = {kind: train(kind, data, vocab, steps) for kind in progress(kinds, "training runs")}
    say(f"\nPart 3: the tiny GPT trained {steps} steps four ways (AdamW lr {LR}, batch {BATCH})",
        f"  {'step':>4s} " + " ".join(f"{kind:>18s}" for kind in runs))
    for s in range(0, steps, max(1, steps // 8)):
        say(f"  {s:4d} " + " ".join(f"{runs[k]['loss'][s]:18.4f}" for k in runs))
    gaps = {k: max(abs(a - b) for a, b in zip(runs[k]["loss"], runs["float32"]["loss"]))
            for k in runs if k != "float32"}
    say("  largest loss gap from float32: " + ", ".join(f"{k} {g:.3f}" for k, g in gaps.items()),
        "  zero gradient entries at step 0: " + ", ".join(
            f"{k} {r['zeros']:.2%}" for k, r in runs.items()),
        f"  GradScaler: scale {runs['fp16 + GradScaler']['scale'][-1]:.0f} after {steps} steps, "
        f"{runs['fp16 + GradScaler']['skipped']} steps skipped (inf/NaN found, scale halved)")
    if "bf16" not in runs:
        say("  (bf16 is not run here: CuPy has no bfloat16; MINIPAR_DEVICE=cpu runs it)")
    return runs, gaps


def part4_bytes(vocab, N):
    """Bytes per parameter by kind, measured from the arrays after one AdamW step: float32
    against 16-bit weights with float32 masters; ZeRO's formulas for N ranks beside them."""
    say("\nPart 4: bytes per parameter by kind after one AdamW step, measured from the arrays")
    say(f"  {'weights':>9s} {'params':>7s} {'grads':>6s} {'master':>7s} {'moments':>8s} "
        f"{'total':>6s}")
    per = {}
    for name in ("float32", "float16", "bfloat16"):
        if name == "bfloat16" and backend.device() != "cpu":
            continue
        model = gpt(vocab).to(name)
        opt = optim.AdamW(model.parameters(), lr=LR)
        x, y = batch(np.arange(4096) % vocab, 0)
        model(x, y)[1].backward()
        opt.step()
        psi = sum(p.size for p in model.parameters())
        per[name] = {kind: b / psi for kind, b in opt.memory_bytes().items()}
        say(f"  {name:>9s} " + " ".join(f"{per[name][k]:{w}.0f}" for k, w in
                                       (("params", 7), ("grads", 6), ("master", 7),
                                        ("moments", 8)))
            + f" {sum(per[name].values()):6.0f}")
    say("  The same 16 bytes: mixed precision halves the weights and gradients but adds a "
        "float32 master;",
        "  it saves activation memory, bandwidth and tensor-core time, not optimizer state. "
        "ZeRO cuts the 16",
        f"  across N ranks (Rajbhandari et al. 2020), here N = {N}: lesson 06 measures these:")
    for stage, formula, value in ZERO_FORMULAS:
        say(f"    {stage:8s} {formula:18s} = {value(N):5.2f} bytes per parameter")
    return per


ZERO_FORMULAS = (("DP", "2 + 2 + 12", lambda N: 16.0),
                 ("ZeRO-1", "2 + 2 + 12/N", lambda N: 4 + 12 / N),
                 ("ZeRO-2", "2 + (2 + 12)/N", lambda N: 2 + 14 / N),
                 ("ZeRO-3", "(2 + 2 + 12)/N", lambda N: 16 / N))


def part5_bytes_on_the_wire(world, vocab):
    """One DDP step per dtype: the bytes a rank sends (the counters); and why MPI's own
    reduction cannot sum bfloat16: it has no such type, and 16-bit integers are not floats."""
    if world.size == 1:
        say("\nPart 5: one rank sends nothing; run on 2 or more ranks to count the bytes")
        return {}
    sent = {}
    for name in ("float32", "float16", "bfloat16"):
        if name == "bfloat16" and backend.device() != "cpu":
            continue
        model = DistributedDataParallel(gpt(vocab).to(name), world, algorithm="ring")
        x, y = batch(np.arange(4096) % vocab, world.rank)
        world.counters.reset()
        model(x, y)[1].backward()
        sent[name] = world.counters.bytes_sent
    say(f"\nPart 5: bytes one rank sends for one DDP step's gradients on {world.size} ranks "
        "(ring all-reduce, the counters)",
        *(f"  {name:>9s} {b / 1e3:9.1f} kB  ({b / sent['float32']:.3f} of float32's)"
          for name, b in sent.items()))
    a = np.array([1.5, 3.0], dtype=minipar.bfloat16)
    as_ints = (a.view(np.uint16) + a.view(np.uint16)).view(minipar.bfloat16)
    say("  MPI has no bfloat16: handed its bits as 16-bit integers, SUM adds the bit patterns: "
        f"{a.tolist()} + itself",
        f"  gives {as_ints.astype(np.float32).tolist()}, not {(a + a).tolist()}. minipar "
        "refuses algorithm='mpi' for bf16 sums and adds",
        "  in its own collectives, in float32, rounding once where one rank adds them all "
        "(docs/comm.md).")
    return sent


def draw_figures(directory, grads, runs):
    figure(directory, "13_loss", lambda figures: figures.loss_chart(
        {("serial " if k == "float32" else "") + k: r["loss"] for k, r in runs.items()},
        title="The tiny GPT in four precisions: bf16 and fp16 with GradScaler follow float32; "
              "fp16 without a scale flushes its gradients and stalls"))
    figure(directory, "13_gradients", lambda figures: figures.magnitude_chart(
        {"weights' gradients": grads["weights"], "logits' gradients": grads["logits"]},
        {"fp16 smallest normal": float(FP16.tiny),
         "fp16 smallest subnormal": float(FP16.smallest_subnormal)},
        title="One micro-batch's float32 gradients against float16's range: left of the "
              "dotted line they flush to zero without a loss scale"))


def main():
    args = arguments(__doc__, plot=True)
    world = mpi_world(__doc__, ranks=(1, 2, 3, 4))
    text = load_text("pydoc")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    model, grads = float32_gradients(data, tok.vocab_size)
    shares = part1_range(grads)
    lost = part2_mantissa(model)
    runs, gaps = part3_training(data, tok.vocab_size, steps=8 if args.quick else 40)
    per = part4_bytes(tok.vocab_size, world.size)
    sent = part5_bytes_on_the_wire(world, tok.vocab_size)
    if world.rank == 0:
        draw_figures(args.plot, grads, runs)
    check("unscaled, fp16 flushes over 10% of the weights' gradients to zero; 2^16 under 1%",
          shares["weights", 1.0][0] > 0.1 and shares["weights", 2.0**16][0] < 0.01,
          "> 10% and < 1%", f"{shares['weights', 1.0][0]:.2%} and "
                            f"{shares['weights', 2.0**16][0]:.2%}")
    check("bf16 flushes none of them, unscaled", shares["weights", "bf16"][0] == 0, "0",
          f"{shares['weights', 'bf16'][0]:.2%}")
    small = LEARNING_RATES[-1]
    check(f"at lr {small:.0e} bf16 weights lose over half the updates, fp32 masters none",
          lost[small, "bfloat16"] > 0.5 and lost[small, "master"] == 0, "> 50% and 0",
          f"{lost[small, 'bfloat16']:.0%} and {lost[small, 'master']:.0%}")
    for kind, limit in (("bf16", BF16_GAP), ("fp16 + GradScaler", FP16_GAP)):
        if kind in gaps:
            check(f"{kind} follows float32's loss (largest gap < {limit})", gaps[kind] < limit,
                  f"< {limit}", f"{gaps[kind]:.4f}")
    check("fp16 without a loss scale falls behind (gap > 0.3)", gaps["fp16, no scale"] > 0.3,
          "> 0.3", f"{gaps['fp16, no scale']:.3f}")
    for name, kinds in per.items():
        check(f"{name} AdamW holds 16 bytes per parameter", sum(kinds.values()) == 16, "16",
              f"{sum(kinds.values()):.3f}")
    for name in ("float16", "bfloat16"):
        if name in sent:
            check(f"{name} gradients send half float32's bytes", 2 * sent[name] ==
                  sent["float32"], "0.5", f"{sent[name] / sent['float32']:.4f}")
    return finish("fp16 needs a loss scale, bf16 does not; both train like float32 with fp32 "
                  "masters, in half the gradient bytes")


if __name__ == "__main__":
    raise SystemExit(main())
