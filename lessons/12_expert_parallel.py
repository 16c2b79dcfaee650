"""Lesson 12: expert parallelism: a mixture of experts whose experts live on different ranks.

    mpiexec -n 2 python lessons/12_expert_parallel.py        (works with -n 4; add --quick)

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
     every step: the load balance (l_aux, max/mean tokens per expert) and the drops.

Read next: minipar/nn/moe.py, minipar/parallel/expert/dispatch.py, layer.py, then
minipar/parallel/hybrid4d.py; proved by tests/test_expert_parallel.py and tests/test_hybrid_4d.py.
"""
import numpy as np

import minipar
from minipar import Tensor, optim
from minipar.nn.moe import MoE, MoEBlock, capacity
from minipar.parallel.expert import ExpertParallelMoE, counts_matrix, table

from _kit import arguments, check, figure, finish, mpi_world, say

args = arguments(__doc__, quick="a smaller layer, fewer steps", plot=True)
world = mpi_world(__doc__, ranks=(2, 4))
rank, p = world.rank, world.size
B, T, C, H, E, STEPS = (2, 8, 16, 2, 4, 10) if args.quick else (4, 16, 32, 4, 8, 40)
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
