"""minipar.distributed, torch.distributed's shape: every collective in place against NumPy, a
torch-style data-parallel loop equal to serial training, new_group, and the all-reduce switch.

Each rank count is one launch whose body returns its failures (an empty list passes)."""
import json

import numpy as np
import pytest

from minipar.testing import run_on_ranks


def torch_style_training(rank_rows, world_size, rank, optimizer_name, steps=4):
    """A torch.distributed data-parallel loop: only its imports name minipar
    (``import torch.distributed as dist`` -> ``import minipar.distributed as dist``, and
    torch.nn / torch.optim / torch.nn.functional -> minipar.nn / optim / functional).
    ``rank_rows(rank)`` picks this rank's rows of the global batch (world_size 1: serial)."""
    import minipar.distributed as dist
    import minipar.functional as F
    from minipar import nn, optim, random

    random.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    if optimizer_name == "sgd":
        optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    data = np.random.default_rng(1)
    for step in range(steps):
        x = data.standard_normal((12, 6))
        y = data.integers(0, 3, 12)
        rows = rank_rows(rank)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        if world_size > 1:
            for p in model.parameters():
                if step % 2 == 0:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= world_size
                else:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
    return [p.numpy() for p in model.parameters()]


def _rows_of(world_size):
    return lambda rank: slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)


def facade_body():
    """Every collective against NumPy, in place, on Tensors and arrays; DP training; groups."""
    import minipar.distributed as dist
    from minipar import to_numpy
    from minipar.autograd import Tensor

    failures = []

    def check(name, got, want, tol=0.0):
        got = to_numpy(got)
        if np.shape(got) != np.shape(want) or not np.allclose(got, want, rtol=0, atol=tol):
            failures.append(f"{name}: got {np.asarray(got).tolist()}, "
                            f"want {np.asarray(want).tolist()}")

    dist.init_process_group(backend="gloo")  # a torch script's backend name runs over MPI
    rank, p = dist.get_rank(), dist.get_world_size()
    if not dist.is_initialized() or dist.get_backend() != "mpi":
        failures.append("is_initialized / get_backend")
    xs = [np.arange(10.0) * (r + 1) + r for r in range(p)]  # rank r's vector
    for op, reduce_ in (("SUM", np.sum), ("AVG", np.mean), ("MAX", np.max), ("MIN", np.min),
                        ("PRODUCT", np.prod)):
        a = xs[rank].copy()
        dist.all_reduce(a, op=getattr(dist.ReduceOp, op))
        check(f"all_reduce {op}", a, reduce_(xs, axis=0), 1e-12)
    t = Tensor(xs[rank].reshape(2, 5).copy())  # a Tensor: its data is overwritten
    dist.all_reduce(t)
    check("all_reduce Tensor", t.data, np.sum(xs, axis=0).reshape(2, 5))
    strided = np.zeros((10, 2))
    strided[:, 0] = xs[rank]  # a non-contiguous view is filled in place too
    dist.all_reduce(strided[:, 0])
    check("all_reduce view", strided[:, 0], np.sum(xs, axis=0))
    loss = Tensor(np.array(float(rank)))  # a 0-d loss, averaged for logging
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    check("all_reduce 0-d", loss.data, (p - 1) / 2)
    a = xs[rank].copy()
    work = dist.all_reduce(a, async_op=True)
    work.wait()
    check("all_reduce async", a, np.sum(xs, axis=0))
    for src in range(p):
        b = xs[rank].copy()
        dist.broadcast(b, src=src)
        check(f"broadcast src={src}", b, xs[src])
    c = xs[rank].copy()
    dist.reduce(c, dst=p - 1, op=dist.ReduceOp.SUM)
    check("reduce", c, np.sum(xs, axis=0) if rank == p - 1 else xs[rank])
    gathered = [np.empty(10) for _ in range(p)]
    dist.all_gather(gathered, Tensor(xs[rank]))
    check("all_gather", np.stack(gathered), np.stack(xs))
    flat = np.empty(10 * p)
    dist.all_gather_into_tensor(flat, xs[rank])
    check("all_gather_into_tensor", flat, np.concatenate(xs))
    inputs = [xs[rank] + 100 * j for j in range(p)]  # entry j goes to rank j, reduced
    out = Tensor(np.empty(10))
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
    check("reduce_scatter", out.data, np.sum(xs, axis=0) + 100 * rank * p)
    out = np.empty(10)
    dist.reduce_scatter_tensor(out, np.concatenate(inputs), op=dist.ReduceOp.MAX)
    check("reduce_scatter_tensor", out, np.max(xs, axis=0) + 100 * rank)
    # point to point around the ring: blocking, then non-blocking
    right, left = (rank + 1) % p, (rank - 1) % p
    got = np.empty(10)
    if rank % 2 == 0:
        dist.send(xs[rank], dst=right)
        sender = dist.recv(got, src=left)
    else:
        sender = dist.recv(got, src=left)
        dist.send(xs[rank], dst=right)
    check("send/recv", got, xs[left])
    if sender != left:
        failures.append(f"recv returned {sender}, not {left}")
    got = Tensor(np.empty(10))
    works = [dist.irecv(got, src=left), dist.isend(xs[rank], dst=right)]
    for w in works:
        w.wait()
    check("isend/irecv", got.data, xs[left])
    dist.barrier(group=dist.group.WORLD)
    # a group of the even ranks: world ranks in the calls, group numbering in get_rank
    evens = dist.new_group(list(range(0, p, 2)))
    a = xs[rank].copy()
    dist.all_reduce(a, group=evens)
    member = rank % 2 == 0
    check("new_group all_reduce", a, np.sum(xs[::2], axis=0) if member else xs[rank])
    if dist.get_rank(evens) != (rank // 2 if member else -1) \
            or dist.get_world_size(evens) != len(range(0, p, 2)):
        failures.append(f"new_group rank/size: {dist.get_rank(evens)}, "
                        f"{dist.get_world_size(evens)}")
    b = xs[rank].copy()
    dist.broadcast(b, src=0, group=evens)
    check("new_group broadcast", b, xs[0] if member else xs[rank])
    # a torch-style data-parallel loop equals serial training (float64)
    errors = {}
    for name in ("sgd", "adamw"):
        serial = torch_style_training(_rows_of(1), 1, 0, name)
        parallel = torch_style_training(_rows_of(p), p, rank, name)
        errors[name] = max(float(np.abs(s - q).max()) for s, q in zip(serial, parallel))
        if errors[name] > 1e-10:
            failures.append(f"DP {name}: max |serial - parallel| = {errors[name]:.3g}")
    dist.destroy_process_group()
    return {"failures": failures, "errors": errors}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_facade_collectives_groups_and_training(nprocs):
    results = run_on_ranks(facade_body, nprocs, timeout=180)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, "\n".join(failures)


TORCH_SCRIPT = """
import json

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim

dist.init_process_group(backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3)).double()
optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = np.random.default_rng(1)
rows = 12 // world_size  # each rank trains on its slice of the global batch of 12
for step in range(5):
    x = torch.tensor(data.standard_normal((12, 6)))
    y = torch.tensor(data.integers(0, 3, 12))
    loss = F.cross_entropy(model(x[rank * rows:(rank + 1) * rows]),
                           y[rank * rows:(rank + 1) * rows])
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size
    optimizer.step()
if rank == 0:
    print("WEIGHTS", json.dumps([p.detach().numpy().ravel().tolist()
                                 for p in model.parameters()]))
dist.destroy_process_group()
"""
TORCH_TO_MINIPAR = {"import torch\n": "import minipar as torch\n",
                    "import torch.distributed as dist": "import minipar.distributed as dist",
                    "import torch.nn.functional as F": "import minipar.functional as F",
                    "from torch import nn, optim": "from minipar import nn, optim"}


def _final_weights(source, nprocs):
    from minipar.testing import run_job
    status, output, _ = run_job(source, nprocs, timeout=120)
    assert status == 0, output
    line = next(line for line in output.splitlines() if line.startswith("WEIGHTS"))
    return np.concatenate([np.array(w) for w in json.loads(line[len("WEIGHTS"):])])


def test_torch_script_with_its_imports_changed_trains_to_serial_weights():
    """The acceptance: a torch.distributed DP script, only its imports changed, on 2 and 3
    ranks ends on the serial weights (1 rank) within 1e-10 in float64."""
    source = TORCH_SCRIPT
    for torch_line, minipar_line in TORCH_TO_MINIPAR.items():
        assert torch_line in source
        source = source.replace(torch_line, minipar_line)
    serial = _final_weights(source, 1)
    for nprocs in (2, 3):
        error = np.abs(_final_weights(source, nprocs) - serial).max()
        assert error <= 1e-10, f"{nprocs} ranks: max |serial - parallel| = {error:.3g}"


def switch_body():
    """The all-reduce algorithm: MINIPAR_ALLREDUCE picks a registered one (a student's ring);
    init_process_group's argument overrides it; a typo names the valid choices."""
    import minipar.distributed as dist
    from minipar.comm import ALGORITHMS, CommError
    from minipar.comm.registry import algorithm

    calls = []

    @algorithm("all_reduce", "my_ring", 15)
    def my_ring(c, x, buf, op):  # a student's ring: here the library's, counted
        calls.append(op)
        ALGORITHMS["all_reduce"]["ring"](c, x, buf, op)

    failures = []
    dist.init_process_group()  # MINIPAR_ALLREDUCE=my_ring from the launch's environment
    a = np.arange(5.0) + dist.get_rank()
    dist.all_reduce(a)
    if calls != ["sum"] or not np.array_equal(a, 2 * np.arange(5.0) + 1):
        failures.append(f"env: calls {calls}, result {a.tolist()}")
    if dist.get_all_reduce_algorithm() != "my_ring":
        failures.append(f"env: algorithm {dist.get_all_reduce_algorithm()}")
    dist.destroy_process_group()
    dist.init_process_group(backend="mpi", all_reduce_algorithm="recursive_doubling")
    dist.all_reduce(a)
    if len(calls) != 1 or dist.get_all_reduce_algorithm() != "recursive_doubling":
        failures.append("argument did not override MINIPAR_ALLREDUCE")
    dist.destroy_process_group()
    try:
        dist.init_process_group(all_reduce_algorithm="rign")
        failures.append("a misspelt algorithm was accepted")
    except CommError as error:
        if "ring" not in str(error):
            failures.append(f"typo error names no choices: {error}")
    return failures


def test_all_reduce_algorithm_switch():
    failures = sum(run_on_ranks(switch_body, 2, env={"MINIPAR_ALLREDUCE": "my_ring"}), [])
    assert not failures, "\n".join(failures)


def test_errors_before_init_and_for_wrong_arguments():
    import minipar.distributed as dist
    with pytest.raises(RuntimeError, match="init_process_group"):
        dist.get_rank()
    with pytest.raises(ValueError, match="backend"):
        dist.init_process_group(backend="tcp")
    with pytest.raises(ValueError, match="reduction op"):
        dist.process_group.op_name("mean")
    assert dist.process_group.op_name("sum") == dist.process_group.op_name(dist.ReduceOp.SUM)
    with pytest.raises(TypeError, match="list of P2POp"):
        dist.batch_isend_irecv([(dist.isend, np.zeros(1), 1)])


def mpi_rank_and_size_body():
    """torch's MPI backend ignores rank and world_size with a warning (the tutorial passes 0, 0);
    gloo's, meant by the script, must agree with the launch."""
    import warnings

    import minipar.distributed as dist
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("mpi", rank=0, world_size=2)  # every rank says 0
    said = [str(w.message) for w in caught]
    dist.destroy_process_group()
    try:
        dist.init_process_group("gloo", rank=0, world_size=3)
        refused = None
    except ValueError as err:
        refused = str(err)
    return said, refused


def test_mpi_backend_takes_rank_and_size_from_the_launch():
    said, refused = zip(*run_on_ranks(mpi_rank_and_size_body, 2))
    assert said == ([], ["init_process_group: for the MPI backend, world_size and rank are "
                         "assigned by the MPI launch: rank=0 ignored, the launch says 1"])
    assert all("world_size=3 but the MPI job says 2" in r for r in refused)


FACADE = ("init_process_group", "is_initialized", "get_rank", "get_world_size", "get_backend",
          "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
          "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "barrier",
          "new_group", "destroy_process_group", "get_global_rank", "get_group_rank",
          "get_process_group_ranks", "gather", "scatter", "all_to_all", "all_to_all_single",
          "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
          "batch_isend_irecv", "P2POp")


def test_signatures_follow_torch_distributed():
    """The parameters both have come in torch's order, so torch's positional calls work."""
    import inspect

    import minipar.distributed as dist
    torch_dist = pytest.importorskip("torch.distributed")
    for name in FACADE:
        ours = list(inspect.signature(getattr(dist, name)).parameters)
        theirs = list(inspect.signature(getattr(torch_dist, name)).parameters)
        common = [n for n in theirs if n in ours]
        assert ours[:len(common)] == common, (name, ours, theirs)
    assert {"SUM", "AVG", "MAX", "MIN", "PRODUCT"} <= set(dir(torch_dist.ReduceOp))
    assert [op.name for op in dist.ReduceOp] == ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]


@pytest.mark.mpi
@pytest.mark.fault
def test_a_rank_that_fails_before_init_ends_the_peers_waiting_in_it():
    """Rank 1 raises before init_process_group while rank 0 waits inside it (in MPI's
    start-up, for rank 1): rank 1 starts MPI itself and aborts the job, its traceback printed,
    where it used to leave rank 0 waiting for ever."""
    from minipar.testing import run_job

    script = ("import minipar.distributed as dist\n"
              "if dist.process_group.launched_rank() == 1:\n"
              "    raise ValueError('bad config on rank 1')\n"
              "dist.init_process_group('mpi')\n"
              "dist.barrier()\n")
    status, output, seconds = run_job(script, 2, timeout=60)
    assert status not in (None, 0), output  # None: still running at the timeout, killed
    assert "[rank 1] ValueError: bad config on rank 1" in output, output
    assert seconds < 30, (seconds, output)


@pytest.mark.mpi
def test_an_error_before_init_names_its_rank_on_every_line():
    """A launched script that raises before init_process_group (minipar.comm not yet imported)
    prints its traceback with ``[rank r]`` on every line, as an error after start-up does."""
    from minipar.testing import run_job

    script = ("import minipar.distributed as dist\n"
              "raise ValueError('bad config')\n"
              "dist.init_process_group('mpi')\n")
    status, output, _ = run_job(script, 2, timeout=60)
    assert status not in (None, 0), output
    lines = [line for line in output.splitlines() if "Traceback" in line or "bad config" in line]
    for rank in (0, 1):
        assert f"[rank {rank}] ValueError: bad config" in lines, output
    assert all(line.startswith("[rank ") for line in lines), output
