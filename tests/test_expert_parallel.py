"""Expert parallelism equals its serial twin, over a hand-coded all_to_all_v equal to MPI's.

One launch per rank count (1 to 4) runs the whole table and returns its failures:

- ``all_to_all_v`` (pairwise) against MPI_Alltoallv (``"mpi"``): every dtype, rows of shape
  (), (3,) and (2, 3), counts with zeros, given or exchanged; its bytes against the counters;
- ExpertParallelMoE on the group against nn.moe.MoE applied to each rank's tokens with the same
  parameters (GShard's capacity per group): outputs, dx, routing, l_aux, every gradient, with
  and without drops, top-1 and top-2, float64 to 1e-10;
- bad input raises the same clear error on every rank.

A second launch gives inconsistent counts and must end the job with a clear error, not hang;
a third is the benchmark's smoke run (its numbers are not judged here: timings are noisy).
"""
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from minipar.testing import RANK_ENV, launch_command, run_on_ranks

TOL = 1e-10
DTYPES = ("float16", "float32", "float64", "int32", "int64")


def _a2av_cases(world, rng, failures):
    from minipar import backend

    xp, p, r = backend.xp(), world.size, world.rank
    mine = np.random.default_rng(100 + r)  # the rows: a different number on every rank
    for dtype in DTYPES:
        for row in ((), (3,), (2, 3)):
            for given in (True, False):
                table = rng.integers(0, 4, (p, p))  # same on every rank: table[s, d] rows s -> d
                table[0, p - 1] = 0  # a zero count somewhere
                send, recv = table[r].tolist(), table[:, r].tolist()
                x = xp.asarray((mine.standard_normal((sum(send),) + row) * 50).astype(dtype))
                want = world.all_to_all_v(x, send, recv, algorithm="mpi")
                before = world.counters.bytes_sent
                got = world.all_to_all_v(x, send, recv if given else None)
                sent = world.counters.bytes_sent - before
                rows = sum(send) - send[r]
                expect = rows * int(np.prod(row, dtype=int)) * x.dtype.itemsize
                expect += 0 if given else (p - 1) * 8  # the counts: one int64 to each peer
                case = f"p={p} rank {r}: all_to_all_v {dtype} rows {row} given={given}"
                if got.shape != (sum(recv),) + row or not np.array_equal(
                        backend.to_numpy(got), backend.to_numpy(want)):
                    failures.append(case + " differs from MPI_Alltoallv")
                if sent != expect:
                    failures.append(f"{case}: sent {sent} bytes, expected {expect}")


def _ep_case(world, rng, failures, E, k, cf, B=2, T=5, C=6):
    import minipar
    from minipar import Tensor, to_numpy
    from minipar.nn.moe import MoE
    from minipar.parallel.expert import ExpertParallelMoE

    p, r = world.size, world.rank
    minipar.manual_seed(7)
    serial = MoE(C, E, top_k=k, capacity_factor=cf, hidden=10, aux_coeff=0.1).double()
    minipar.manual_seed(7)
    built = ExpertParallelMoE(C, E, top_k=k, capacity_factor=cf, hidden=10, aux_coeff=0.1,
                              group=world).double()
    layer = ExpertParallelMoE.from_serial(serial, world)
    xs = [rng.standard_normal((B, T, C)) for _ in range(p)]  # every rank's tokens, everywhere
    ws = [np.cos(np.arange(B * T * C) + s).reshape(B, T, C) for s in range(p)]
    refs = []
    for s in range(p):  # the twin: the serial MoE on each rank's tokens, gradients summed
        xt = Tensor(xs[s], requires_grad=True)
        y = serial(xt)
        (y * ws[s]).sum().backward()
        refs.append((y.data, xt.grad, serial.last_routing))
    x = Tensor(xs[r], requires_grad=True)
    y = layer(x)
    (y * ws[r]).sum().backward()
    layer.router_grads_sum()
    case = f"p={p} rank {r} E={E} k={k} cf={cf}"
    y_ref, dx_ref, routing = refs[r]
    diff = lambda a, b: np.abs(to_numpy(a) - to_numpy(b)).max(initial=0)  # noqa: E731
    errors = {"y": diff(y.data, y_ref), "dx": diff(x.grad, dx_ref),
              "aux": abs(layer.last_routing.aux_loss - routing.aux_loss)}
    twin = dict(serial.named_parameters())
    for name, param in layer.named_parameters():
        name = layer.serial_name(name)
        errors["d" + name] = diff(param.grad, twin[name].grad)
    for name, a in built.state_dict().items():  # the constructor's seed gives the same shard
        errors["built " + name] = diff(a, layer.state_dict()[name])
    failures += [f"{case}: {what} differs by {e:.1e}" for what, e in errors.items() if not e < TOL]
    if list(layer.last_routing.kept_per_expert) != list(routing.kept_per_expert):
        failures.append(f"{case}: routing differs from the serial twin's")
    return sum(refs[s][2].dropped for s in range(p))


def _bad_input(world, failures):
    from minipar import comm
    from minipar.parallel.expert import ExpertParallelMoE

    p, seen = world.size, {}

    def expect(case, error, fn):
        try:
            fn()
            seen[case] = "no error"
        except error as e:
            seen[case] = re.sub(r"^rank \d+: ", "rank R: ", str(e))  # the rest: the same

    x = np.ones((4, 2))
    expect("length", comm.CommError, lambda: world.all_to_all_v(x, [4] + [0] * p))
    expect("negative", comm.CommError, lambda: world.all_to_all_v(x, [5, -1] + [0] * (p - 2))
           if p > 1 else world.all_to_all_v(x, [-1]))
    expect("sum", comm.CommError, lambda: world.all_to_all_v(x, [5] + [0] * (p - 1)))
    expect("algorithm", comm.CommError, lambda: world.all_to_all_v(x, [4] + [0] * (p - 1),
                                                                   algorithm="ring"))
    if p > 1:  # every count divides by 1; one rank is alone in its row shape
        expect("experts", ValueError, lambda: ExpertParallelMoE(4, 4 * p + 1, group=world))
        wide = np.ones((p, 2 + (world.rank == 1)))
        expect("row shape", comm.CommError, lambda: world.all_to_all_v(wide, [1] * p, check=True))
    expect("group", TypeError, lambda: ExpertParallelMoE(4, 4, group=None))
    words = {"length": f"{p} non-negative integers", "negative": "non-negative",
             "sum": "add up to", "algorithm": "pairwise", "experts": "divisible",
             "group": "Communicator", "row shape": "arrays differ across ranks"}
    for case, word in words.items() if p > 1 else list(words.items())[:4] + [("group", "")]:
        if word not in seen[case] or len(set(world.all_gather_object(seen[case]))) != 1:
            failures.append(f"p={p} rank {world.rank}: {case}: {seen[case]}")


def expert_parallel_body():
    """The whole table on this rank: a list of failures (strings) and the drops seen."""
    from minipar import comm

    world = comm.world()
    p = world.size
    rng = np.random.default_rng(0)  # the same draws on every rank
    failures, drops = [], {}
    _a2av_cases(world, rng, failures)
    for E, k, cf in ((2 * p, 1, None), (2 * p, 2, 1.25), (p, 1, 0.5), (4 * p, 2, 0.5)):
        drops[f"{E},{k},{cf}"] = _ep_case(world, rng, failures, E, k, cf)
    _bad_input(world, failures)
    world.barrier()
    return failures, drops


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_expert_parallel_equals_serial_twin(nprocs):
    results = run_on_ranks(expert_parallel_body, nprocs, timeout=240)
    failures = [f for per_rank, _ in results for f in per_rank]
    assert not failures, "\n".join(failures)
    drops = results[0][1]
    assert drops[f"{2 * nprocs},1,None"] == 0  # capacity_factor=None drops nothing
    assert drops[f"{4 * nprocs},2,0.5"] > 0  # the table covers drops


def mismatch_body():
    """Rank 0 expects more rows from rank 1 than rank 1 sends: a receive-side size error."""
    from minipar import comm

    world = comm.world()
    recv = [1, 2] if world.rank == 0 else [1, 1]
    world.all_to_all_v(np.ones((2, 3)), [1, 1], recv)


@pytest.mark.mpi
def test_inconsistent_counts_end_the_job_with_a_clear_error():
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(mismatch_body, 2, timeout=60)
    text = str(failure.value)
    assert "CommError" in text and "differ across ranks" in text, text


@pytest.mark.mpi
def test_benchmark_smoke_run_prints_its_ratios():
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_expert.py"
    done = subprocess.run(launch_command(2, sys.executable, script, "--quick"),
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, **RANK_ENV})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.split()[0] in ("balanced", "skewed") for line in lines if line.strip()) == 4
    assert lines[-1].startswith("  expert parallel / serial: ")
