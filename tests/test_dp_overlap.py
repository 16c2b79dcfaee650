"""DDP's overlap default: on where every node has a core no rank uses, off where none is idle,
the same choice on every rank, and the reason in words; a bad ``overlap`` names itself."""
import pytest

from minipar.testing import run_on_ranks


def overlap_body():
    import os

    import minipar.nn as nn
    from minipar.comm import world
    from minipar.parallel.data import DistributedDataParallel
    from minipar.comm.node import overlap_default

    comm, out = world(), {}
    real = getattr(os, "sched_getaffinity", None)
    masks = {"4 cores": lambda pid: {0, 1, 2, 3},
             "2 cores": lambda pid: {0, 1},
             "bound, one core each": lambda pid: {comm.rank},  # together: 2 cores for 2 ranks
             "bound, two cores each": lambda pid: {2 * comm.rank, 2 * comm.rank + 1}}
    alone = comm.split(color=comm.rank)  # a group of one, beside the other rank on the node
    try:
        for name, mask in masks.items():
            os.sched_getaffinity = mask
            out[name] = overlap_default(comm)
        out["a group of one, 2 cores"] = overlap_default(alone)
        os.sched_getaffinity = masks["4 cores"]
        out["a group of one, 4 cores"] = overlap_default(alone)
    finally:
        if real is None:
            del os.sched_getaffinity
        else:
            os.sched_getaffinity = real
    model = nn.Sequential(nn.Linear(3, 4))
    out["auto"] = DistributedDataParallel(model, comm).overlap == overlap_default(comm)[0]
    forced = DistributedDataParallel(model, comm, overlap=True)
    out["forced"] = [forced.overlap, forced.overlap_reason]
    try:
        DistributedDataParallel(model, comm, overlap="yes")
        out["bad"] = None
    except ValueError as err:
        out["bad"] = str(err)
    return out


@pytest.mark.mpi
def test_overlap_default_follows_idle_cores_on_every_rank():
    got = run_on_ranks(overlap_body, 2)
    for rank, out in enumerate(got):
        assert out["4 cores"] == [True, "overlap on: 2 rank(s) on 4 usable cores leave 2 idle "
                                        "for the background all-reduce"]
        assert out["2 cores"][0] is False and out["2 cores"][1].startswith(
            "overlap off: 2 rank(s) on 2 usable cores leave no core idle")
        assert out["bound, one core each"][0] is False
        assert out["bound, two cores each"][0] is True
        assert out["a group of one, 2 cores"][1].startswith(  # the job's 2 ranks, from mpiexec
            "overlap off: 2 rank(s) on 2 usable cores")
        assert out["a group of one, 4 cores"][1].startswith("overlap on: 2 rank(s) on 4 usable")
        assert out["auto"] is True
        assert out["forced"] == [True, "overlap=True given"]
        assert out["bad"] == (f"rank {rank}: DistributedDataParallel: overlap must be True, "
                              f"False or 'auto', got 'yes'")
