"""Bad input, checked on every rank of a real launch (3 ranks):

- parameters that differ across ranks at wrap time are detected AND overwritten by rank 0's
  broadcast (DDP, parameter server, ZeRO): ``mismatched`` names them on the ranks that differed,
  a warning says so, and afterwards every rank holds rank 0's values; ``on_mismatch="raise"``
  makes every rank raise the same error instead;
- a dataset smaller than the number of ranks, and a global batch that does not divide, raise a
  ValueError on every rank;
- a parameter that gets no gradient: ``synchronize()`` finishes the step (no hang) with a zero
  gradient for it, on every rank.
"""
from minipar.testing import run_on_ranks

NPROCS = 3


def _error(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def bad_input_body():
    import warnings

    import numpy as np

    import minipar
    from minipar import comm, optim
    from minipar.parallel.data import (DistributedDataParallel, DistributedSampler,
                                       ParameterServer, ZeRO)
    from test_dp_helpers import make_model

    world = comm.world()
    out = {}
    wrappers = {"ddp": lambda m: DistributedDataParallel(m, world),
                "ps": lambda m: ParameterServer(m, lambda ps: optim.SGD(ps, lr=0.1), world),
                "zero": lambda m: ZeRO(m, lambda ps: optim.Adam(ps), world, stage=2)}
    for name, wrap in wrappers.items():
        model = make_model("mlp", "float64", seed=world.rank)  # a different init on each rank
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = wrap(model)
        flat = minipar.backend.xp().concatenate([p.data.ravel() for p in model.parameters()])
        out[name] = {"mismatched": wrapped.mismatched, "warnings": [str(w.message) for w in caught],
                     "same_as_rank0": bool((world.broadcast(flat, root=0) == flat).all())}
    out["raise"] = _error(lambda: DistributedDataParallel(
        make_model("mlp", "float64", seed=world.rank), world, on_mismatch="raise"))
    out["same_seed_raise"] = _error(lambda: DistributedDataParallel(
        make_model("mlp", "float64", seed=0), world, on_mismatch="raise"))
    out["small_dataset"] = _error(lambda: DistributedSampler(2, world.size, world.rank))
    out["batch"] = _error(lambda: DistributedSampler(30, world.size, world.rank).batches(10))

    # an unused parameter: its bucket never fills, synchronize() completes the step
    model = minipar.nn.Sequential(minipar.nn.Linear(3, 2), minipar.nn.Linear(3, 2))
    ddp = DistributedDataParallel(model, world, bucket_cap_mb=1e-5)
    loss = model[0](minipar.tensor(np.full((2, 3), world.rank + 1.0, "float32"))).sum()
    loss.backward()
    ddp.synchronize()
    ddp.synchronize()  # a second call is a no-op
    out["unused"] = [minipar.to_numpy(p.grad).tolist() for p in model.parameters()]
    return out


def test_bad_input_on_every_rank():
    results = run_on_ranks(bad_input_body, NPROCS, timeout=120)
    for rank, out in enumerate(results):
        for name in ("ddp", "ps", "zero"):
            got = out[name]
            assert got["same_as_rank0"], (rank, name)
            if rank == 0:
                assert got["mismatched"] == [] and got["warnings"] == []
            else:
                assert "0.weight" in got["mismatched"] and len(got["mismatched"]) == 6
                assert any("overwritten by the broadcast" in w for w in got["warnings"])
        assert "parameters differ from rank 0's at wrap time (rank 1: 0.weight" in out["raise"]
        assert "rank 2:" in out["raise"]
        assert out["same_seed_raise"] is None
        assert (f"rank {rank}: the dataset has 2 samples, fewer than the 3 ranks"
                in out["small_dataset"])
        assert "global batch size 10 does not divide among 3 ranks" in out["batch"]
        w0, b0, w1, b1 = out["unused"]
        assert w0 == [[4.0] * 3] * 2 and b0 == [2.0, 2.0]  # two rows of (1, 2, 3): mean 2 x 2
        assert w1 == [[0.0] * 3] * 2 and b1 == [0.0, 0.0]
