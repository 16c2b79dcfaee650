"""3D parallelism: (data, tensor, pipeline) layouts train to the serial GPT's losses."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

TOLERANCE = 1e-10  # float64: the layouts only reorder sums, so losses agree to rounding
STEPS = 3


def config():
    from minipar import nn
    return nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


def batches(n=8, steps=STEPS, seed=1):
    """One batch of random sequences seen every step: the loss must fall as it is memorised."""
    ids = np.random.default_rng(seed).integers(0, 16, size=(n, 8))
    return [(ids, np.roll(ids, -1, axis=1))] * steps


def layouts_body(layouts, schedule):
    """On every rank: train each (dp, tp, pp) layout and the serial model; return the losses."""
    from minipar import comm
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D
    from minipar.testing import serial_losses

    world = comm.world()
    data = batches()
    reference = serial_losses(config(), data, dtype="float64")
    results = {}
    for dp, tp, pp in layouts:
        groups = ParallelGroups(world, tp=tp, pp=pp)
        assert groups.grid.dp == dp
        trainer = Trainer3D(config(), groups, schedule=schedule, microbatches=2, dtype="float64")
        losses = [float(trainer.step(ids, targets)) for ids, targets in data]  # a device scalar
        results[f"{dp},{tp},{pp}"] = losses
    return {"reference": reference, "layouts": results}


def check(results):
    for rank, result in enumerate(results):
        reference = result["reference"]
        assert reference[-1] < reference[0]  # it trains
        for layout, losses in result["layouts"].items():
            np.testing.assert_allclose(losses, reference, rtol=0, atol=TOLERANCE,
                                       err_msg=f"rank {rank}, (dp,tp,pp) = ({layout})")


@pytest.mark.mpi
def test_four_ranks_equal_serial():
    layouts = [(1, 2, 2), (2, 1, 2), (2, 2, 1)]
    check(run_on_ranks(layouts_body, 4, args=(layouts, "1f1b"), timeout=240))


@pytest.mark.mpi
def test_zero_bubble_v_equals_serial():
    """zb-v puts the last stage on pipeline rank 0 (the V): the loss comes from there."""
    check(run_on_ranks(layouts_body, 4, args=([(1, 2, 2), (2, 1, 2)], "zb-v"), timeout=240))


@pytest.mark.mpi
def test_eight_ranks_2x2x2_equal_serial():
    check(run_on_ranks(layouts_body, 8, args=([(2, 2, 2)], "gpipe"), timeout=300))


def bad_input_body():
    from minipar import comm, nn
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D

    world = comm.world()
    return value_errors(
        lambda: ParallelGroups(world, tp=3),
        lambda: Trainer3D(nn.GPTConfig(vocab_size=16, n_head=3, n_embd=18, n_layer=1),
                          ParallelGroups(world, tp=2)),
        lambda: Trainer3D(nn.GPTConfig(vocab_size=15, n_head=2, n_embd=16, n_layer=1),
                          ParallelGroups(world, tp=2)),
        lambda: Trainer3D(nn.GPTConfig(vocab_size=16, n_head=2, n_embd=16, n_layer=1),
                          ParallelGroups(world, pp=2), schedule="interleaved", chunks=3))


def value_errors(*makes):
    """The ValueError message each call raises, or "no error"."""
    errors = []
    for make in makes:
        try:
            make()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.mpi
def test_bad_input_is_a_clear_error_on_every_rank():
    results = run_on_ranks(bad_input_body, 2, timeout=120)
    for errors in results:
        assert "not divisible by tp·pp" in errors[0]
        assert "n_head 3 is not divisible by the tensor-parallel size 2" in errors[1]
        assert "vocab" in errors[2] and "not divisible" in errors[2]
        assert "4 pipeline layers" in errors[3] and "fewer than the 6 stages" in errors[3]
    assert results[0] == results[1]
