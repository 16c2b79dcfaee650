"""GradScaler refuses what torch.amp.GradScaler("cpu") refuses, with torch's exception and
message: ``step`` or ``unscale_`` before any ``scale()`` (the gradients were never multiplied by
the scale, and would be divided by it); the weights stay as they were. As torch, the scale exists
from the first scale() on: a later iteration is not refused. On 2 ranks with group=world: no
rank scaled is the same refusal on both; one rank scaled (a pipeline's last stage) steps both,
and an inf on the rank that did not scale still skips the step on both."""
import numpy as np
import pytest

import minipar
from minipar import nn, optim
from minipar.amp import GradScaler
from minipar.testing import run_on_ranks
from nn_torch_twins import requires_torch, torch


def refusal(call):
    """(type name, message) of what ``call()`` raised, None if nothing."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the refusal itself is compared
        return type(error).__name__, str(error)
    return None


def ours(caller, load=False, scaled_before=False):
    w = nn.Parameter(minipar.backend.asarray(np.ones(3, "float32")))
    opt, scaler = optim.SGD([w], lr=0.1), GradScaler()
    if load:
        scaler.load_state_dict(GradScaler(init_scale=8.0).state_dict())
    if scaled_before:  # an earlier iteration scaled its loss
        scaler.scale((w * 1.0).sum()).backward()
        scaler.step(opt)
        scaler.update()
    w.grad = minipar.backend.asarray(np.full(3, 2.0, "float32"))
    before = minipar.backend.to_numpy(w.data).copy()
    got = refusal(lambda: getattr(scaler, caller)(opt))
    return got, np.array_equal(before, minipar.backend.to_numpy(w.data))


def theirs(caller, load=False, scaled_before=False):
    w = torch.nn.Parameter(torch.ones(3))
    opt, scaler = torch.optim.SGD([w], lr=0.1), torch.amp.GradScaler("cpu")
    if load:
        scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    if scaled_before:
        scaler.scale((w * 1.0).sum()).backward()
        scaler.step(opt)
        scaler.update()
    w.grad = torch.full((3,), 2.0)
    return refusal(lambda: getattr(scaler, caller)(opt))


@requires_torch
@pytest.mark.parametrize("caller", ["step", "unscale_"])
@pytest.mark.parametrize("case", [{}, {"load": True}, {"scaled_before": True}])
def test_without_scale_refused_as_torch(caller, case):
    got, kept = ours(caller, **case)
    assert got == theirs(caller, **case)
    if got is not None:
        assert got[0] == "AssertionError" and "_scale is None" in got[1], got
        assert kept, "the weights moved although the step was refused"


def group_body():
    from minipar import comm

    world, out = comm.world(), {}
    for case in ("none scaled", "rank 1 scaled", "rank 1 scaled, inf on rank 0"):
        w = nn.Parameter(minipar.backend.asarray(np.ones(3, "float32")))
        opt, scaler = optim.SGD([w], lr=0.1), GradScaler(group=world)
        if world.rank == 1 and case != "none scaled":
            scaler.scale((w * 1.0).sum()).backward()
        else:  # the gradient a later stage sent back, scaled there
            w.grad = minipar.backend.asarray(np.full(3, 2.0**16, "float32"))
            if case.endswith("inf on rank 0"):
                w.grad[0] = np.inf
        before = minipar.backend.to_numpy(w.data).copy()
        out[case] = (refusal(lambda: scaler.step(opt)),
                     not np.array_equal(before, minipar.backend.to_numpy(w.data)))
    return out


@pytest.mark.mpi
def test_with_a_group_every_rank_refuses_or_none():
    per_rank = run_on_ranks(group_body, 2, timeout=120, env={"MINIPAR_TIMEOUT": "10"})
    message = ("Attempted step but _scale is None.  This may indicate your script did not use "
               "scaler.scale(loss or outputs) earlier in the iteration.")
    for rank, out in enumerate(per_rank):  # (what step raised, whether the weights moved)
        assert out["none scaled"] == [["AssertionError", message], False], (rank, out)
        assert out["rank 1 scaled"] == [None, True], (rank, out)
        assert out["rank 1 scaled, inf on rank 0"] == [None, False], (rank, out)
