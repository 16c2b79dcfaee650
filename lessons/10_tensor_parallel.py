"""Lesson 10: tensor parallelism: split each layer's matrices, not the batch (Megatron-LM).

    mpiexec -n 2 python lessons/10_tensor_parallel.py        (works with -n 4; add --quick)

All ranks form one tensor group of size p, and every rank sees the same batch. Each rank holds
1/p of every weight matrix (``minipar/parallel/tensor/``) and computes 1/p of every layer.
The ranks talk inside each layer, so the group must be the fastest-connected set of ranks.
This lesson measures, in float64 against the serial twin built from the same seed:

  1. the MLP: split A₁ by columns and A₂ by rows, because of the GeLU between them;
  2. attention split by heads;
  3. the vocab-parallel loss: equal to the serial loss, and the bytes it moves compared with
     gathering the logits;
  4. the whole GPT: equal losses over a few AdamW steps, and the all-reduces per layer and step
     beside Megatron's count, then the same with sequence parallelism.

Read next: minipar/parallel/tensor/mappings.py, layers.py, embedding.py, then gpt.py; proved by
tests/test_tensor_parallel.py.
"""
import numpy as np

import minipar
from minipar import Tensor, nn, optim
from minipar import functional as F
from minipar.parallel import tensor as tp
from minipar.parallel.tensor import accounting, shard_from_serial, tally

from _kit import arguments, check, finish, mpi_world, say

args = arguments(__doc__, quick="a smaller model, fewer steps")
B, T, C, H = (2, 8, 16, 4) if args.quick else (4, 32, 64, 8)
world = mpi_world(__doc__, ranks=[n for n in (2, 4, 8) if H % n == 0])  # p divides the heads
rank, p = world.rank, world.size
TOL = 1e-10  # float64: tensor parallel sums in another order than serial


def equal(what, diff):
    """Check that a tensor-parallel result equals the serial one within TOL."""
    check(f"{what} equals serial (float64, |diff| < {TOL:g})", diff < TOL, f"< {TOL:g}",
          f"{diff:.1e}")


def worst(a, b):
    """The largest |a - b| over every rank, compared on the host (a GPU's arrays copied there)."""
    diff = np.abs(minipar.to_numpy(a) - minipar.to_numpy(b))
    return max(world.all_gather_object(float(diff.max())))


def joined(pieces):
    """Every rank's slice side by side along the last axis, on the host."""
    return np.concatenate([minipar.to_numpy(piece) for piece in pieces], axis=-1)


def part1_mlp(B, T, C):
    say(f"Part 1. The MLP GeLU(X A₁ᵀ) A₂ᵀ on p = {p} ranks, X of shape ({B}, {T}, {C})")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B * T, C))
    a1 = rng.standard_normal((4 * C, C)) / np.sqrt(C)
    gelu = lambda z: F.gelu(Tensor(z)).data  # noqa: E731
    # Column split: rank r keeps rows of A₁ (output features); its GeLU slice is final.
    mine = gelu(x @ tp.shard(a1, 0, rank, p).T)
    whole = joined(world.all_gather(mine))
    say(f"  A₁ by columns: concatenated GeLU(X A₁,ᵣᵀ) vs GeLU(X A₁ᵀ): max |diff| = "
        f"{worst(whole, gelu(x @ a1.T)):.1e}  (no communication before GeLU)")
    # Row split: rank r keeps columns of A₁ (input features): a partial sum per rank.
    partial = tp.shard(x, 1, rank, p) @ tp.shard(a1, 1, rank, p).T
    sum_of_gelus = world.all_reduce(gelu(partial))
    gelu_of_sum = gelu(world.all_reduce(partial))
    say(f"  A₁ by rows:    Σᵣ GeLU(partialᵣ) vs GeLU(Σᵣ partialᵣ): max |diff| = "
        f"{worst(sum_of_gelus, gelu_of_sum):.2f}  -> an all-reduce would be needed before GeLU",
        "  So A₁ is split by columns. A₂ then takes the split features as its split input rows,",
        "  and a single all-reduce (g) sums the partial outputs.")
    minipar.manual_seed(1)
    serial = nn.MLP(C).double()
    minipar.manual_seed(1)
    mlp = tp.ParallelMLP(C, world).double()
    xt, xs = (Tensor(x.reshape(B, T, C), requires_grad=True) for _ in range(2))
    with tp.CollectiveLog() as log:
        y = mlp(xt)
        y.sum().backward()
    y_serial = serial(xs)
    y_serial.sum().backward()
    directions = [e["direction"] for e in log.events]
    equal("ParallelMLP's output", worst(y.data, y_serial.data))
    equal("ParallelMLP's dX", worst(xt.grad, xs.grad))
    counts = (directions.count("forward"), directions.count("backward"))
    check("ParallelMLP: one all-reduce forward (g), one backward (f)", counts == (1, 1), (1, 1),
          counts)
    shapes = lambda m: (tuple(m.c_fc.weight.shape), tuple(m.c_proj.weight.shape))  # noqa: E731
    say(f"  ParallelMLP vs nn.MLP (same seed): output diff {worst(y.data, y_serial.data):.1e}, "
        f"dX diff {worst(xt.grad, xs.grad):.1e}; all-reduces: "
        f"{directions.count('forward')} forward (g), {directions.count('backward')} backward (f)",
        "  each rank holds c_fc %s and c_proj %s of the serial %s and %s" % (shapes(mlp)
                                                                            + shapes(serial)), "")


def part2_heads(B, T, C, H):
    say(f"Part 2. Attention split by heads: {H} heads of d = {C // H} over {p} ranks")
    minipar.manual_seed(2)
    serial = nn.CausalSelfAttention(C, H).double()
    minipar.manual_seed(2)
    attn = tp.ParallelSelfAttention(C, H, world).double()
    x = np.random.default_rng(1).standard_normal((B, T, C))
    heads = list(range(rank * attn.local_heads, (rank + 1) * attn.local_heads))
    owned = world.gather_object((heads, tuple(attn.c_attn.weight.shape),
                                 tuple(attn.c_proj.weight.shape)))
    for r, (hs, qkv, proj) in enumerate(owned or []):
        say(f"  rank {r}: heads {hs}: c_attn rows for their q, k, v {qkv}, c_proj columns {proj}")
    diff = worst(attn(Tensor(x)).data, serial(Tensor(x)).data)
    equal("attention split by heads", diff)
    say(f"  output vs nn.CausalSelfAttention: max |diff| = {diff:.1e}", "")


def part3_loss(N, V):
    say(f"Part 3. Cross-entropy over a vocabulary of {V}, {N} tokens, logits split by vocabulary")
    rng = np.random.default_rng(2)
    logits, targets = rng.standard_normal((N, V)) * 2, rng.integers(0, V, N)
    mine = tp.shard(logits, 1, rank, p)
    world.counters.reset()
    with tp.CollectiveLog() as log:
        loss = tp.vocab_parallel_cross_entropy(mine, targets, world)
    sent_vp = world.counters.bytes_sent
    world.counters.reset()
    gathered = joined(world.all_gather(mine))
    sent_gather = world.counters.bytes_sent
    serial = F.cross_entropy(Tensor(logits), targets)
    equal("the vocab-parallel loss", worst(loss.data, serial.data))
    check("the vocab-parallel loss: 3 all-reduces of N numbers", len(log.events) == 3 and
          all(e["bytes"] == N * 8 for e in log.events), f"3 of {N * 8} B",
          [e["bytes"] for e in log.events])
    say(f"  vocab-parallel loss {loss.item():.12f}, serial loss {serial.item():.12f}, "
        f"|diff| {worst(loss.data, serial.data):.1e}",
        f"  vocab-parallel: {len(log.events)} all-reduces of {N} numbers (max, Σexp, target "
        f"logit): {sum(e['bytes'] for e in log.events):,} B, rank 0 sent {sent_vp:,} B",
        f"  gathering the logits instead: {gathered.nbytes:,} B on every rank, rank 0 sent "
        f"{sent_gather:,} B ({sent_gather / max(sent_vp, 1):.0f}× more); backward moves nothing",
        "")


def part4_gpt(config, B, steps):
    say(f"Part 4. TensorParallelGPT vs nn.GPT: {config.n_layer} layers, C = {config.n_embd}, "
        f"{config.n_head} heads, vocabulary {config.vocab_size}, batch {B}×{config.block_size}")
    text = np.random.default_rng(3).integers(0, config.vocab_size, (B, config.block_size + 1))
    ids, targets = text[:, :-1], text[:, 1:]
    largest = 0.0
    for sp in (False, True):
        minipar.manual_seed(4)
        serial = nn.GPT(config).double()
        model = shard_from_serial(serial, world, sequence_parallel=sp)
        say(f"  sequence_parallel={sp}: each rank holds {model.num_parameters():,} of "
            f"{serial.num_parameters():,} parameters")
        opts = [optim.AdamW(m.parameters(), lr=3e-3) for m in (serial, model)]
        for step in range(steps):
            _, ref = serial(ids, targets)
            ref.backward()
            with tp.CollectiveLog() as log:
                _, loss = model(ids, targets)
                loss.backward()
                model.finalize_grads()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            diff = worst(loss.data, ref.data)
            largest = max(largest, diff)
            say(f"    step {step}: loss {loss.item():.10f}   serial {ref.item():.10f}   "
                f"|diff| {diff:.1e}")
        act = B * config.block_size * config.n_embd * 8
        ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        for where, way in tally(log.events).items():
            if where.startswith("blocks"):
                counts = {op: (way["forward"][op][0], way["backward"][op][0]) for op in ops}
                check(f"sequence_parallel={sp}, {where}: Megatron's 2 forward + 2 backward "
                      f"of each of {', '.join(ops)}", set(counts.values()) == {(2, 2)},
                      {op: (2, 2) for op in ops}, counts)
        say(f"  tensor-group collectives of the last step (one activation B·T·C·8 = {act:,} B):",
            *("    " + line for line in accounting(log.events, p)), "")
    say("Each layer costs two all-reduces forward and two backward, as Megatron counts. Sequence",
        "parallelism swaps each for a reduce-scatter or an all-gather of the same tensor. A ring",
        "all-reduce *is* a reduce-scatter then an all-gather, 2(p-1)/p·n bytes sent per rank, so",
        "the traffic is unchanged ('auto' picks recursive doubling, n·log p, for tensors this",
        "small, hence the 'sent' column). In exchange LayerNorm and dropout store 1/p of their",
        "activations. The loss sends 3 numbers per token, never the logits.")
    return largest


def main():
    say(f"Tensor parallel over {p} ranks (one tensor group), float64\n")
    part1_mlp(B, T, C)
    part2_heads(B, T, C, H)
    part3_loss(B * T, 512 if args.quick else 8192)
    config = nn.GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=H, n_embd=C)
    largest = part4_gpt(config, B, 2 if args.quick else 4)
    equal("TensorParallelGPT's losses over every step", largest)
    return finish("every tensor-parallel piece equals its serial twin, with Megatron's "
                  "collectives per layer")


if __name__ == "__main__":
    raise SystemExit(main())
