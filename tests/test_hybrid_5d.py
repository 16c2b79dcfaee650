"""Five axes: Trainer4D with context parallelism, dp × cp × tp × pp × ep, trains the mixture-of-
experts GPT to the serial twin's losses and gradients (float64). A cp rank holds two chunks of
each sequence (the zig-zag layout), yet the experts route the whole sequences as the serial
model does: capacity from all their tokens, slots in the serial token order (so a capacity
factor of 1.0 drops the same assignments), the load-balancing loss's f and P over the cp group."""
import pytest

from minipar.testing import run_on_ranks
from serial_twin import assert_equals_serial
from test_hybrid import batches, config  # the 3D test's GPT (T = 8), batch (8 × 8)
from test_hybrid_4d import serial_moe_gpt, train_serial_4d
from test_sequence_parallel import grad_error

MICROBATCHES = 2


def layouts_body(cases):
    """On every rank: each (dp, cp, tp, pp, ep, sequence_parallel) layout and capacity factor
    trained beside its serial twin (run once per data shard and micro-batch, whole sequences);
    losses, the largest gradient difference, the serial drops and this rank's tokens."""
    import warnings

    from minipar import comm
    from minipar.backend import to_numpy
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.distributed.sharded import serial_names
    from minipar.parallel.tensor.moe import MoEConfig

    world = comm.world()
    results = {}
    for (dp, cp, tp, pp, ep, sp), capacity_factor, *comm_type in cases:
        groups = ParallelGroups(world, tp=tp, pp=pp, ep=ep, cp=cp)
        assert (groups.grid.dp, groups.grid.cp, groups.grid.ep) == (dp, cp, ep)
        moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=capacity_factor, hidden=32)
        serial, optimizer = serial_moe_gpt(config(), moe, dtype="float64")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tp > 1 without sequence parallelism: measured
            trainer = Trainer4D(config(), moe, groups, microbatches=MICROBATCHES,
                                dtype="float64", sequence_parallel=sp,
                                cp_comm=comm_type[0] if comm_type else "ring")
        losses, reference, error, dropped = [], [], 0.0, 0
        for ids, targets in batches(steps=3):
            reference += train_serial_4d(serial, optimizer, [(ids, targets)], dp, MICROBATCHES)
            dropped += sum(block.mlp.last_routing.dropped for block in serial.blocks)
            losses.append(float(trainer.step(ids, targets)))
            full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
            error = max(error, grad_error(trainer, full, serial_names(trainer.model)))
        name = f"dp{dp} cp{cp} tp{tp} pp{pp} ep{ep} sp={sp} cf={capacity_factor} {comm_type}"
        results[name] = {
            "losses": losses, "reference": reference, "grad_error": error,
            "dropped": dropped, "local": list(trainer.local_shard(ids).shape)}
    return results


def check(results, cases):
    for rank, result in enumerate(results):
        for ((dp, cp, tp, pp, ep, sp), cf, *_), (layout, r) in zip(cases, result.items()):
            assert_equals_serial(r, f"rank {rank}, {layout}")
            assert (r["dropped"] > 0) == (cf is not None), (layout, r["dropped"])
            assert r["local"] == [8 // dp, 8 // cp], (layout, r["local"])


@pytest.mark.mpi
def test_four_ranks_cp_with_experts_equal_serial():
    """cp = 2 beside ep = 2 with dp = 2 (the expert group is the cp group: the tokens of one
    sequence go to each other's experts), with pp = 2, with tp = 2 under sequence parallelism
    (the choices gathered over tp, then over cp) and without; cp = 4 (one token a chunk) with
    ep = 4; ep = 1 with no drops; Ulysses in place of the ring (the routing does not depend
    on how attention crosses the cp group). Capacity factor 1.0 drops tokens in the serial twin: the same
    ones are dropped here, or the losses would differ."""
    cases = [((2, 2, 1, 1, 2, False), 1.0), ((1, 2, 1, 2, 2, False), 1.0),
             ((1, 2, 2, 1, 2, True), 1.0), ((1, 2, 2, 1, 2, False), 1.0),
             ((1, 4, 1, 1, 4, False), 1.0), ((2, 2, 1, 1, 1, False), None),
             ((2, 2, 1, 1, 2, False), 1.0, "a2a")]
    check(run_on_ranks(layouts_body, 4, args=(cases,), timeout=300, heavy_yield=True), cases)


@pytest.mark.mpi
def test_eight_ranks_five_axes_equal_serial():
    """The issue's layouts on 8 ranks: (dp, cp, tp, pp) = (1, 2, 2, 2) with ep = 2 under
    sequence parallelism, and (2, 2, 1, 2) with ep = 4 (ep spans dp and cp); tokens dropped."""
    cases = [((1, 2, 2, 2, 2, True), 1.0), ((2, 2, 1, 2, 4, False), 1.0)]
    check(run_on_ranks(layouts_body, 8, args=(cases,), timeout=400, heavy_yield=True), cases)
