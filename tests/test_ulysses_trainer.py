"""Trainer3D with cp_comm="a2a": the GPT trained with Ulysses attention over the cp group equals
the serial GPT (losses and gradients, float64, 1e-10) and the ring (cp_comm="ring") step by
step, on cp = 2 (2 ranks) and cp = 2 × tp = 2 (4 ranks, 4 heads: 1 a rank), without and with
sequence parallelism; the context group's bytes are the all-to-alls' formula exactly. An
unknown cp_comm, and a head count per tensor rank that cp does not divide, are refused on
every rank before any communication, with the choices and the numbers that fit."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks
from serial_twin import TOLERANCE, assert_equals_serial
from test_context_gpt import T, batches
from test_hybrid import value_errors
from test_sequence_parallel import grad_error


def config(n_head=2, n_embd=16):
    from minipar import nn
    return nn.GPTConfig(vocab_size=16, block_size=T, n_layer=2, n_head=n_head, n_embd=n_embd,
                        dropout=0.0)


def attention_bytes(n_layer, rows, cp, heads, head_dim):
    """The bytes a rank's all-to-alls send in one step: per layer forward and backward each
    4 · (cp − 1)/cp · rows · (T/cp) · heads · d · 8 (q, k, v, then the output)."""
    return n_layer * 2 * 4 * (cp - 1) * rows * (T // cp) * heads * head_dim * 8 // cp


def trainer_body(layouts, n_head, steps):
    """On every rank: each (cp, tp, sequence_parallel) layout under cp_comm "a2a" and "ring",
    beside the serial GPT: losses, serial losses, largest gradient difference, and the bytes
    the context group sent."""
    from minipar import comm, nn, random
    from minipar.backend import to_numpy
    from minipar.parallel.context import ulysses_attention
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D, default_optimizer
    from minipar.parallel.tensor.layers import ParallelSelfAttention
    from minipar.testing import train_serial

    world = comm.world()
    results = {}
    for cp, tp, sp in layouts:
        for cp_comm in ("a2a", "ring"):
            groups = ParallelGroups(world, tp=tp, cp=cp)
            random.manual_seed(0)
            serial = nn.GPT(config(n_head)).astype("float64")
            optimizer = default_optimizer(serial.parameters())
            trainer = Trainer3D(config(n_head), groups, dtype="float64", sequence_parallel=sp,
                                cp_comm=cp_comm)
            layers = [m for m in trainer.model.modules() if isinstance(m, ParallelSelfAttention)]
            assert layers and all((m.attention is ulysses_attention) == (cp_comm == "a2a")
                                  for m in layers), cp_comm
            losses, reference, error, sent = [], [], 0.0, []
            for ids, targets in batches(steps):
                reference += train_serial(serial, optimizer, [(ids, targets)])
                before = groups.context.counters.bytes_sent
                losses.append(float(trainer.step(ids, targets)))
                sent.append(groups.context.counters.bytes_sent - before)
                full = {name: to_numpy(p.grad) for name, p in serial.named_parameters()}
                error = max(error, grad_error(trainer, full))
            results[f"cp{cp} tp{tp} sp={sp} {cp_comm}"] = {
                "losses": losses, "reference": reference, "grad_error": error, "sent": sent,
                "rows": len(trainer.local_shard(ids))}
    return results


def check(results, layouts, n_head):
    for rank, result in enumerate(results):
        for cp, tp, sp in layouts:
            name = f"cp{cp} tp{tp} sp={sp}"
            a2a, ring = result[f"{name} a2a"], result[f"{name} ring"]
            assert_equals_serial(a2a, f"rank {rank}, {name} a2a")
            assert_equals_serial(ring, f"rank {rank}, {name} ring")
            np.testing.assert_allclose(a2a["losses"], ring["losses"], rtol=0, atol=TOLERANCE,
                                       err_msg=f"rank {rank}, {name}: a2a against ring")
            # the all-to-alls ran, their formula's bytes exactly, + 8: loss_share's all-reduce
            # of one float64 (the kept tokens; one micro-batch); the ring's are others
            heads, head_dim = n_head // tp, 16 // n_head
            expected = attention_bytes(2, a2a["rows"], cp, heads, head_dim) + 8
            assert a2a["sent"] == [expected] * len(a2a["sent"]), (rank, name, a2a["sent"])
            assert ring["sent"] != a2a["sent"], (rank, name, ring["sent"])


@pytest.mark.mpi
def test_cp2_a2a_equals_serial_and_ring():
    """cp = 2 on 2 ranks, 2 heads: one a cp rank."""
    layouts = [(2, 1, False)]
    check(run_on_ranks(trainer_body, 2, args=(layouts, 2, 3), timeout=240), layouts, 2)


@pytest.mark.mpi
def test_cp2_tp2_a2a_equals_serial_and_ring():
    """cp = 2 × tp = 2 on 4 ranks, 4 heads: 2 a tensor rank, 1 a (tp, cp) rank; with sequence
    parallelism too (the all-gather of T, then the all-to-alls over cp)."""
    layouts = [(2, 2, False), (2, 2, True)]
    check(run_on_ranks(trainer_body, 4, args=(layouts, 4, 2), timeout=400, heavy_yield=True),
          layouts, 4)


def refusal_body():
    from minipar import comm
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D

    groups = ParallelGroups(comm.world(), cp=2)
    return value_errors(lambda: Trainer3D(config(), groups, cp_comm="ulysses"),
                        lambda: Trainer3D(config(n_head=3, n_embd=12), groups, cp_comm="a2a"),
                        lambda: Trainer3D(config(n_head=3, n_embd=12), groups, cp_comm="ring"))


@pytest.mark.mpi
def test_unknown_cp_comm_and_heads_cp_does_not_divide_are_refused_on_every_rank():
    """cp_comm="ulysses" names the two choices; 3 heads over cp = 2 names the cp sizes that
    fit; the ring takes 3 heads."""
    results = run_on_ranks(refusal_body, 2, timeout=120)
    for errors in results:
        assert "cp_comm='ulysses' is not one of ['a2a', 'ring']" in errors[0], errors[0]
        assert "n_head / tp = 3 / 1 = 3 heads" in errors[1], errors[1]
        assert "cp = 2" in errors[1] and "use cp in [1, 3]" in errors[1], errors[1]
        assert errors[2] == "no error", errors[2]
    assert results[0] == results[1]
