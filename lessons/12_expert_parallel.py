"""Lesson 12: expert parallelism: a mixture of experts whose experts live on different ranks.

    mpiexec -n 2 python lessons/12_expert_parallel.py        (works with -n 4 and 8; add --quick)

A mixture-of-experts layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021) replaces a block's MLP by E expert MLPs and a router that sends each token to k of
them, so the parameters grow E-fold while each token's compute stays that of k MLPs. With expert
parallelism the p ranks of an expert group each hold E/p experts (``minipar/parallel/expert/``):
every rank routes its own tokens, sends each to the rank of its expert with an all-to-all of a
different number of rows per peer, and gets the results back with a second one. This lesson
measures, in float64 against the serial twin (the serial MoE on each rank's tokens):

  1. the routing: each token's experts and gates, tokens per expert, capacity and drops;
  2. the dispatch: the counts matrix, and the bytes the two all-to-alls moved (comm counters)
     against the count the matrix predicts and against GShard's all-to-all padded to capacity;
  3. outputs and every gradient equal to the serial twin;
  4. an MoE GPT block trained with and without the load-balancing loss, equal to serial at
     every step: the load balance (l_aux, max/mean tokens per expert) and the drops;
  5. on 8 ranks, all five axes at once: Trainer4D with (dp, cp, tp, pp, ep) = (1, 2, 2, 2, 2)
     and sequence parallelism trains the tiny MoE GPT equal to the serial one, each rank's
     coordinates printed, and the experts drop at capacity the very tokens serial drops.
     With fewer ranks this part says it needs 8 and is skipped.

Read next: minipar/nn/moe.py, minipar/parallel/expert/dispatch.py, layer.py, then
minipar/parallel/hybrid4d.py; proved by tests/test_expert_parallel.py, tests/test_hybrid_4d.py and
tests/test_hybrid_5d.py.
"""
import numpy as np

import minipar
from minipar import Tensor, optim
from minipar.nn.moe import MoE, MoEBlock, capacity
from minipar.parallel.expert import ExpertParallelMoE, counts_matrix, table

from _kit import arguments, check, figure, finish, mpi_world, say

args = arguments(__doc__, quick="a smaller layer, fewer steps", plot=True)
world = mpi_world(__doc__, ranks=(2, 4, 8))
rank, p = world.rank, world.size
B, T, C, H, E, STEPS = (2, 8, 16, 2, 4, 10) if args.quick else (4, 16, 32, 4, 8, 40)
E = max(E, p)  # every rank of the expert group holds at least one expert
K, CF, TOL, TILT, BLOCK_TILT, AUX = 2, 1.25, 1e-10, 0.5, 1.5, 1.0


def worst(a, b):
    """The largest |a - b| over every rank (on the host)."""
    diff = np.abs(minipar.to_numpy(a) - minipar.to_numpy(b)).max(initial=0)
    return max(world.all_gather_object(float(diff)))


def equal(what, diff):
    check(f"{what} equals serial (float64, |diff| < {TOL:g})", diff < TOL, f"< {TOL:g}",
          f"{diff:.1e}")


U = np.random.default_rng(0).standard_normal(C)
U = (U - U.mean()) / np.linalg.norm(U - U.mean())  # a direction every token shares (mean 0, so
                                                    # LayerNorm keeps it)


def tokens(seed):
    """Every rank's (B, T, C) tokens, drawn alike everywhere: N(0, 1) plus √C·U."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, C)) + np.sqrt(C) * U for _ in range(p)]


def skewed(moe, tilt=TILT):
    """Tilt the router towards expert 0: its logit gains tilt·(x·U), about tilt·√C."""
    moe.router.weight.data[0] += moe.router.weight.data.dtype.type(tilt) * minipar.tensor(U).data
    return moe


def part1_routing(serial, layer, xs):
    say(f"Part 1. Routing: {B * T} tokens per rank, E = {E} experts, top-{K}, capacity factor "
        f"{CF}: capacity = ceil({CF}·{B * T}·{K}/{E}) = {capacity(B * T, E, K, CF)} per expert")
    y = layer(Tensor(xs[rank]))
    r = layer.last_routing
    gates = serial.gate(Tensor(xs[rank].reshape(-1, C)))[1].data
    dropped = [i for i in range(B * T) if not r.kept[i].all()]
    if rank == 0:  # the first tokens, and the first two that lost an expert to its capacity
        for i in sorted(set(range(3)) | set(dropped[:2])):
            picks = ", ".join(f"e{e} (gate {float(g):.2f}{'' if kept else ', dropped'})"
                              for e, g, kept in zip(r.expert[i], gates[i], r.kept[i]))
            say(f"  rank 0, token {i} -> {picks}")
    per_rank = world.all_gather_object((r.tokens_per_expert.tolist(), r.kept_per_expert.tolist(),
                                        r.dropped, r.aux_loss, r.load()))
    for s, (wanted, kept, dropped, aux, load) in enumerate(per_rank):
        say(f"  rank {s}: assigned per expert {wanted}, kept {kept}, dropped {dropped}; "
            f"l_aux {aux:.3f}, max/mean load {load:.2f}")
    lost = r.kept.any(axis=1) == 0  # tokens whose every expert was full
    zero = float(np.abs(minipar.to_numpy(y.data).reshape(-1, C)[lost]).max(initial=0))
    check("a token dropped by all its experts leaves the MoE as 0 (its residual passes)",
          zero == 0, 0, zero)
    say(f"  {sum(world.all_gather_object(int(lost.sum())))} token(s) lost every expert: their MoE "
        f"output is 0, so in a block only the residual carries them", "")
    return per_rank


def part2_dispatch(layer, xs):
    say("Part 2. Dispatch and combine: who sends how many rows to which expert")
    world.counters.reset()
    x = Tensor(xs[rank], requires_grad=True)
    layer(x).sum().backward()
    sent = world.counters.bytes_sent
    counts = counts_matrix(layer.last_routing, world)
    say(*("  " + line for line in table(counts, p)))
    per = E // p
    out = sum(counts[rank, j * per:(j + 1) * per].sum() for j in range(p) if j != rank)
    into = sum(counts[s, rank * per:(rank + 1) * per].sum() for s in range(p) if s != rank)
    row = C * 8
    expect = 2 * (out + into) * row + (p - 1) * per * 8  # forward and backward, + the counts
    check("bytes sent by the all-to-alls = 2·(rows out + rows in)·C·8 + the counts",
          sent == expect, expect, sent)
    cap = capacity(B * T, E, K, CF)
    world.counters.reset()
    world.all_to_all(np.zeros((p, per * cap, C)))  # GShard: every expert's buffer padded to cap
    padded = 4 * world.counters.bytes_sent  # dispatch and combine, forward and backward
    check("all_to_all_v sends no more than the all-to-all padded to capacity", sent <= padded,
          f"<= {padded}", sent)
    say(f"  rank 0: {out} rows out, {into} rows in, of {C} float64 each, on each of the 4 trips "
        f"(dispatch and combine forward, the same two backward), + {(p - 1) * per * 8} B of counts")
    say(f"  rank 0 sent {sent:,} B (predicted {expect:,} B); padded to capacity ({cap} rows per "
        f"expert) GShard's all-to-alls would send {padded:,} B ({padded / max(sent, 1):.1f}×)", "")
    return counts


def part3_equal(serial, layer, xs):
    say("Part 3. Equal to the serial twin: nn.moe.MoE on each rank's tokens, gradients summed")
    w = [np.cos(np.arange(B * T * C) + s).reshape(B, T, C) for s in range(p)]
    serial.zero_grad()
    layer.zero_grad()
    refs = []
    for s in range(p):
        xt = Tensor(xs[s], requires_grad=True)
        y = serial(xt)
        (y * w[s]).sum().backward()
        refs.append((y.data, xt.grad))
    x = Tensor(xs[rank], requires_grad=True)
    y = layer(x)
    (y * w[rank]).sum().backward()
    layer.router_grads_sum()  # each rank saw its tokens only: the twin's gradient is the sum
    twin = dict(serial.named_parameters())
    grads = max(worst(q.grad, twin[layer.serial_name(n)].grad) for n, q in layer.named_parameters())
    for what, diff in (("the output", worst(y.data, refs[rank][0])),
                       ("dx", worst(x.grad, refs[rank][1])), ("every parameter's gradient", grads)):
        equal(f"expert parallel: {what}", diff)
        say(f"  {what}: max |diff| = {diff:.1e}")
    say("")


def train(aux_coeff, xs, targets, parallel):
    """Per-step (loss of this rank's tokens, l_aux, max/mean load) of an MoE block: expert
    parallel (the replicated parameters' gradients summed over the group, as data parallelism
    does), or the serial twin on every rank's tokens."""
    minipar.manual_seed(5)
    block = MoEBlock(C, H, E, top_k=K, capacity_factor=CF, aux_coeff=aux_coeff).double()
    skewed(block.mlp, BLOCK_TILT)
    if parallel:
        block.mlp = ExpertParallelMoE.from_serial(block.mlp, world)
    opt = optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.0)
    experts = {id(q) for q in block.mlp.experts.parameters()}
    history = []
    for _ in range(STEPS):
        mine = [rank] if parallel else range(p)
        losses, auxes = [], []
        for s in mine:
            loss = ((block(Tensor(xs[s])) - targets[s]) ** 2).mean()
            loss.backward()
            losses.append(loss.item())
            auxes.append((block.mlp.last_routing.aux_loss, block.mlp.last_routing.load()))
        if parallel:
            for q in block.parameters():
                if id(q) not in experts:
                    world.all_reduce(q.grad, out=q.grad)
        opt.step()
        opt.zero_grad()
        me = 0 if parallel else rank
        history.append((losses[me], *auxes[me]))
    return history


def part4_training(xs):
    say(f"Part 4. An MoE GPT block (E = {E} experts over {p} ranks, router tilted towards e0) "
        f"trained {STEPS} steps, with and without the load-balancing loss")
    rng = np.random.default_rng(9)
    A = rng.standard_normal((C, C)) / np.sqrt(C)
    targets = [x + 0.1 * np.tanh(x @ A) for x in xs]
    runs = {}
    for coeff in (AUX, 0.0):
        ep, serial = train(coeff, xs, targets, True), train(coeff, xs, targets, False)
        diff = worst(np.array([h[0] for h in ep]), np.array([h[0] for h in serial]))
        equal(f"aux_coeff={coeff}: the expert-parallel losses at every step", diff)
        runs[coeff] = ep
        first, last = ep[0], ep[-1]
        say(f"  aux_coeff={coeff}: loss {first[0]:.4f} -> {last[0]:.4f}, l_aux {first[1]:.3f} -> "
            f"{last[1]:.3f}, max/mean load {first[2]:.2f} -> {last[2]:.2f}   (rank 0; vs serial "
            f"|diff| {diff:.1e})")
    with_aux, without = runs[AUX][-1][1], runs[0.0][-1][1]
    check("the balance loss balances: l_aux falls, and ends below the run without it",
          with_aux < runs[AUX][0][1] and with_aux < without,
          f"< {runs[AUX][0][1]:.3f} and < {without:.3f}", f"{with_aux:.3f}")
    say("  l_aux = E·Σ f_e·P_e is 1 when balanced; its gradient reaches the router through the",
        "  autoscaler, so the loss printed above is the task's alone. The task (near identity) does",
        f"  not care where tokens go: without l_aux the tilt stays. Balance costs task loss here;",
        f"  aux_coeff={AUX} is 100× the usual 0.01, so that it shows within {STEPS} steps.", "")
    return runs

FIVE = {"dp": 1, "cp": 2, "tp": 2, "pp": 2, "ep": 2}  # tests/test_hybrid_5d.py's first 8-rank grid
FIVE_STEPS, FIVE_MB, FIVE_CF = 3, 2, 1.0  # capacity factor 1.0: the serial model drops tokens


def serial_five(serial, optimizer, ids, targets):
    """One step of the serial twin of a Trainer4D step: the batch cut into dp shards of FIVE_MB
    micro-batches, one forward each (its own group of tokens for capacity), the loss scaled by
    1/m, the gradients averaged over dp. Returns (the mean loss, {(shard, micro-batch, block):
    the kept mask (tokens, k)}, {the same: the top-k experts}, {name: gradient})."""
    dp, m = FIVE["dp"], FIVE_MB
    for block in serial.blocks:
        block.mlp.aux_scale = 1.0 / m
    serial.zero_grad()
    total, kept, choices = 0.0, {}, {}
    n = len(ids) // (dp * m)
    for d in range(dp):
        for j in range(m):
            rows = slice((d * m + j) * n, (d * m + j + 1) * n)
            _, loss = serial(ids[rows], targets[rows])
            (loss * (1.0 / m)).backward()
            total += loss.item() / m / dp
            for b, block in enumerate(serial.blocks):
                kept[d, j, b] = block.mlp.last_routing.kept.copy()
                choices[d, j, b] = block.mlp.last_routing.expert.copy()
    grads = {name: minipar.to_numpy(q.grad) / dp for name, q in serial.named_parameters()}
    for q in serial.parameters():
        if q.grad is not None:
            q.grad = q.grad / dp
    optimizer.step()
    return total, kept, choices, grads


def part5_five_axes():
    layout = " × ".join(f"{k} {v}" for k, v in FIVE.items())
    if p != 8:
        say(f"Part 5. Five axes ({layout}) needs 8 ranks: skipped here "
            f"(minipar lesson 12 -n 8)", "")
        return
    from minipar import nn
    from minipar.distributed.sharded import serial_names
    from minipar.parallel.context.layout import rank_chunks
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import default_optimizer
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor import local_slices
    from minipar.parallel.tensor.moe import MoEConfig, moe_gpt
    from minipar.nn.moe import route

    say(f"Part 5. Five axes on {p} ranks: {layout} (sequence parallel), a tiny MoE GPT")
    groups = ParallelGroups(world, tp=FIVE["tp"], pp=FIVE["pp"], ep=FIVE["ep"], cp=FIVE["cp"])
    for s, c in enumerate(world.all_gather_object(groups.coords)):
        say(f"  rank {s}: " + "  ".join(f"{k} {c[k]}" for k in ("dp", "cp", "tp", "pp", "ep")))
    grid = groups.grid
    same_ranks = "=" if grid.groups("ep") == grid.groups("cp") else "beside"
    say(f"  (rank = tp + 2·(cp + 2·pp)); expert groups {grid.groups('ep')} {same_ranks} the "
        f"context groups {grid.groups('cp')}: the tokens of one sequence go to each other's "
        f"experts")
    config = nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16,
                          dropout=0.0)
    moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=FIVE_CF, hidden=32)
    minipar.manual_seed(0)  # Trainer4D's seed: both start from the same weights
    serial = moe_gpt(config, moe).astype("float64")
    optimizer = default_optimizer(serial.parameters())
    trainer = Trainer4D(config, moe, groups, microbatches=FIVE_MB, dtype="float64",
                        sequence_parallel=True)
    seen = {b: [] for b in range(config.n_layer)}  # block -> the whole-sequence kept masks
    for b, layer in enumerate(trainer.model.moe_layers()):
        def gate(x, layer=layer, b=b, inner=layer.gate):
            out = inner(x)
            seen[b].append(layer.whole.kept.copy())  # the cp group's routing, serial order
            return out
        layer.gate = gate
    names = serial_names(trainer.model)
    mine = {id(q) for q in trainer.pipe.params}
    ids = np.random.default_rng(1).integers(0, config.vocab_size, size=(8, config.block_size))
    targets = np.roll(ids, -1, axis=1)
    losses, reference, grad_diff, same, drops, kept_by, choices = [], [], 0.0, True, [], [], []
    d, T = groups.coords["dp"], config.block_size
    for step in range(FIVE_STEPS):
        for b in seen:
            seen[b].clear()
        losses.append(float(trainer.step(ids, targets)))
        loss, kept, chosen, grads = serial_five(serial, optimizer, ids, targets)
        reference.append(loss)
        expected = local_slices(trainer.model, grads, groups.tensor, names)
        grad_diff = max(grad_diff, *(float(np.abs(minipar.to_numpy(q.grad) - expected[n]).max())
                                     for n, q in trainer.model.named_parameters()
                                     if id(q) in mine))
        for b, masks in seen.items():  # this stage's blocks ran, micro-batch by micro-batch
            same = same and len(masks) in (0, FIVE_MB) and all(
                np.array_equal(mask, kept[d, j, b]) for j, mask in enumerate(masks))
        drops.append({key: [(i // T, i % T, int(chosen[key][i, c]))
                            for i, c in zip(*np.nonzero(~k))] for key, k in kept.items()})
        kept_by.append(kept)
        choices.append(chosen)
    loss_diff = max(world.all_gather_object(max(abs(a - b) for a, b in zip(losses, reference))))
    grad_diff = max(world.all_gather_object(grad_diff))
    same = all(world.all_gather_object(same))
    ran = sum(world.all_gather_object(sum(len(m) for m in seen.values())))
    say("  serial:   " + " ".join(f"{x:.10f}" for x in reference),
        "  5D:       " + " ".join(f"{x:.10f}" for x in losses),
        f"  largest |loss diff| {loss_diff:.1e}, largest |gradient diff| {grad_diff:.1e} "
        f"(every rank, every step); tolerance {TOL:g}, far below the losses' ~2.7:",
        "  float64, and the layout only reorders sums (Trainer4D's seed 0 = the serial draw)")
    equal(f"5D ({layout}): the losses at all {FIVE_STEPS} steps", loss_diff)
    equal(f"5D ({layout}): every gradient of every rank", grad_diff)
    n = len(ids) // (FIVE["dp"] * FIVE_MB) * T  # the tokens of one micro-batch's sequences
    cap = capacity(n, moe.n_experts, moe.top_k, FIVE_CF)
    say(f"  capacity per expert: ceil({FIVE_CF}·{n}·{moe.top_k}/{moe.n_experts}) = {cap} over a "
        f"micro-batch of whole sequences; dropped at step 0, (sequence, position) -> expert:")
    for (_, j, b), where in drops[0].items():
        say(f"    micro-batch {j}, block {b}: {len(where)} -- " +
            ", ".join(f"({s},{t})->e{e}" for s, t, e in where))
    total = sum(len(w) for step in drops for w in step.values())
    check("the experts drop at capacity exactly the serial model's tokens (every step, "
          "micro-batch, block, rank)", same and ran > 0 and total > 0,
          "the same masks, some drops", f"same={same}, {ran} routings, {total} drops")
    # the counterfactual: each cp rank routing only its own two chunks, with its own capacity
    cp, k, n_e = FIVE["cp"], moe.top_k, moe.n_experts
    chunk, apart = T // (2 * cp), 0
    for (_, kept), expert in zip(kept_by[0].items(), choices[0].values()):
        choice = expert.reshape(-1, T, k)
        whole = kept.reshape(-1, T, k)
        for c in range(cp):
            pos = np.concatenate([np.arange(q * chunk, (q + 1) * chunk)
                                  for q in rank_chunks(c, cp)])
            alone = route(np.ascontiguousarray(choice[:, pos]).reshape(-1, k), n_e,
                          capacity(choice.shape[0] * len(pos), n_e, k, FIVE_CF))
            apart += int((alone.kept != whole[:, pos].reshape(-1, k)).sum())
    check("routed per cp rank alone (its chunks, its capacity), other assignments would drop",
          apart > 0, "> 0 differences from serial", apart)
    say(f"  Routed per cp rank instead (its {2 * chunk} of each sequence's {T} tokens, its own "
        f"capacity), step 0 would keep or drop {apart} assignment(s) otherwise than serial.",
        "  Routing must see the whole cp group's sequence: capacity counts every token of the "
        "sequences and fills",
        "  each expert in the serial token order, and the balancing loss's f_e is the whole "
        "sequences' share; so the",
        "  cp ranks share their top-k choices (a few integers a token) and route as one group "
        "(tensor/moe.py).", "")


def main():
    say(f"Expert parallel over {p} ranks (one expert group), float64\n")
    minipar.manual_seed(1)
    serial = skewed(MoE(C, E, top_k=K, capacity_factor=CF).double())
    layer = ExpertParallelMoE.from_serial(serial, world)
    owners = world.all_gather_object(layer.expert_ids)
    say("  " + ", ".join(f"rank {s} holds experts {ids}" for s, ids in enumerate(owners)), "")
    xs = tokens(2)
    per_rank = part1_routing(serial, layer, xs)
    counts = part2_dispatch(layer, xs)
    part3_equal(serial, layer, xs)
    runs = part4_training(xs)
    part5_five_axes()
    figure(args.plot, "12_tokens_per_expert", lambda figures: figures.bar_chart(
        [f"e{e}" for e in range(E)],
        {**{f"from rank {s}": counts[s].tolist() for s in range(p)},
         "dropped (all ranks)": [sum(pr[0][e] - pr[1][e] for pr in per_rank) for e in range(E)]},
        title="kept tokens per expert by sending rank, and drops", ylabel="tokens",
        xlabel=f"expert (e0-e{E // p - 1} on rank 0{', ...' if p > 2 else ''}, "
               f"e{E - E // p}-e{E - 1} on rank {p - 1})"))
    figure(args.plot, "12_balance", lambda figures: figures.loss_chart(
        {f"aux_coeff={c}": [h[1] for h in runs[c]] for c in runs},
        title="load balance while training (1 = balanced)", ylabel="l_aux"))
    return finish("expert parallelism equals its serial twin; the all-to-alls move what the "
                  "counts matrix says")


if __name__ == "__main__":
    raise SystemExit(main())
