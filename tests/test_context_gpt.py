"""The GPT with context parallelism: Trainer3D on (dp, cp, tp, pp) layouts trains to the serial
GPT's losses and gradients (float64), the loss is the mean over every token of the sequences
(ignored targets spread unevenly over the cp ranks included), a checkpoint saved under cp = 2
loads into the serial GPT, and bad input is a clear error."""
import os

import numpy as np
import pytest

from minipar.testing import run_on_ranks
from serial_twin import TOLERANCE, assert_equals_serial
from test_hybrid import value_errors
from test_sequence_parallel import grad_error

T = 16  # a multiple of 2·cp for cp up to 8


def config(dropout=0.0):
    from minipar import nn
    return nn.GPTConfig(vocab_size=16, block_size=T, n_layer=2, n_head=2, n_embd=16,
                        dropout=dropout)


def batches(steps, n=4, ignored=False, seed=3):
    """One batch of random sequences each step; ``ignored``: targets of the tokens 9..15 of row
    0 are ignore_index (-100), so the cp ranks count different numbers of tokens."""
    ids = np.random.default_rng(seed).integers(0, 16, size=(n, T))
    targets = np.roll(ids, -1, axis=1)
    if ignored:
        targets[0, 9:] = -100
    return [(ids, targets)] * steps


def layouts_body(layouts, steps, ignored=False, folder=None):
    """On every rank: each (dp, cp, tp, pp, sequence_parallel) layout beside the serial GPT;
    losses, serial losses and the largest gradient difference. ``folder``: the first layout
    saves a checkpoint there after its first step."""
    from minipar import comm, nn, random
    from minipar.backend import to_numpy
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D, default_optimizer
    from minipar.testing import train_serial

    world = comm.world()
    results = {}
    for dp, cp, tp, pp, sp in layouts:
        groups = ParallelGroups(world, tp=tp, pp=pp, cp=cp)
        assert (groups.grid.dp, groups.grid.cp) == (dp, cp)
        random.manual_seed(0)
        serial = nn.GPT(config()).astype("float64")
        optimizer = default_optimizer(serial.parameters())
        trainer = Trainer3D(config(), groups, microbatches=2 if pp > 1 else 1, dtype="float64",
                            sequence_parallel=sp)
        losses, reference, error = [], [], 0.0
        sent = groups.context.counters.bytes_sent
        for ids, targets in batches(steps, ignored=ignored):
            reference += train_serial(serial, optimizer, [(ids, targets)])
            losses.append(float(trainer.step(ids, targets)))
            full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
            error = max(error, grad_error(trainer, full))
            if folder and not results and len(losses) == 1:
                dcp.save({"trainer": trainer, "step": 1}, checkpoint_id=folder)
        results[f"dp{dp} cp{cp} tp{tp} pp{pp} sp={sp}"] = {
            "losses": losses, "reference": reference, "grad_error": error,
            # the ring ran: k/v blocks went round the context group, each rank held T/cp
            "ring_bytes": groups.context.counters.bytes_sent - sent,
            "local": list(trainer.local_shard(ids).shape)}
    return results


def check(results):
    for rank, result in enumerate(results):
        for layout, r in result.items():
            assert_equals_serial(r, f"rank {rank}, {layout}")
            cp = int(layout.split()[1][2:])
            assert r["ring_bytes"] > 0 and r["local"][1] == T // cp, (rank, layout, r)


def serial_after_load(folder, steps):
    """In pytest: the checkpoint loaded into the serial GPT and AdamW; its next losses."""
    from minipar import nn, random
    from minipar.distributed import AppState, checkpoint as dcp
    from minipar.parallel.hybrid import default_optimizer
    from minipar.testing import train_serial

    random.manual_seed(7)
    model = nn.GPT(config()).astype("float64")
    optimizer = default_optimizer(model.parameters())
    state = {"trainer": AppState(model, optimizer), "step": None}
    dcp.load(state, checkpoint_id=folder)
    return train_serial(model, optimizer, batches(steps, ignored=True)[state["step"]:])


@pytest.mark.mpi
def test_cp2_equals_serial_with_ignored_tokens_and_loads_into_serial(tmp_path):
    """cp = 2 on 2 ranks: the 7 ignored targets of row 0 fall 4 on one cp rank, 3 on the
    other (the zig-zag chunks), and the loss is still the mean over the counted tokens of the
    whole sequences. The checkpoint of step 1 loads into the serial GPT, which then takes steps
    2 and 3 as cp did."""
    folder = os.path.join(str(tmp_path), "cp2")
    results = run_on_ranks(layouts_body, 2, args=([(1, 2, 1, 1, False)], 3, True, folder),
                           timeout=240)
    check(results)
    # each parameter written once: by context rank 0 (the cp ranks hold whole copies)
    from minipar import io
    records = dict(io.load(os.path.join(folder, "manifest.npz"))["records"])
    weights = [r for path, r in records.items() if "model" in str(path)]
    assert weights and all({c[0] for c in r["chunks"]} == {0} for r in weights), weights[0]
    after = serial_after_load(folder, 3)
    np.testing.assert_allclose(after, results[0]["dp1 cp2 tp1 pp1 sp=False"]["losses"][1:],
                               rtol=0, atol=TOLERANCE)


@pytest.mark.mpi
def test_eight_ranks_dp_cp_tp_pp_equal_serial():
    """cp = 2 with tp = 2 and pp = 2, without and with sequence parallelism; cp = 2 with tp = 2
    under sequence parallelism and dp = 2; cp = 4 with dp = 2, and with pp = 2; cp = 8 alone
    (one token a chunk)."""
    layouts = [(1, 2, 2, 2, False), (1, 2, 2, 2, True), (2, 2, 2, 1, True), (2, 4, 1, 1, False),
               (1, 4, 1, 2, False), (1, 8, 1, 1, False)]
    check(run_on_ranks(layouts_body, 8, args=(layouts, 2), timeout=400, heavy_yield=True))


def bad_input_body():
    from minipar import comm
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig

    world = comm.world()
    groups = ParallelGroups(world, cp=2)
    ids = np.zeros((2, 10), dtype=np.int64)
    return value_errors(lambda: Trainer3D(config(), groups).step(ids, ids),
                        lambda: Trainer3D(config(dropout=0.1), groups),
                        lambda: Trainer4D(config(), MoEConfig(n_experts=2), groups).step(ids, ids))


@pytest.mark.mpi
def test_bad_input_is_a_clear_error():
    """T = 10 is not a multiple of 2·cp = 4, with experts too (Trainer4D takes cp since issue
    38); ring attention has no attention dropout."""
    results = run_on_ranks(bad_input_body, 2, timeout=120)
    for errors in results:
        assert "sequence length 10 is not a multiple of 2·cp = 4" in errors[0], errors[0]
        assert "dropout = 0" in errors[1] and "ring attention" in errors[1], errors[1]
        assert "sequence length 10 is not a multiple of 2·cp = 4" in errors[2], errors[2]
    assert results[0] == results[1]
