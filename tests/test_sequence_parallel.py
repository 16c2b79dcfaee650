"""Sequence parallelism in the 3D and 4D trainers: training equals the serial twin's (losses and
every gradient, float64), the pipeline's activation messages are 1/tp as large, and with experts
each tensor rank dispatches only its 1/tp of the tokens (the all-to-all bytes divided by tp)."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks
from serial_twin import TOLERANCE, assert_equals_serial
from test_hybrid import batches, config
from test_hybrid_4d import MICROBATCHES, held, serial_moe_gpt, train_serial_4d

HEADER_BYTES = 64  # runtime.HEADER int64 words before each activation


def grad_error(trainer, full, names=None):
    """The largest difference between this rank's gradients and its slices of ``full``."""
    from minipar.backend import to_numpy
    from minipar.parallel.tensor import local_slices

    expected = local_slices(trainer.model, full, trainer.groups.tensor, names)
    return max(float(np.abs(to_numpy(p.grad) - expected[name]).max())
               for name, p in held(trainer).items())


def pipeline_payload(trainer, ids, targets):
    """Bytes of activations and their gradients this rank sends between stages in one step
    (the headers taken off), by the pipeline communicator's counters."""
    from minipar.parallel.pipeline.actions import SEND_F

    comm = trainer.groups.pipeline
    before = comm.counters.bytes_sent
    trainer.pipe.step(trainer.local_shard(ids), trainer.local_shard(targets))
    headers = sum(a.kind == SEND_F for a in trainer.schedule.actions[comm.rank])
    return comm.counters.bytes_sent - before - HEADER_BYTES * headers


def dense_body(layouts):
    """On every rank: each (dp, tp, pp) layout with sequence parallelism beside the serial GPT;
    losses, the largest gradient difference, and the pipeline's bytes with and without it."""
    from minipar import comm, nn, random
    from minipar.backend import to_numpy
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D, default_optimizer

    world = comm.world()
    results = {}
    for dp, tp, pp in layouts:
        groups = ParallelGroups(world, tp=tp, pp=pp)
        random.manual_seed(0)
        serial = nn.GPT(config()).astype("float64")
        optimizer = default_optimizer(serial.parameters())
        trainer = Trainer3D(config(), groups, microbatches=MICROBATCHES, dtype="float64",
                            sequence_parallel=True)
        losses, reference, error = [], [], 0.0
        for ids, targets in batches():
            serial.zero_grad()
            _, loss = serial(ids, targets)
            loss.backward()
            optimizer.step()
            reference.append(loss.item())
            losses.append(float(trainer.step(ids, targets)))
            full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
            error = max(error, grad_error(trainer, full))
        ids, targets = batches()[0]
        whole = Trainer3D(config(), groups, microbatches=MICROBATCHES, dtype="float64")
        results[f"dp{dp} tp{tp} pp{pp}"] = {
            "losses": losses, "reference": reference, "grad_error": error,
            "bytes": (pipeline_payload(trainer, ids, targets),
                      pipeline_payload(whole, ids, targets)),
            # checkpoints: the same names whether the sequence is split or not
            "same_names": [sorted(t.state_dict()["model"]) for t in (trainer, whole)]}
    return results


def counted_all_to_all_v(comm):
    """Wrap ``comm.all_to_all_v`` (the expert rows' exchange) to tally its bytes sent."""
    tally, inner = [0], comm.all_to_all_v

    def counted(*args, **kwargs):
        before = comm.counters.bytes_sent
        out = inner(*args, **kwargs)
        tally[0] += comm.counters.bytes_sent - before
        return out

    comm.all_to_all_v = counted
    return tally


def moe_body(layouts):
    """On every rank: each (dp, tp, pp, ep) layout of the MoE GPT with sequence parallelism
    beside its serial twin (capacity 1.0: tokens dropped); losses, the largest gradient
    difference, and the expert rows' all-to-all bytes of the first step with and without it."""
    import warnings

    from minipar import comm
    from minipar.backend import to_numpy
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig
    from minipar.distributed.sharded import serial_names

    world = comm.world()
    results = {}
    for dp, tp, pp, ep in layouts:
        moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0, hidden=32)
        results_of = {}
        for sp in (True, False):
            groups = ParallelGroups(world, tp=tp, pp=pp, ep=ep)
            tally = counted_all_to_all_v(groups.expert)
            serial, optimizer = serial_moe_gpt(config(), moe, dtype="float64")
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                trainer = Trainer4D(config(), moe, groups, microbatches=MICROBATCHES,
                                    dtype="float64", sequence_parallel=sp)
            losses, reference, error, first, dropped = [], [], 0.0, None, 0
            for ids, targets in batches():
                reference += train_serial_4d(serial, optimizer, [(ids, targets)], dp,
                                             MICROBATCHES)
                dropped += sum(layer.last_routing.dropped for layer in serial.blocks.modules()
                               if getattr(layer, "last_routing", None) is not None)
                losses.append(float(trainer.step(ids, targets)))
                first = tally[0] if first is None else first
                full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
                error = max(error, grad_error(trainer, full, serial_names(trainer.model)))
            results_of[f"sp={sp}"] = {"losses": losses, "reference": reference, "grad_error": error,
                              "dropped": dropped, "warned": [str(w.message) for w in warned],
                              "all_to_all": first}
        results[f"dp{dp} tp{tp} pp{pp} ep{ep}"] = results_of
    return results


def body(dense, moe):
    return {"dense": dense_body(dense), "moe": moe_body(moe)}


def check_dense(results, tp_of):
    for rank, result in enumerate(results):
        for layout, r in result.items():
            assert_equals_serial(r, f"rank {rank}, {layout}")
            assert r["same_names"][0] == r["same_names"][1], layout
            sp, whole = r["bytes"]
            assert sp * tp_of[layout] == whole, (rank, layout, r["bytes"])


@pytest.mark.mpi
def test_tp2_sequence_parallel_equals_serial():
    """tp = 2 alone: the sequence split in two between the tensor-parallel regions."""
    results = run_on_ranks(body, 2, args=([(1, 2, 1)], []), timeout=240)
    check_dense([r["dense"] for r in results], {"dp1 tp2 pp1": 2})


@pytest.mark.mpi
def test_eight_ranks_sequence_parallel_3d_and_4d_equal_serial():
    """(dp, tp, pp) = (2, 2, 2) and the MoE GPT on (dp, tp, pp, ep) = (4, 2, 1, 2) and
    (2, 2, 2, 2), each with sequence parallelism, beside the serial twin; the MoE without it
    too, for the bytes."""
    results = run_on_ranks(body, 8, args=([(2, 2, 2)], [(4, 2, 1, 2), (2, 2, 2, 2)]),
                           timeout=400, heavy_yield=True)
    check_dense([r["dense"] for r in results], {"dp2 tp2 pp2": 2})
    # pipeline ranks send activations: at pp = 2 every rank sends (F or B), so none is zero
    assert all(r["dense"]["dp2 tp2 pp2"]["bytes"][0] > 0 for r in results)
    tp = 2
    for layout in results[0]["moe"]:
        for sp in (True, False):
            for rank, result in enumerate(results):
                r = result["moe"][layout][f"sp={sp}"]
                assert_equals_serial(r, f"rank {rank}, {layout}, sp={sp}", trains=False)
                assert r["dropped"] > 0  # capacity 1.0 drops: the whole-sequence capacity
                assert any("sequence_parallel=True" in w for w in r["warned"]) != sp
        # the same routing (same weights, same tokens): each token travels once, not tp times
        sent = {sp: sum(result["moe"][layout][f"sp={sp}"]["all_to_all"] for result in results)
                for sp in (True, False)}
        assert sent[True] > 0 and sent[True] * tp == sent[False], (layout, sent)


def dropout_body():
    """On every rank: a serial GPT embedding and MLP with dropout against their sequence-parallel
    twins (same seed, same stream): the largest difference of this rank's T slice."""
    import minipar
    from minipar import comm, nn
    from minipar.parallel.tensor import ParallelGPTEmbedding, ParallelMLP, copy_serial_slices

    world = comm.world()
    gpt = nn.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.3)
    t = 8 // world.size
    mine = slice(world.rank * t, (world.rank + 1) * t)
    ids = np.random.default_rng(0).integers(0, 16, (2, 8))
    x = np.random.default_rng(1).standard_normal((2, 8, 16))
    errors = []
    for serial, parallel, given in (
            (nn.GPTEmbedding(gpt), ParallelGPTEmbedding(gpt, world, sequence_parallel=True), ids),
            (nn.MLP(16, 0.3), ParallelMLP(16, world, 0.3, sequence_parallel=True), x)):
        serial, parallel = serial.double(), parallel.double()
        copy_serial_slices(parallel, serial, world)
        minipar.manual_seed(5)
        whole = serial(given).data[:, mine]
        minipar.manual_seed(5)
        part = parallel(given if given is ids else given[:, mine]).data
        errors.append(float(np.abs(part - whole).max()))
    return errors, moe_dropout_loss(world, gpt)


def moe_dropout_loss(world, gpt):
    """One step of the MoE GPT with dropout under sequence parallelism (the experts' masks of
    rows whose numbers differ per tensor rank): the loss."""
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid4d import Trainer4D
    from minipar.parallel.tensor.moe import MoEConfig

    trainer = Trainer4D(gpt, MoEConfig(n_experts=2, hidden=32), ParallelGroups(world, tp=2),
                        dtype="float64", sequence_parallel=True)
    ids, targets = batches()[0]
    return float(trainer.step(ids, targets))


@pytest.mark.mpi
def test_sequence_parallel_dropout_is_the_serial_mask_sliced():
    """Each rank's T slice gets its slice of the serial mask, not a mask of its own shape (which
    would repeat the same pattern on every rank: one shared stream)."""
    results = run_on_ranks(dropout_body, 2, timeout=120)
    for errors, _ in results:
        assert max(errors) < TOLERANCE, errors
    losses = [loss for _, loss in results]
    assert np.isfinite(losses[0]) and losses[0] == losses[1], losses
