"""Lesson 14: long context: the sequence split over cp ranks, attention passed round a ring.

    mpiexec -n 4 python lessons/14_long_context.py        (works with -n 2; add --quick)

Attention is the one part of a transformer where a token needs every token before it, and the
part whose memory grows fastest with the context. Context parallelism (Liu et al. 2023, "Ring
Attention"; Megatron-core's ``context_parallel``) gives each of cp ranks 1/cp of the sequence's
queries, keys and values; the k/v blocks travel round a ring for cp − 1 steps, each folded into
the output by the online softmax, so no rank ever holds the whole sequence. The lesson runs cp =
1, 2 and 4 as splits of the world (as lesson 06 does for N) and measures, in float64:

  1. the activation memory one rank keeps for backward, against T, beside its formula
     B·H·(T/cp)·(d + 1) (ActivationMemory), and serial attention's B·H·T² probabilities;
  2. the ring's timeline: the k/v chunks each rank holds at each step, the causal blocks it
     computes, masks or skips (RingLog);
  3. the causal work per rank, contiguous against the zig-zag layout (rank r holds chunks r and
     2·cp − 1 − r): last / first about 2·cp − 1 against 1 (RingLog);
  4. the bytes one rank sends per step: its k and v, 2·(cp − 1)/cp of k's bytes over the forward
     (the comm counters);
  5. outputs and dq, dk, dv gathered back equal to serial attention on the whole sequence;
  6. Ulysses beside the ring (DeepSpeed-Ulysses, Jacobs et al. 2023; ``ulysses_attention`` in
     minipar/parallel/context/ulysses.py): the same shards, moved by all-to-alls so that each
     rank holds the whole sequence of H/cp heads. Equal to the ring and to serial attention;
     the bytes each rank sends, counted, beside (cp − 1) k/v blocks for the ring and
     4·(cp − 1)/cp·B·(N/cp)·h for Ulysses (h = H·d); the head-count rule, H a multiple of cp,
     and its refusal; a table of the two schemes.

Read next: minipar/parallel/context/layout.py, ring.py, work.py, ulysses.py, then
docs/context_parallel.md; proved by tests/test_context_parallel.py, tests/test_ulysses.py.
"""
import numpy as np

from minipar import Tensor, to_numpy
from minipar.attention import causal_self_attention
from minipar.memory import ActivationMemory
from minipar.parallel.context import (LAYOUTS, RingLog, gather_sequence, rank_chunks,
                                      ring_attention, split_sequence, ulysses_attention)

from _kit import arguments, check, figure, finish, mpi_world, say

B, H, D = 2, 2, 8  # batch, heads, head size
BYTES = 8  # float64: the equality below is to 1e-10
TOL = 1e-10
MARKS = {"full": "F", "diagonal": "D", "skipped": "."}


def sequence(T, seed=0, heads=H):
    """q, k, v and an output weight w (the loss is Σ out ⊙ w) of the whole sequence, the same on
    every rank: (B, heads, T, D) NumPy arrays."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, heads, T, D)) for _ in range(4)]


def local(arrays, group, layout="balanced"):
    """This rank's chunks of each whole-sequence array, as leaves that want gradients."""
    return [Tensor(split_sequence(a, group, dim=2, layout=layout), requires_grad=True)
            for a in arrays]


def ring_memory(group, T):
    """Bytes the ring's forward keeps for backward on this rank (q, k, v are leaves, uncounted)."""
    q, k, v = local(sequence(T)[:3], group)
    with ActivationMemory() as memory:
        ring_attention(q, k, v, group)
    return memory.peak_bytes


def serial_memory(T):
    q, k, v = (Tensor(a, requires_grad=True) for a in sequence(T)[:3])
    with ActivationMemory() as memory:
        causal_self_attention(q, k, v)
    return memory.peak_bytes


def part1_memory(groups, lengths):
    """{cp: [bytes at each T]} on this rank, and serial attention's on the whole sequence."""
    held = {cp: [ring_memory(group, T) for T in lengths] for cp, group in groups.items()}
    serial = [serial_memory(T) for T in lengths]
    say("Part 1: kB one rank keeps for backward in attention, measured (ActivationMemory) / "
        "formula",
        f"  B = {B}, H = {H}, d = {D}, float64. Ring attention keeps its output and one "
        "log-sum-exp per query:",
        "  B·H·(T/cp)·(d + 1) numbers; serial attention keeps the probabilities, B·H·T².",
        f"  {'T':>5s} {'serial':>19s} " + " ".join(f"{f'ring cp = {cp}':>15s}" for cp in held))
    for n, T in enumerate(lengths):
        ring = [f"{held[cp][n] / 1e3:.1f} / {ring_formula(T, cp) / 1e3:.1f}" for cp in held]
        say(f"  {T:5d} {f'{serial[n] / 1e3:.1f} / {serial_formula(T) / 1e3:.1f}':>19s} "
            + " ".join(f"{cell:>15s}" for cell in ring))
    say("  At cp = 1 the ring keeps what FlashAttention keeps: no T² probabilities (backward "
        "recomputes them).",
        "  Each rank holds 1/cp of the queries, so 1/cp of what they keep; q, k, v themselves "
        "(the block's",
        "  inputs, not counted here) are 1/cp of the sequence too.")
    for cp in held:
        formula = [ring_formula(T, cp) for T in lengths]
        check(f"cp = {cp}: a rank keeps B·H·(T/cp)·(d + 1) numbers for backward at each T",
              held[cp] == formula, formula, held[cp])
        worst = max(abs(m * cp / one - 1) for m, one in zip(held[cp], held[1]))
        check(f"cp = {cp}: 1/cp of cp = 1's memory, within 5 %", worst <= 0.05, "≤ 0.05",
              f"{worst:.3f}")
    formula = [serial_formula(T) for T in lengths]
    check("serial attention keeps B·H·T² probabilities", serial == formula, formula, serial)
    return held, serial


def ring_formula(T, cp):
    return B * H * (T // cp) * (D + 1) * BYTES


def serial_formula(T):
    return B * H * T * T * BYTES


def part2_timeline(group, T):
    """Each rank's forward steps (RingLog) in the balanced layout, on the group's rank 0."""
    q, k, v = local(sequence(T)[:3], group)
    with RingLog() as log:
        ring_attention(q, k, v, group)
    steps = group.gather_object(log.steps("forward"))
    cp = group.size
    say(f"\nPart 2: the ring's steps at cp = {cp}, T = {T}, balanced layout (RingLog): the "
        f"sequence in {2 * cp} chunks,",
        "  rank r's queries are chunks r and 2·cp − 1 − r. At each step a rank holds another "
        "rank's k/v",
        "  chunks (they move one rank on per step) and runs four blocks: its first q chunk "
        "against the two,",
        "  then its second. F full, D on the diagonal (masked), . skipped (above the diagonal: "
        "not computed)")
    if group.rank != 0:
        return steps
    say("  " + " " * 14 + "".join(f"{f'step {s}':16s}" for s in range(cp)).rstrip())
    for r, rows in enumerate(steps):
        mine = rank_chunks(r, cp)
        # the k/v chunks in hand, then the marks of the first q chunk, a space, the second's
        cells = [f"kv {blocks[0][1]},{blocks[1][1]}  " + "".join(MARKS[b[2]] for b in blocks[:2])
                 + " " + "".join(MARKS[b[2]] for b in blocks[2:]) for blocks in rows]
        say(f"  rank {r} q {mine[0]},{mine[1]}  " + "".join(f"{c:16s}" for c in cells).rstrip())
    held = [[(blocks[0][1], blocks[1][1]) for blocks in rows] for rows in steps]
    want = [[rank_chunks((r - s) % cp, cp) for s in range(cp)] for r in range(cp)]
    check("at step s rank r holds rank r − s's k/v chunks (cp steps)", held == want, want, held)
    skipped = [sum(b[2] == "skipped" for blocks in rows for b in blocks) for rows in steps]
    check(f"balanced: every rank skips the 2·cp − 1 = {2 * cp - 1} blocks above the diagonal",
          skipped == [2 * cp - 1] * cp, [2 * cp - 1] * cp, skipped)
    return steps


def work(group, T, layout):
    """RingLog's forward totals on this rank for ``layout``."""
    q, k, v = local(sequence(T)[:3], group, layout)
    with RingLog() as log:
        ring_attention(q, k, v, group, layout=layout)
    return log.work("forward")


def causal_formula(rank, cp, T, layout):
    """Score entries on or below the diagonal for rank's queries: query chunk i sees i whole
    chunks and the lower triangle of its own, i·c² + c(c + 1)/2 per batch and head."""
    c = T // (2 * cp)
    return B * H * sum(i * c * c + c * (c + 1) // 2 for i in rank_chunks(rank, cp, layout))


def part3_work(group, T):
    """{layout: [work of each rank]} on the group's rank 0 (None elsewhere)."""
    cp = group.size
    found = {layout: group.gather_object(work(group, T, layout))
             for layout in ("contiguous", "balanced")}
    say(f"\nPart 3: causal work per rank at cp = {cp}, T = {T} (RingLog): score entries on or "
        "below the diagonal",
        "  (thousands, measured / formula) and blocks computed of the 4·cp each rank meets")
    if group.rank != 0:
        return None
    say(f"  {'':8s} {'contiguous':>22s} {'balanced (zig-zag)':>22s}")
    for r in range(cp):
        cells = [f"{w[r]['causal'] / 1e3:.1f} / {causal_formula(r, cp, T, layout) / 1e3:.1f}"
                 f"  {w[r]['blocks']:2d} blk" for layout, w in found.items()]
        say(f"  rank {r} " + " ".join(f"{c:>22s}" for c in cells))
    for layout, w in found.items():
        counts = [x["causal"] for x in w]
        say(f"  {layout}: last / first {counts[-1] / counts[0]:.2f}, max / min "
            f"{max(counts) / min(counts):.2f} (2·cp − 1 = {2 * cp - 1})")
    say("  Contiguous: rank 0's queries see almost no keys, the last rank's see them all; every "
        "ring step",
        "  waits for the slowest. Zig-zag: one chunk from the cheap front of the triangle, one "
        "from its dear end.")
    for layout, w in found.items():
        counts = [x["causal"] for x in w]
        want = [causal_formula(r, cp, T, layout) for r in range(cp)]
        check(f"{layout}: causal work per rank as its formula", counts == want, want, counts)
    balanced = [x["causal"] for x in found["balanced"]]
    check("balanced: causal work within 10 % across ranks", max(balanced) <= 1.1 * min(balanced),
          "max / min ≤ 1.10", f"{max(balanced) / min(balanced):.3f}")
    contiguous = [x["causal"] for x in found["contiguous"]]
    ratio = contiguous[-1] / contiguous[0]
    check(f"contiguous: the last rank does about 2·cp − 1 = {2 * cp - 1} times the first's work "
          "(± 10 %)", abs(ratio / (2 * cp - 1) - 1) <= 0.1, f"{2 * cp - 1} ± 10 %", f"{ratio:.2f}")
    return found


def part4_bytes(groups, T):
    """Per cp, this rank's forward messages and bytes, backward bytes, and its k + v bytes."""
    sent = {}
    for cp, group in groups.items():
        *qkv, w = sequence(T)
        q, k, v = local(qkv, group)
        w = split_sequence(w, group, dim=2)
        group.counters.reset()
        out = ring_attention(q, k, v, group)
        forward = group.counters.snapshot()
        (out * w).sum().backward()
        backward = group.counters.bytes_sent - forward["bytes_sent"]
        sent[cp] = (forward["messages_sent"], forward["bytes_sent"], backward,
                    q.data.nbytes + k.data.nbytes)
    whole_k = B * H * T * D * BYTES
    say(f"\nPart 4: bytes one rank sends at T = {T} (comm counters); k of the whole sequence "
        f"is {whole_k / 1e3:.1f} kB",
        f"  {'cp':>3s} {'forward msgs':>12s} {'kB per step':>12s} {'own k+v':>16s} "
        f"{'forward kB':>11s} {'2(cp-1)/cp k':>13s} {'backward kB':>12s} {'(2cp-1) k+v':>12s}")
    for cp, (messages, forward, backward, kv) in sent.items():
        per_step = forward / messages if messages else 0.0
        say(f"  {cp:3d} {messages:12d} {per_step / 1e3:12.1f} {kv / 1e3:16.1f} "
            f"{forward / 1e3:11.1f} {2 * (cp - 1) / cp * whole_k / 1e3:13.1f} "
            f"{backward / 1e3:12.1f} {(2 * cp - 1) * kv / 1e3 if cp > 1 else 0:12.1f}")
    say("  One message a step: the k and v block in hand, sent on to rank r + 1 while the block "
        "is computed.",
        "  Backward sends k and v round again (cp − 1 moves) and the dk, dv accumulators with "
        "them (cp moves,",
        "  the last one home to their owner). Each message is 1/cp of the sequence, but there "
        "are cp − 1 of",
        "  them: 2·(cp − 1)/cp of k's bytes forward, 2·(2·cp − 1)/cp backward, toward 2 and 4 "
        "as cp grows.")
    for cp, (messages, forward, backward, kv) in sent.items():
        want = (cp - 1, 2 * (cp - 1) * whole_k // cp, (2 * cp - 1) * kv if cp > 1 else 0)
        check(f"cp = {cp}: one k+v message a step, 2·(cp − 1)/cp of k in the forward, "
              "(2·cp − 1) k+v blocks in the backward", (messages, forward, backward) == want,
              want, (messages, forward, backward))


def part5_equal(groups, T):
    """{(cp, layout): largest |ring − serial| over out, dq, dk, dv} on this rank."""
    arrays = sequence(T, seed=1)
    leaves = [Tensor(a, requires_grad=True) for a in arrays[:3]]
    out = causal_self_attention(*leaves)
    (out * arrays[3]).sum().backward()
    want = [to_numpy(out.data)] + [to_numpy(t.grad) for t in leaves]
    errors = {}
    for cp, group in groups.items():
        for layout in LAYOUTS:
            whole = [Tensor(a, requires_grad=True) for a in arrays[:3]]
            # differentiable both ways: split's backward gathers, gather's backward splits
            mine = [split_sequence(t, group, dim=2, layout=layout) for t in whole]
            o = gather_sequence(ring_attention(*mine, group, layout=layout), group, dim=2,
                                layout=layout)
            (o * arrays[3]).sum().backward()
            got = [to_numpy(o.data)] + [to_numpy(t.grad) for t in whole]
            errors[cp, layout] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    say(f"\nPart 5: ring attention gathered back against serial causal attention on the whole "
        f"sequence, T = {T}",
        "  largest |difference| over the output and dq, dk, dv (float64):",
        *(f"  cp = {cp} {layout:10s} {e:.1e}" for (cp, layout), e in errors.items()))
    worst = max(errors.values())
    check(f"ring attention equals serial attention (out, dq, dk, dv; ≤ {TOL:g})", worst <= TOL,
          f"≤ {TOL:g}", f"{worst:.1e}")


H_U = (4, 8)  # Part 6's head counts: Ulysses gives each rank H/cp whole heads, so H a multiple of 4


def both(group, q, k, v, w, layout, gather=True):
    """Ring and Ulysses attention on the same shards of the whole q, k, v (B, heads, T, D):
    {scheme: (out, dq, dk, dv gathered back (None unless ``gather``), forward (messages,
    bytes), backward bytes)}."""
    found = {}
    for name, attention in (("ring", ring_attention), ("Ulysses", ulysses_attention)):
        mine = [Tensor(split_sequence(a, group, dim=2, layout=layout), requires_grad=True)
                for a in (q, k, v)]
        group.counters.reset()
        out = attention(*mine, group, layout=layout)
        forward = group.counters.snapshot()
        (out * split_sequence(w, group, dim=2, layout=layout)).sum().backward()
        backward = group.counters.bytes_sent - forward["bytes_sent"]
        # to the host: the serial answer it is compared with is NumPy's (as part 5's)
        gathered = [to_numpy(gather_sequence(a, group, dim=2, layout=layout))
                    for a in [out.data] + [t.grad for t in mine]] if gather else None
        found[name] = (gathered, (forward["messages_sent"], forward["bytes_sent"]), backward)
    return found


def ring_bytes(cp, T, heads):
    """(forward, backward) bytes a rank sends in ring attention: (cp − 1) k/v blocks, then
    (2·cp − 1); a block is B·heads·(T/cp)·D elements of each of k and v."""
    block = 2 * B * heads * (T // cp) * D * BYTES
    return (cp - 1) * block, (2 * cp - 1) * block if cp > 1 else 0


def ulysses_bytes(cp, T, heads):
    """Forward = backward bytes a rank sends in Ulysses attention: four all-to-alls (q, k, v,
    then the output; the backward runs them the other way), each keeping 1/cp of this rank's
    B·(T/cp)·h elements at home, h = heads·D: 4·(cp − 1)/cp·B·(T/cp)·h."""
    elements = 4 * (cp - 1) * B * (T // cp) * heads * D
    assert elements % cp == 0  # whole rows: H/cp heads of each of this rank's tokens
    return elements // cp * BYTES


def part6_ulysses(groups, lengths):
    """Ulysses beside the ring on the same shards: equal outputs and gradients, the bytes of
    each against its formula, the head-count rule and its refusal, and the table of the two."""
    say("\nPart 6: Ulysses beside the ring (DeepSpeed-Ulysses, ulysses_attention): the same "
        "shards, each rank",
        "  N/cp tokens of all H heads. Ulysses moves them by one all-to-all on each of q, k and "
        "v: every rank",
        "  then holds the whole sequence of H/cp heads, runs serial attention on it, and an "
        "inverse all-to-all",
        "  brings the output back to its own tokens. The ring moves k/v blocks and never holds "
        "the sequence.")
    split = {cp: g for cp, g in groups.items() if cp > 1}
    # equality: both schemes on the same shards, both layouts, against serial attention
    T, heads = lengths[0], H_U[0]
    q, k, v, w = sequence(T, seed=3, heads=heads)
    leaves = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    out = causal_self_attention(*leaves)
    (out * w).sum().backward()
    serial = [to_numpy(out.data)] + [to_numpy(t.grad) for t in leaves]
    scale = min(float(np.max(np.abs(a))) for a in serial)
    errors, sent = {}, {}
    for cp, group in split.items():
        for layout in LAYOUTS:
            found = both(group, q, k, v, w, layout)
            ring, uly = found["ring"][0], found["Ulysses"][0]
            errors[cp, layout] = [max(float(np.max(np.abs(a - b))) for a, b in zip(x, y))
                                  for x, y in ((uly, serial), (uly, ring), (ring, serial))]
    say(f"  T = {T}, H = {heads}, float64: largest |difference| over out, dq, dk, dv "
        f"(the smallest of their largest values is {scale:.2f})",
        f"  {'cp':>4s} {'layout':10s} {'Ulysses-serial':>15s} {'Ulysses-ring':>13s} "
        f"{'ring-serial':>12s}",
        *(f"  {cp:4d} {layout:10s} " + " ".join(f"{e:{n}.1e}" for e, n in zip(es, (15, 13, 12)))
          for (cp, layout), es in errors.items()))
    worst = max(max(es) for es in errors.values())
    check(f"Ulysses equals ring attention and serial attention (out, dq, dk, dv; ≤ {TOL:g}: "
          "float64 sums in another order differ by ~1e-15, a wrong block or head by ~1)",
          worst <= TOL and TOL < 1e-6 * scale, f"≤ {TOL:g}", f"{worst:.1e}")
    # bytes: counted by the communicator, against each formula, at two lengths and head counts
    for cp, group in split.items():
        for T in lengths:
            for heads in H_U:
                found = both(group, *sequence(T, seed=4, heads=heads), "balanced", gather=False)
                sent[cp, T, heads] = {name: f[1:] for name, f in found.items()}
    say(f"\n  Bytes one rank sends (comm counters, kB, measured / formula), h = H·d, d = {D}, "
        "float64:",
        f"  {'cp':>4s} {'T':>5s} {'H':>3s} {'ring fwd msgs':>13s} {'ring forward':>14s} "
        f"{'ring backward':>15s} {'Ulysses msgs':>13s} {'Ulysses fwd':>14s} {'Ulysses bwd':>14s}")
    for (cp, T, heads), f in sent.items():
        (r_msgs, r_fwd), r_bwd = f["ring"]
        (u_msgs, u_fwd), u_bwd = f["Ulysses"]
        rf, rb = ring_bytes(cp, T, heads)
        uf = ulysses_bytes(cp, T, heads)
        say(f"  {cp:4d} {T:5d} {heads:3d} {r_msgs:13d} "
            + " ".join(f"{f'{m / 1e3:.1f} / {x / 1e3:.1f}':>{n}s}"
                       for m, x, n in ((r_fwd, rf, 14), (r_bwd, rb, 15)))
            + f" {u_msgs:13d} "
            + " ".join(f"{f'{m / 1e3:.1f} / {x / 1e3:.1f}':>14s}"
                       for m, x in ((u_fwd, uf), (u_bwd, uf))))
    for cp in split:
        got = {key[1:]: f for key, f in sent.items() if key[0] == cp}
        ring = {key: (f["ring"][0][0], f["ring"][0][1], f["ring"][1]) for key, f in got.items()}
        want = {key: (cp - 1, *ring_bytes(cp, *key)) for key in got}
        check(f"cp = {cp}: the ring sends cp − 1 messages, (cp − 1) k/v blocks forward and "
              "(2·cp − 1) backward, exactly (each T, H)", ring == want, want, ring)
        uly = {key: (f["Ulysses"][0][0], f["Ulysses"][0][1], f["Ulysses"][1])
               for key, f in got.items()}
        want = {key: (4 * (cp - 1), ulysses_bytes(cp, *key), ulysses_bytes(cp, *key))
                for key in got}
        check(f"cp = {cp}: Ulysses sends 4 all-to-alls of cp − 1 messages, 4·(cp − 1)/cp·B·"
              "(N/cp)·h elements each way, exactly (each T, H)", uly == want, want, uly)
    ratio = {key: f["Ulysses"][0][1] / f["ring"][0][1] for key, f in sent.items()}
    want = {key: 2 / key[0] for key in sent}
    check("Ulysses' forward sends 2/cp of the ring's bytes (each cp, T, H)", ratio == want, want,
          ratio)
    # the head-count rule: every rank takes H/cp whole heads
    cp = max(groups)
    bad = 3 * cp // 2  # 6 heads on 4 ranks, 3 on 2
    x = split_sequence(sequence(4 * cp, heads=bad)[0], groups[cp], dim=2)
    try:
        ulysses_attention(x, x, x, groups[cp])
        refusal = None
    except ValueError as error:
        refusal = str(error)
    say(f"\n  The head-count rule: H must be a multiple of cp. H = {bad} on cp = {cp} is "
        "refused, on every rank:", f"    {refusal}")
    refused = groups[cp].all_gather_object(refusal is not None and "divisors of" in refusal)
    check(f"H = {bad} heads on cp = {cp}: refused on every rank, with the group sizes that fit",
          all(refused), [True] * cp, refused)
    # the table a student reads, at the largest cp and length, H = H_U[0]
    T, heads = lengths[-1], H_U[0]
    (r_msgs, r_fwd), r_bwd = sent[cp, T, heads]["ring"]
    (u_msgs, u_fwd), u_bwd = sent[cp, T, heads]["Ulysses"]
    say(f"\n  The two schemes at cp = P = {cp}, N = {T}, H = {heads} (bytes per rank measured, "
        "= the formula):",
        f"  {'scheme':8s} {'messages (forward)':24s} {'bytes per rank, forward / backward':44s} "
        "constraint",
        f"  {'ring':8s} {f'P − 1 = {r_msgs} k/v sends':24s} "
        f"{f'(P − 1) k/v blocks: {r_fwd / 1e3:.1f} / {r_bwd / 1e3:.1f} kB':44s} "
        "N a multiple of 2·P; any P",
        f"  {'Ulysses':8s} {f'4 all-to-alls, {u_msgs} msgs':24s} "
        f"{f'4·(P − 1)/P·B·(N/P)·h: {u_fwd / 1e3:.1f} / {u_bwd / 1e3:.1f} kB':44s} "
        "H a multiple of P (so P ≤ H); N of 2·P",
        "  Ulysses' forward sends 2/P of the ring's (the same at P = 2), its backward the same "
        "again against the",
        "  ring's 2·P − 1 blocks; both grow with N and H alike. What it costs: a rank holds the "
        "whole sequence's",
        "  scores for its H/P heads, B·(H/P)·N², where the ring computes (N/P)² blocks and "
        "keeps none, and P can",
        "  grow no further than H. Megatron offers both (--cp-comm-type p2p or a2a).")


def draw_figures(directory, lengths, held, serial, steps, found, cp):
    curves = {"serial attention (B·H·T²)": (lengths, serial, [serial_formula(T) for T in lengths])}
    curves.update({f"ring, cp = {c}": (lengths, held[c], [ring_formula(T, c) for T in lengths])
                   for c in held})
    figure(directory, "14_memory", lambda figures: figures.scaling_chart(
        curves, title="Attention's activation memory per rank against the sequence length: "
                      "measured (markers), formula dashed", xlabel="sequence length T",
        ylabel="bytes kept for backward per rank", byte_ticks=True))
    figure(directory, "14_ring", lambda figures: figures.ring_chart(
        steps, [rank_chunks(r, cp) for r in range(cp)],
        title=f"Ring attention at cp = {cp}, zig-zag layout: each rank's four blocks at each "
              f"step"))
    ratio = {layout: w[-1]["causal"] / w[0]["causal"] for layout, w in found.items()}
    figure(directory, "14_work", lambda figures: figures.bar_chart(
        [f"rank {r}" for r in range(cp)],
        {layout: [x["causal"] for x in w] for layout, w in found.items()},
        title=f"Causal work per rank at cp = {cp} (score entries on or below the diagonal): "
              f"last / first {ratio['contiguous']:.2f} contiguous, {ratio['balanced']:.2f} "
              f"zig-zag", ylabel="score entries computed and kept", xlabel="rank"))


def main():
    args = arguments(__doc__, quick="shorter sequences", plot=True)
    world = mpi_world(__doc__, ranks=(2, 4))
    # cp = 1, 2, 4 as splits of the world: every rank in a group of cp (collective: every rank
    # makes every split); world rank 0 is rank 0 of its group of each size
    groups = {cp: world.split(world.rank // cp) for cp in (1, 2, 4) if cp <= world.size}
    top = max(groups)
    lengths = (32, 64, 128) if args.quick else (64, 128, 256, 512, 1024)
    T_work = 16 * 2 * top  # chunks of 16 tokens: contiguous last / first near 2·cp − 1

    held, serial = part1_memory(groups, lengths)
    steps = part2_timeline(groups[top], 4 * top)
    found = part3_work(groups[top], T_work)
    part4_bytes(groups, T_work)
    part5_equal(groups, 12 * top)
    part6_ulysses(groups, (4 * top, 16 * top))
    if world.rank == 0:
        draw_figures(args.plot, lengths, held, serial, steps, found, top)
    return finish("each of cp ranks keeps 1/cp of attention's memory, the zig-zag layout "
                  "balances its work, the ring equals serial attention, and so does "
                  "Ulysses, sending the bytes of its formula")


if __name__ == "__main__":
    raise SystemExit(main())
