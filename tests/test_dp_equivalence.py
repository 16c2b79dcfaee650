"""Acceptance: after 3 steps, N-rank data-parallel training (N = 2, 3, 4) gives the parameters
of serial training on the global batch, for DDP (every all-reduce algorithm, several bucket
sizes, overlap on and off, gradient accumulation), the parameter server (one and sharded), and
ZeRO stages 1 and 2; MLP and tiny GPT; SGD with momentum, Adam and AdamW.

Tolerances: float64 1e-10 (absolute, parameters are O(1)). float32 2e-5: only rounding differs
(each rank sums its local mean, the ranks' means are then averaged), about 1e-7 relative per
gradient element; Adam divides by sqrt(v), which can amplify a relative gradient error on a
near-zero gradient up to ~lr per step; the float32 Adam/AdamW cases (lr 1e-2) measured about
2e-6 here, SGD about 1.5e-8.
One mpiexec launch per rank count runs every case and returns the failures.
"""
import pytest

from minipar.testing import run_on_ranks

TOL = {"float64": 1e-10, "float32": 2e-5}
ALGORITHMS = ["ring", "recursive_halving", "recursive_doubling", "parameter_server",
              "sharded_ps", "parallel", "sequential", "mpi", "auto"]


def cases():
    """(model, dtype, optimizer, strategy, options) for every checked combination."""
    table = []
    for i, algo in enumerate(ALGORITHMS):  # each algorithm once, bucket sizes and models rotate
        cap = (0.0005, 0.004, 25.0)[i % 3]
        kind = ("mlp", "gpt")[i % 2]
        opt = ("adam", "sgd", "adamw")[i % 3]
        table.append((kind, "float64", opt, "ddp",  # overlapped, whatever the default here
                      dict(algorithm=algo, bucket_cap_mb=cap, overlap=True)))
    table += [
        ("gpt", "float64", "adamw", "ddp", dict(bucket_cap_mb=0.002, overlap=False)),
        ("mlp", "float64", "sgd", "ddp", dict(bucket_cap_mb=0.0005, accumulate=2)),
        ("gpt", "float64", "adam", "ddp", dict(algorithm="mpi", bucket_cap_mb=0.002, accumulate=3)),
        ("mlp", "float32", "sgd", "ddp", dict(bucket_cap_mb=0.0005)),
        ("gpt", "float32", "adamw", "ddp", dict(bucket_cap_mb=0.002)),
    ]
    for kind in ("mlp", "gpt"):
        for opt in ("sgd", "adamw"):
            table += [(kind, "float64", opt, "ps", dict(sharded=False)),
                      (kind, "float64", opt, "ps", dict(sharded=True)),
                      (kind, "float64", opt, "zero", dict(stage=1)),
                      (kind, "float64", opt, "zero", dict(stage=2, bucket_cap_mb=0.002)),
                      (kind, "float64", opt, "zero", dict(stage=1, bucket_cap_mb=0.001,
                                                          algorithm="recursive_halving"))]
    table += [("gpt", "float32", "adam", "zero", dict(stage=2, bucket_cap_mb=0.002)),
              ("mlp", "float32", "sgd", "ps", dict(sharded=True))]
    return table


def equivalence_body():
    from minipar import comm
    from test_dp_helpers import max_difference, train

    world = comm.world()
    serial, report = {}, []
    for kind, dtype, opt, strategy, options in cases():
        key = (kind, dtype, opt)
        if key not in serial:
            serial[key] = train(kind, dtype, opt)
        got = train(kind, dtype, opt, strategy, world, **dict(options))
        report.append((f"{strategy} {kind} {dtype} {opt} {options}",
                       max_difference(serial[key], got), TOL[dtype]))
    return report, pending_at_launch(world)


def pending_at_launch(world):
    """For each bucket as DDP launches it: how many parameters still wait for their gradient
    (more than 0: the all-reduce starts while backward is still running)."""
    from minipar.parallel.data import DistributedDataParallel
    from test_dp_helpers import loss_of, make_data, make_model

    model = make_model("gpt", "float64")
    ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.002, overlap=True)
    seen, launch = [], ddp.averaging.launch

    def spy(i):
        seen.append(sum(ddp.missing))
        launch(i)
    ddp.averaging.launch = spy
    x, y = make_data("gpt", "float64")
    loss_of("gpt", ddp, x[:2], y[:2]).backward()
    return seen


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_data_parallel_equals_serial(nprocs):
    per_rank = run_on_ranks(equivalence_body, nprocs, timeout=180)
    failures = [f"rank {r}: {name}: max |difference| {diff:.3g} > {tol:g}"
                for r, (report, _) in enumerate(per_rank) for name, diff, tol in report
                if diff > tol]
    assert not failures, "\n".join(failures)
    assert len(per_rank[0][0]) == len(cases())
    for _, pending in per_rank:  # overlap: the first buckets go out while backward goes on
        assert len(pending) > 3 and pending[0] > 0 and pending[-1] == 0, pending
