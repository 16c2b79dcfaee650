"""Lesson 17: FP8 training: four scaling recipes, outliers against 1x128 tiles, bytes per parameter.

    minipar lesson 17 -n 2        (add --quick for a smoke run)

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") halves bf16's bytes, but e4m3
holds 448 at most and 2^-9 at least: a tensor is multiplied by a scale into that range before
the cast, and the recipes differ in how many scales a tensor gets and where they come from
(docs/float8.md): one from this tensor's amax (torchao's tensorwise), one from past steps' amaxes
(Transformer Engine's delayed), one per 1x128 tile of activations and 128x128 block of weights
(DeepSeek-V3), one power of two per 32 elements (MXFP8). This lesson measures: (1) the tiny GPT
trained in fp32, bf16 and FP8 under each recipe; (2) one activation with the outliers large
models grow: what one scale for the tensor does to its small values, against 1x128 tiles;
(3) bytes per parameter by precision; (4) on 2 ranks, data parallel over the FP8 model.

Read next: minipar/amp/float8_recipes.py, float8.py, docs/float8.md; proved by
tests/test_float8_recipes.py, tests/test_float8_training.py and tests/test_lesson17.py.
"""
import sys

import numpy as np

import minipar
import minipar.nn as nn
from minipar import backend, optim
from minipar.amp import autocast
from minipar.amp.float8 import RECIPES, Float8Linear, convert_to_float8_training
from minipar.amp.float8_recipes import (DelayedScaling, dequantize, quantize_blocks, quantize_mx,
                                        quantize_tensorwise, quantize_tiles)
from minipar.data import CharTokenizer, load_text
from minipar.parallel.data import DistributedDataParallel

from _kit import arguments, check, figure, finish, mpi_world, progress, say

CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
# lesson 13's 3e-3 overshoots at step 7 in every run, float32 included (loss 3.24 -> 4.85, then
# back): Adam's first steps on this tiny GPT; 2e-3 trains without the jump
BATCH, LR = 16, 2e-3
KINDS = ("float32", "bf16", *RECIPES)  # every FP8 run is the bf16 run with its Linears in FP8
# the gaps to bf16's loss the lesson accepts: FP8 at the last step (tests/test_float8_training's
# band; measured up to 0.01 at step 50), bf16 to float32 over the whole curve
FP8_BAND, BF16_BAND = 0.05, 0.05
# Sun et al. 2024 ("Massive Activations in Large Language Models") measure a few activations
# about 10^4 times the median, on the first token, in fixed channels; Yu et al. 2024 find them
# at the MLP's down projection's input. The tiny GPT is too small to grow them: they are planted.
OUTLIER_RATIO = 1e4
ACTIVATION = "blocks.1.mlp.c_proj"  # its input: the MLP's 4C-wide hidden, two tiles a token
E4M3 = backend.finfo("float8_e4m3fn")


def batch(data, step, rows=slice(None)):
    """The step's batch (seeded: the same on every rank); ``rows`` of it for data parallel."""
    starts = np.random.default_rng(step).integers(0, len(data) - CONFIG["block_size"] - 1, BATCH)
    windows = data[starts[rows, None] + np.arange(CONFIG["block_size"] + 1)]
    return windows[:, :-1], windows[:, 1:]


def gpt(vocab, kind):
    """The tiny GPT in ``kind``: float32; bf16 weights (fp32 masters in the optimizer, autocast);
    or a recipe: the bf16 model with every Linear a Float8Linear sharing its Parameters."""
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=vocab, **CONFIG))
    if kind != "float32":
        model.to(minipar.bfloat16)
    if kind in RECIPES:
        convert_to_float8_training(model, recipe=kind)
    return model


def train(kind, data, vocab, steps, world=None):
    """(losses, the model); with ``world``, DDP: each rank its share of every batch's rows,
    its own losses, and ``model.sent``: the bytes this rank sent in the last step."""
    model = gpt(vocab, kind)
    rows = slice(None)
    if world is not None:
        share = BATCH // world.size
        rows = slice(world.rank * share, (world.rank + 1) * share)
        model = DistributedDataParallel(model, world, algorithm="ring")
    opt = optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        if world is not None:
            world.counters.reset()
        x, y = batch(data, s, rows)
        opt.zero_grad()
        with autocast(dtype=minipar.bfloat16, enabled=kind != "float32"):
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    if world is not None:
        model.sent = world.counters.bytes_sent
    return losses, model


def part1_training(world, data, vocab, steps):
    """Every run on one rank of the world, its losses shared: the runs are independent."""
    mine = {k: train(k, data, vocab, steps)[0] for i, k in enumerate(progress(KINDS, "runs"))
            if i % world.size == world.rank}
    shared = {k: v for part in world.all_gather_object(mine) for k, v in part.items()}
    runs = {k: shared[k] for k in KINDS}
    say(f"Part 1: the tiny GPT trained {steps} steps (AdamW lr {LR}, batch {BATCH}, sonnets); "
        f"the {len(RECIPES)} FP8 runs",
        f"  are the bf16 run with every Linear's GEMMs in FP8 (runs shared over {world.size} "
        "rank(s))",
        f"  {'step':>4s} " + " ".join(f"{k:>10s}" for k in runs))
    for s in sorted({*range(0, steps, max(1, steps // 8)), steps - 1}):
        say(f"  {s:4d} " + " ".join(f"{runs[k][s]:10.4f}" for k in runs))
    gaps = {k: runs[k][-1] - runs["bf16"][-1] for k in RECIPES}
    bf16_gap = max(abs(a - b) for a, b in zip(runs["bf16"], runs["float32"]))
    say(f"  loss gap to bf16 at step {steps}: " + ", ".join(f"{k} {g:+.4f}" for k, g in
                                                          gaps.items()),
        f"  largest bf16 gap to float32 over the run: {bf16_gap:.4f}")
    for r, gap in gaps.items():
        check(f"FP8 {r} ends within {FP8_BAND} of bf16's loss", abs(gap) < FP8_BAND,
              f"< {FP8_BAND}", f"{gap:+.4f}")
    check(f"bf16 follows float32's loss (largest gap < {BF16_BAND})", bf16_gap < BF16_BAND,
          f"< {BF16_BAND}", f"{bf16_gap:.4f}")
    check("every run learns (its loss falls by a fifth)", all(r[-1] < r[0] * 0.8 for r in
                                                              runs.values()),
          "last < 0.8 x first", ", ".join(f"{r[-1]:.3f}" for r in runs.values()))
    return runs


def activations(model, data, steps):
    """The input of ACTIVATION (float32) for the batches of steps ``steps``: a forward hook."""
    seen = []
    layer = dict(model.named_modules())[ACTIVATION]
    layer.register_forward_hook(lambda mod, args, out: seen.append(
        backend.to_numpy(args[0].data).astype(np.float32)))
    for s in steps:
        with autocast(dtype=minipar.bfloat16):
            model(batch(data, s)[0])
    return [a.reshape(-1, a.shape[-1]) for a in seen]


def plant(a, value, channel):
    """a with ``value`` in ``channel`` of every sequence's first token (a row per token)."""
    a = a.copy()
    a[::CONFIG["block_size"], channel] = value
    return a


def quantised(a, history):
    """Each recipe's activation quantiser on a; delayed scaling fed ``history`` first."""
    delayed = DelayedScaling()
    for h in history:
        delayed(h)
    return {"tensorwise": quantize_tensorwise(a), "delayed": delayed(a),
            "1x128 tiles": quantize_tiles(a), "mxfp8": quantize_mx(a)}


def errors(a, q):
    """(nonzero inputs that quantise to 0, mean |x - dq(x)| / |x| over the nonzero inputs,
    |dq(a) - a| at the largest input)."""
    nonzero, back = a != 0, dequantize(q)
    relative = np.abs(back - a)[nonzero] / np.abs(a)[nonzero]
    top = np.unravel_index(np.abs(a).argmax(), a.shape)
    return (int(np.sum(nonzero & (q.data.astype(np.float32) == 0))), float(relative.mean()),
            float(abs(back[top] - a[top])))


def part2_outliers(model, data, steps):
    """One activation of the trained bf16 model, as it is and with planted outliers; delayed
    scaling's history: the same layer's inputs at the 4 steps before, outliers planted or not."""
    *before, a = activations(model, data, range(steps - 4, steps + 1))
    median = float(np.median(np.abs(a[a != 0])))
    channel = int(np.abs(a).mean(axis=0).argmax())
    value = OUTLIER_RATIO * median
    spiked = plant(a, value, channel)
    rows = {"as trained": quantised(a, before),
            "outliers": quantised(spiked, [plant(h, value, channel) for h in before]),
            "outliers new": {"delayed": quantised(spiked, before)["delayed"]}}
    found = {(case, r): errors(spiked if case != "as trained" else a, q)
             for case, qs in rows.items() for r, q in qs.items()}
    say(f"\nPart 2: one activation, the input of {ACTIVATION} ({a.shape[0]} tokens x "
        f"{a.shape[1]}), quantised to e4m3",
        f"  as trained its amax is {np.abs(a).max() / median:.0f}x its median |x| "
        f"({median:.3g}); large models' are 10^4x: planted",
        f"  here, {value:.3g} in channel {channel} of every sequence's first token "
        f"({a.shape[0] // CONFIG['block_size']} values)",
        f"  {'recipe':>12s} {'activation':>12s} {'flushed to 0':>13s} {'mean |err|/|x|':>15s} "
        f"{'|err| at max':>13s}")
    for (case, r), (flushed, rel, top) in found.items():
        say(f"  {r:>12s} {case:>12s} {flushed:13d} {rel:15.4f} {top:13.3g}")
    tensorwise = rows["outliers"]["tensorwise"]
    # e4m3's smallest subnormal is 2^-9: below half of it times the scale an input reads 0
    flush_below = float(tensorwise.scale) * float(E4M3.smallest_subnormal) / 2
    say(f"  One scale for the tensor: the outliers set it, {float(tensorwise.scale):.3g}, so "
        f"|x| < {flush_below:.2g} reads 0 and",
        f"  |x| < {float(tensorwise.scale) * float(E4M3.tiny):.2g} keeps fewer than 3 mantissa "
        "bits; a 1x128 tile confines that to the outliers' tiles.",
        "  Delayed scaling is tensor-wise with past amaxes; an outlier it has not seen yet "
        "saturates at 448 x scale.",
        "  MX's power-of-two scale X puts a block's amax in [256, 512) X: above 448 X it "
        f"clips (the outlier reads {found['outliers', 'mxfp8'][2]:.3g} low).")
    tw, tiles = found["outliers", "tensorwise"], found["outliers", "1x128 tiles"]
    check("with outliers one tensor-wise scale flushes over 0.5% of the inputs",
          tw[0] > 0.005 * a.size, f"> {0.005 * a.size:.0f}", str(tw[0]))
    check("1x128 tiles flush under a tenth of tensor-wise's", tiles[0] < tw[0] / 10,
          f"< {tw[0] / 10:.0f}", str(tiles[0]))
    plain = found["as trained", "tensorwise"][1], found["as trained", "1x128 tiles"][1]
    check("with outliers tensor-wise's mean relative error grows by half, 1x128 tiles' by "
          "under 5%", tw[1] > 1.5 * plain[0] and tiles[1] < 1.05 * plain[1],
          f"> {1.5 * plain[0]:.4f} and < {1.05 * plain[1]:.4f}",
          f"{tw[1]:.4f} and {tiles[1]:.4f}")
    mx_top = found["outliers", "mxfp8"][2]
    check("MX's power-of-two scale clips the outlier, by at most 1/8", 0 < mx_top <=
          OUTLIER_RATIO * median / 8, f"(0, {OUTLIER_RATIO * median / 8:.3g}]", f"{mx_top:.3g}")
    check("as trained, no recipe's mean relative error exceeds 5%",
          max(e[1] for (c, _), e in found.items() if c == "as trained") < 0.05, "< 0.05",
          f"{max(e[1] for (c, _), e in found.items() if c == 'as trained'):.4f}")
    check("delayed scaling with the outliers in its history flushes as tensor-wise does",
          found["outliers", "delayed"][0] == tw[0], str(tw[0]),
          str(found["outliers", "delayed"][0]))
    new = found["outliers new", "delayed"][2]
    check("an outlier delayed scaling has not seen saturates (error over half of it)",
          new > 0.5 * OUTLIER_RATIO * median, f"> {0.5 * OUTLIER_RATIO * median:.3g}",
          f"{new:.3g}")
    return a, spiked, flush_below


def per_parameter(vocab, kind):
    """Bytes per parameter by kind after one AdamW step, from the arrays' nbytes."""
    model = gpt(vocab, kind)
    opt = optim.AdamW(model.parameters(), lr=LR)
    x, y = batch(np.arange(4096) % vocab, 0)
    with autocast(dtype=minipar.bfloat16, enabled=kind != "float32"):
        model(x, y)[1].backward()
    opt.step()
    psi = sum(p.size for p in model.parameters())
    return {k: b / psi for k, b in opt.memory_bytes().items()}, model


WEIGHT_QUANTISERS = {"tensorwise": quantize_tensorwise, "blockwise": quantize_blocks,
                     "mxfp8": lambda w: quantize_mx(w, axis=1)}
INPUT_QUANTISERS = {"tensorwise": quantize_tensorwise, "blockwise": quantize_tiles,
                    "mxfp8": quantize_mx}


def nbytes(q):
    return int(q.data.nbytes) + int(np.asarray(q.scale).nbytes)


def part3_bytes(vocab, a):
    """Optimizer memory per parameter for float32, bf16 and FP8 models; the FP8 weight copy a
    GEMM reads, data and scales, per Linear weight element; an FP8 input kept for backward."""
    per = {"float32": per_parameter(vocab, "float32")[0], "bf16": per_parameter(vocab, "bf16")[0]}
    per["fp8 (bf16 + Float8Linear)"], model = per_parameter(vocab, "blockwise")
    weights = [m.weight.data for m in model.modules() if isinstance(m, Float8Linear)]
    count = sum(w.size for w in weights)
    copy = {r: sum(nbytes(f(w)) for w in weights) / count for r, f in WEIGHT_QUANTISERS.items()}
    saved = {r: nbytes(f(a)) / a.size for r, f in INPUT_QUANTISERS.items()}
    say("\nPart 3: bytes per parameter after one AdamW step, measured from the arrays' nbytes",
        f"  {'model':>26s} {'params':>7s} {'grads':>6s} {'master':>7s} {'moments':>8s} "
        f"{'total':>6s}")
    for name, kinds in per.items():
        say(f"  {name:>26s} " + " ".join(f"{kinds[k]:{w}.0f}" for k, w in
                                         (("params", 7), ("grads", 6), ("master", 7),
                                          ("moments", 8))) + f" {sum(kinds.values()):6.0f}")
    say("  FP8 lives in the GEMMs: the optimizer's 16 bytes stay. Per Linear weight element, "
        "the FP8 copy a GEMM",
        "  reads (data + scales): " + ", ".join(f"{r} {b:.5f}" for r, b in copy.items())
        + " (bf16: 2); per element of",
        "  the activation of part 2 kept for backward: " + ", ".join(
            f"{r} {b:.5f}" for r, b in saved.items()) + " (bf16: 2).")
    for name, kinds in per.items():
        check(f"{name} AdamW holds 16 bytes per parameter", sum(kinds.values()) == 16, "16",
              f"{sum(kinds.values()):.4f}")
    check("an FP8 weight copy takes 1 byte an element plus its scales (under 1.05)",
          all(1 < b < 1.05 for b in copy.values()), "(1, 1.05)",
          ", ".join(f"{b:.5f}" for b in copy.values()))
    check("an FP8 input kept for backward takes about half of bf16's 2 bytes (under 1.05)",
          all(1 < b < 1.05 for b in saved.values()), "(1, 1.05)",
          ", ".join(f"{b:.5f}" for b in saved.values()))


def part4_data_parallel(world, data, vocab, steps, serial):
    """DDP over the FP8 model, each rank its share of every batch: blockwise, whose tiles (1x128 per
    token; 128 tokens for the weight gradient) and weight blocks are the serial run's; one step
    of tensorwise, whose amax is each rank's half's. ``serial``: the runs of part 1."""
    if world.size == 1:
        say("\nPart 4: one rank: run on 2 ranks for data parallel over the FP8 model")
        return
    losses, model = train("blockwise", data, vocab, steps, world)
    flat = np.concatenate([backend.to_numpy(p.data).astype(np.float32).ravel()
                           for p in model.parameters()])
    everyone = world.all_gather_object(flat)
    apart = max(float(np.abs(f - everyone[0]).max()) for f in everyone)
    mean = np.mean(world.all_gather_object(losses), axis=0)  # equal shares: the batch's mean
    gaps = np.abs(mean - serial["blockwise"])
    gap, worst = float(gaps.max()), int(gaps.argmax())
    one_step = world.all_gather_object(train("tensorwise", data, vocab, 1, world)[0])
    first = {"blockwise": abs(mean[0] - serial["blockwise"][0]),
             "tensorwise": abs(np.mean(one_step) - serial["tensorwise"][0])}
    say(f"\nPart 4: DDP over the blockwise FP8 model on {world.size} ranks, "
        f"{BATCH // world.size} sequences each, {steps} steps",
        f"  parameters across ranks: max |diff| = {apart:.3g}; the ranks' mean loss against "
        f"the serial FP8 run: max gap {gap:.2e} (step {worst})",
        f"  step 0's loss against serial's: blockwise {first['blockwise']:.1e} (its tiles are "
        f"the serial run's), tensorwise {first['tensorwise']:.1e}",
        "  (each rank's amax is its share's); later steps add the float32 sums' order, as any "
        "DDP run does.",
        f"  One rank sends {model.sent / flat.size:.3f} bytes per parameter a step (ring: "
        f"2(N-1)/N x 2 = {4 * (world.size - 1) / world.size:.3f}): DDP all-reduces the bf16 "
        "gradients;",
        "  FP8 changes the GEMMs, not the messages (float8_compress_hook sends e5m2 gradients, "
        "half of these bytes:",
        "  docs/float8.md, tests/test_float8_comm.py).")
    sent = model.sent / flat.size
    check("DDP over FP8: the parameters are equal on every rank", apart == 0, "0",
          f"{apart:.3g}")
    check(f"DDP over FP8 stays within {FP8_BAND} of the serial FP8 run's loss", gap <
          FP8_BAND, f"< {FP8_BAND}", f"{gap:.2e}")
    check("at step 0 DDP blockwise has the serial loss (< 1e-5), tensorwise does not "
          "(> 1e-4)", first["blockwise"] < 1e-5 < 1e-4 < first["tensorwise"],
          "< 1e-5 and > 1e-4", f"{first['blockwise']:.1e} and {first['tensorwise']:.1e}")
    ring = 4 * (world.size - 1) / world.size
    check("DDP over FP8 sends bf16 gradients: 2(N-1)/N x 2 bytes per parameter (1%)",
          abs(sent - ring) < 0.01 * ring, f"{ring:.3f}", f"{sent:.3f}")



def draw_figures(directory, runs, spiked, flush_below):
    figure(directory, "17_loss", lambda figures: figures.loss_chart(
        {("serial " if k == "bf16" else "fp8 " if k in RECIPES else "") + k: r
         for k, r in runs.items()},
        title=f"The tiny GPT in fp32, bf16 and FP8 under four recipes: the FP8 runs within "
              f"{FP8_BAND} of bf16's loss"))
    tiles = quantize_tiles(spiked)
    tensorwise = quantize_tensorwise(spiked)
    nonzero = spiked != 0
    figure(directory, "17_outliers", lambda figures: figures.magnitude_chart(
        {"activation, outliers planted": spiked,
         "flushed to 0 by one tensor-wise scale":
             spiked[nonzero & (tensorwise.data.astype(np.float32) == 0)],
         "flushed to 0 by 1x128 tiles":
             spiked[nonzero & (tiles.data.astype(np.float32) == 0)]},
        {"tensor-wise: reads 0 below": flush_below},
        title="One activation with 10^4x outliers in e4m3: one scale for the tensor flushes "
              "its small values, 1x128 tiles keep them"))


def main():
    args = arguments(__doc__, plot=True)
    world = mpi_world(__doc__, ranks=(1, 2, 4))
    try:  # FP8 arrays live on NumPy: on CuPy (and the strict device) one line says so
        backend.check_dtype("float8_e4m3fn")
    except TypeError as error:
        if world.rank == 0:
            print(f"lesson 17 needs the CPU: {error} minipar lesson 17 -n 2", file=sys.stderr,
                  flush=True)
        raise SystemExit(2)
    text = load_text("sonnets")
    tok = CharTokenizer(text)
    data = np.array(tok.encode(text))
    steps = 12 if args.quick else 50
    runs = part1_training(world, data, tok.vocab_size, steps)
    _, trained = train("bf16", data, tok.vocab_size, steps)
    a, spiked, flush_below = part2_outliers(trained, data, steps)
    part3_bytes(tok.vocab_size, a)
    part4_data_parallel(world, data, tok.vocab_size, steps, runs)
    if world.rank == 0:
        draw_figures(args.plot, runs, spiked, flush_below)
    return finish("FP8 trains the tiny GPT as bf16 does under every recipe; 1x128 tiles keep "
                  "the small values one scale flushes")


if __name__ == "__main__":
    raise SystemExit(main())
