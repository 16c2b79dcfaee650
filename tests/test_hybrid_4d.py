"""4D parallelism: (data, tensor, pipeline, expert) layouts of a mixture-of-experts GPT train to
the serial twin's losses and gradients, and the grid's communicators are the grid's groups."""
import os

import numpy as np
import pytest

from minipar.testing import run_on_ranks
from serial_twin import TOLERANCE, assert_equals_serial
from test_hybrid import batches, config, value_errors  # the 3D test's GPT, batch (8 × 8)

SAVE_AT = 2  # the first layout saves a checkpoint after this many steps
MICROBATCHES = 2


def check_communicators(world, groups):
    """Each communicator of ParallelGroups holds the ranks of the grid's group, in order."""
    wrong = []
    for kind, comm in (("tp", groups.tensor), ("pp", groups.pipeline), ("dp", groups.data),
                       ("ep", groups.expert), ("edp", groups.expert_data)):
        members = comm.all_gather_object(world.rank)
        if members != groups.grid.group_of(world.rank, kind) or \
                comm.rank != groups.coords[kind]:
            wrong.append(f"{kind}: {members}, rank {comm.rank}")
    c, r = groups.coords, world.rank
    said = f"ep {c['ep']} edp {c['edp']}  expert {groups.grid.group_of(r, 'ep')}"
    if groups.grid.ep > 1 and said not in groups.describe():
        wrong.append(groups.describe())
    return wrong


def held(trainer):
    """{name in ``trainer.model``: Parameter} of this rank's stages, in the optimizer's order."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    return {names[id(p)]: p for p in trainer.pipe.params}


def serial_moe_gpt(gpt, moe, seed=0, dtype="float32"):
    """The serial MoE GPT a ``Trainer4D`` with the same ``seed`` starts from, and its optimizer's
    default (``default_optimizer``)."""
    from minipar import random
    from minipar.parallel.hybrid import default_optimizer
    from minipar.parallel.tensor.moe import moe_gpt

    random.manual_seed(seed)
    model = moe_gpt(gpt, moe).astype(dtype)
    return model, default_optimizer(model.parameters())


def train_serial_4d(model, optimizer, batches, dp, microbatches):
    """The serial twin of a Trainer4D run: each global batch cut into dp shards and each shard
    into m micro-batches, one forward per (shard, micro-batch) (its own capacity group), the
    loss scaled by 1/m, every gradient summed then divided by dp; one optimizer step per batch.
    Returns the global mean losses, as floats."""
    losses, m = [], microbatches
    for block in model.blocks:
        block.mlp.aux_scale = 1.0 / m
    for ids, targets in batches:
        if len(ids) % (dp * m):
            raise ValueError(f"a batch of {len(ids)} sequences does not cut into {dp} shards of "
                             f"{m} equal micro-batches")
        model.zero_grad()
        total = 0.0
        for d in range(dp):
            shard = slice(d * len(ids) // dp, (d + 1) * len(ids) // dp)
            for x, t in zip(_cut(ids[shard], m), _cut(targets[shard], m)):
                _, loss = model(x, t)
                (loss * (1.0 / m)).backward()
                total += loss.item() / m / dp
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad / dp
        optimizer.step()
        losses.append(total)
    return losses


def _cut(array, m):
    n = len(array) // m
    return [array[k * n:(k + 1) * n] for k in range(m)]


def layouts_body(cases, folder):
    """On every rank: each (dp, tp, pp, ep) layout, schedule and capacity factor trained beside
    its serial twin; losses, the largest gradient difference, the drops, and failures. The
    first layout saves a checkpoint after step SAVE_AT; the second layout loads it and trains
    one more step ("resharded")."""
    from minipar import comm
    from minipar.backend import to_numpy
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig, serial_slices

    world = comm.world()
    results = {}
    for (dp, tp, pp, ep), schedule, capacity_factor, order in cases:
        groups = ParallelGroups(world, tp=tp, pp=pp, ep=ep, order=order)
        assert (groups.grid.dp, groups.grid.ep) == (dp, ep)
        moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=capacity_factor, hidden=32)
        serial, optimizer = serial_moe_gpt(config(), moe, dtype="float64")
        trainer = Trainer4D(config(), moe, groups, schedule=schedule,
                            microbatches=MICROBATCHES, dtype="float64")
        losses, reference, grad_error, dropped = [], [], 0.0, 0
        for ids, targets in batches():
            reference += train_serial_4d(serial, optimizer, [(ids, targets)], dp, MICROBATCHES)
            dropped += sum(layer.last_routing.dropped for layer in serial.blocks.modules()
                           if getattr(layer, "last_routing", None) is not None)
            losses.append(float(trainer.step(ids, targets)))
            full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
            expected = serial_slices(trainer.model, full, groups.tensor)
            for name, p in held(trainer).items():
                grad_error = max(grad_error, float(np.abs(to_numpy(p.grad) -
                                                          expected[name]).max()))
            if not results and len(losses) == SAVE_AT:
                dcp.save({"trainer": trainer, "step": SAVE_AT}, checkpoint_id=folder)
        results[f"dp{dp} tp{tp} pp{pp} ep{ep} {order} {schedule} cf={capacity_factor}"] = {
            "losses": losses, "reference": reference, "grad_error": grad_error,
            "dropped": dropped, "wrong_groups": check_communicators(world, groups)}
    (dp, tp, pp, ep), schedule, capacity_factor, _ = cases[1]
    moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=capacity_factor, hidden=32)
    trainer = Trainer4D(config(), moe, ParallelGroups(world, tp=tp, pp=pp, ep=ep),
                        schedule=schedule, microbatches=MICROBATCHES, dtype="float64", seed=99)
    state = {"trainer": trainer, "step": None}
    dcp.load(state, checkpoint_id=folder)
    ids, targets = batches()[state["step"]]
    results["resharded"] = float(trainer.step(ids, targets))
    return results


def serial_after_load(folder, cases):
    """In pytest (no mpiexec): the checkpoint loaded into the serial MoE GPT and AdamW, one
    step of the serial twin with each of the first two layouts' data-parallel grouping."""
    from minipar.distributed import AppState, checkpoint as dcp
    from minipar.parallel.tensor.moe import MoEConfig

    losses = []
    for (dp, _, _, _), _, capacity_factor, _ in cases[:2]:
        moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=capacity_factor, hidden=32)
        model, optimizer = serial_moe_gpt(config(), moe, seed=7, dtype="float64")
        state = {"trainer": AppState(model, optimizer), "step": None}
        dcp.load(state, checkpoint_id=folder)
        losses += train_serial_4d(model, optimizer, batches()[state["step"]:][:1], dp,
                                  MICROBATCHES)
    return losses


def check(results, drops):
    for rank, result in enumerate(results):
        for layout, r in result.items():
            if layout == "resharded":
                continue
            assert_equals_serial(r, f"rank {rank}, {layout}")
            assert r["wrong_groups"] == [], (rank, layout, r["wrong_groups"])
            assert (r["dropped"] > 0) == drops[layout], (layout, r["dropped"])


@pytest.mark.mpi
def test_eight_ranks_4d_equal_serial(tmp_path):
    """Every dimension at 2 (edp = 1: each expert on one rank), then dp 4 = ep 2 × edp 2 with
    pp or with tp (expert gradients reduced over the expert-data group); the split backward of
    zb-h1, two chunks per rank, and ep after dp in the order (expert groups strided). Capacity
    factor 1.0 drops tokens (checked: the serial twin drops some); None drops none. The
    checkpoint of the first layout, saved after step 2, loads into the serial twin, which then
    takes step 3 as the first layout did, and as the second did after loading it."""
    megatron, after = "tp-ep-dp-pp", "tp-dp-ep-pp"  # ep beside dp: before it, or after it
    cases = [((2, 2, 2, 2), "1f1b", 1.0, megatron), ((4, 1, 2, 2), "gpipe", 1.0, megatron),
             ((4, 2, 1, 2), "1f1b", None, megatron), ((2, 2, 2, 2), "zb-h1", 1.0, megatron),
             ((4, 1, 2, 2), "interleaved", 1.0, megatron), ((4, 2, 1, 2), "1f1b", 1.0, after)]
    folder = os.path.join(str(tmp_path), "4d")
    results = run_on_ranks(layouts_body, 8, args=(cases, folder), timeout=400, heavy_yield=True)
    drops = {f"dp{dp} tp{tp} pp{pp} ep{ep} {order} {s} cf={cf}": cf is not None
             for (dp, tp, pp, ep), s, cf, order in cases}
    check(results, drops)
    first = next(iter(results[0].values()))["losses"][SAVE_AT]
    serial = serial_after_load(folder, cases)
    np.testing.assert_allclose(serial, [first, results[0]["resharded"]], rtol=0, atol=TOLERANCE)
    assert all(r["resharded"] == results[0]["resharded"] for r in results)


def bad_input_body():
    from minipar import comm, nn
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig

    world = comm.world()
    gpt = nn.GPTConfig(vocab_size=16, block_size=8, n_head=2, n_embd=16, n_layer=2)
    ep2, tp2 = ParallelGroups(world, ep=2), ParallelGroups(world, tp=2)
    return value_errors(
        lambda: ParallelGroups(world, ep=4),
        lambda: Trainer4D(gpt, MoEConfig(n_experts=3), ep2),
        lambda: Trainer4D(gpt, MoEConfig(n_experts=4, hidden=33), tp2),
        lambda: Trainer4D(gpt, MoEConfig(n_experts=2, top_k=3), ep2),
        lambda: Trainer4D(gpt, MoEConfig(n_experts=2), ep2, microbatches=2).step(
            np.zeros((6, 8), dtype=np.int64), np.zeros((6, 8), dtype=np.int64)))


EXPECTED = ["dp = 2/(tp·pp) = 2 is not divisible by ep = 4",
            "n_experts 3 is not divisible by the expert-parallel size ep 2",
            "expert hidden size 33 is not divisible by the tensor-parallel size 2",
            "1 <= top_k <= n_experts",
            "shard of 3 sequences does not cut into 2 equal micro-batches"]


@pytest.mark.mpi
def test_bad_input_is_a_clear_error_on_every_rank():
    results = run_on_ranks(bad_input_body, 2, timeout=120)
    for errors in results:
        assert len(errors) == len(EXPECTED) and all(map(str.__contains__, errors, EXPECTED)), errors
    assert results[0] == results[1]
