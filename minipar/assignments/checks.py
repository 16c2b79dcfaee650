"""The checks that grade the assignment tasks (``TASKS`` in __init__.py), one or two per task.

Each test exercises its own task's marked region and as little else as it can, so that stripping
one task fails only that task's tests. A test's name contains its task's id (dashes as
underscores); multi-rank checks go through ``run_on_ranks`` with a short timeout. Students run
them with ``python -m pytest minipar/assignments/checks.py -k ring_all_reduce``; ``minipar
assignment grade`` runs the grader's copy.
"""
import numpy as np
import pytest

# The harness comes from the grader when it grades: its sitecustomize (assignments/sandbox.py)
# makes minipar.testing and minipar.gradcheck, wherever they are imported (here, in a check, on
# a rank), the grader's own copies, while every other minipar module is the tree's, the code
# under test; a tree's testing.py or gradcheck.py made to pass everything never grades it. The
# names stay the library's so that a student runs these checks in the tree unchanged.
from minipar.testing import run_on_ranks

TIMEOUT = 40  # seconds per multi-rank job: a stub that hangs is reported, not waited on
rng = np.random.default_rng(0)


def test_op_backward_matmul_matches_finite_differences():
    from minipar.gradcheck import gradcheck
    gradcheck(lambda a, b: a @ b, rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)))
    gradcheck(lambda a, b: a @ b, rng.standard_normal(4), rng.standard_normal((4, 3)))
    gradcheck(lambda a, b: a @ b, rng.standard_normal((3, 4)), rng.standard_normal(4))


def test_layer_norm_backward_matches_finite_differences():
    import minipar.functional as F
    from minipar.gradcheck import gradcheck
    gradcheck(lambda x, w, b: F.layer_norm(x, weight=w, bias=b), rng.standard_normal((2, 3, 6)),
              rng.standard_normal(6), rng.standard_normal(6))
    gradcheck(lambda x: F.layer_norm(x), rng.standard_normal((4, 6)))


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_checkpoint_sequential_same_gradients_as_plain_run(segments):
    import minipar
    from minipar import nn
    from minipar.checkpoint import checkpoint_sequential
    model = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = minipar.Tensor(rng.standard_normal((4, 5)))
    model(x).sum().backward()
    plain = [p.grad.copy() for p in model.parameters()]
    model.zero_grad()
    out = checkpoint_sequential(model, segments, x)
    np.testing.assert_allclose(out.data, model(x).data, rtol=1e-12)
    out.sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), plain):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _all_reduce_body(algorithm, sizes):
    from minipar import comm
    world = comm.world()
    for n in sizes:
        x = np.arange(n, dtype=np.float64) * (world.rank + 1)
        want = np.arange(n, dtype=np.float64) * sum(range(1, world.size + 1))
        got = world.all_reduce(x, algorithm=algorithm)
        np.testing.assert_allclose(got, want, err_msg=f"{algorithm} all-reduce of {n} elements")
        np.testing.assert_allclose(world.all_reduce(x, op="max", algorithm=algorithm),
                                   np.arange(n) * world.size)


@pytest.mark.parametrize("nprocs", [3, 4])
def test_ring_all_reduce_equals_the_sum(nprocs):
    run_on_ranks(_all_reduce_body, nprocs, timeout=TIMEOUT, args=("ring", [1, 7, 100]))


@pytest.mark.parametrize("nprocs", [3, 4])
def test_recursive_halving_all_reduce_equals_the_sum(nprocs):
    run_on_ranks(_all_reduce_body, nprocs, timeout=TIMEOUT,
                 args=("recursive_halving", [1, 7, 100]))


def test_ddp_buckets_follow_pytorchs_rule():
    from minipar import Tensor
    from minipar.parallel.data.buckets import make_buckets
    f32, f64 = np.float32, np.float64
    params = [Tensor(np.zeros(n, dtype)) for n, dtype in
              [(10, f32), (2, f32), (30, f32), (4, f64), (4, f64)]]
    names = {id(p): i for i, p in enumerate(params)}
    got = [[names[id(p)] for p in b] for b in make_buckets(params, cap_bytes=40)]
    assert got == [[4, 3], [2], [1, 0]]  # reversed; a dtype change cuts; closed at >= 40 bytes
    assert [[names[id(p)] for p in b] for b in make_buckets(params[:3], 10 ** 6)] == [[2, 1, 0]]


def _megatron_body():
    import minipar
    from minipar import comm
    from minipar.parallel.tensor.mappings import copy_to_tensor_region, reduce_from_tensor_region
    world = comm.world()
    x = minipar.Tensor(np.full(3, world.rank + 1.0), requires_grad=True)
    y = copy_to_tensor_region(x, world)
    np.testing.assert_allclose(y.data, x.data, err_msg="f's forward is the identity")
    (y * (world.rank + 1.0)).sum().backward()
    np.testing.assert_allclose(x.grad, np.full(3, 3.0), err_msg="f's backward all-reduces")
    x2 = minipar.Tensor(np.full(3, world.rank + 1.0), requires_grad=True)
    z = reduce_from_tensor_region(x2, world)
    np.testing.assert_allclose(z.data, np.full(3, 3.0), err_msg="g's forward all-reduces")
    (z * 2.0).sum().backward()
    np.testing.assert_allclose(x2.grad, np.full(3, 2.0), err_msg="g's backward is the identity")


def test_megatron_f_g_are_conjugate():
    run_on_ranks(_megatron_body, 2, timeout=TIMEOUT)


def test_one_f_one_b_order_and_in_flight():
    from minipar.parallel.pipeline import build, validate
    from minipar.parallel.pipeline.schedules import B, F, _one_f_one_b
    assert _one_f_one_b(4, 6, 1) == [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (F, 4),
                                     (B, 2), (F, 5), (B, 3), (B, 4), (B, 5)]
    assert _one_f_one_b(4, 2, 0) == [(F, 0), (F, 1), (B, 0), (B, 1)]
    assert _one_f_one_b(4, 6, 3) == [pair for k in range(6) for pair in ((F, k), (B, k))]
    validate(build("1f1b", 4, 8))


def test_rank_grid_coords_and_rank_are_inverse():
    from minipar.parallel.groups import RankGrid
    grid = RankGrid(16, tp=2, pp=2)
    assert grid.coords(0) == {"tp": 0, "dp": 0, "pp": 0}
    assert grid.coords(5) == {"tp": 1, "dp": 2, "pp": 0}
    assert grid.coords(13) == {"tp": 1, "dp": 2, "pp": 1}
    assert all(grid.rank(**grid.coords(r)) == r for r in range(16))
    other = RankGrid(8, tp=2, pp=2, order="pp-tp-dp")
    assert other.coords(5) == {"pp": 1, "tp": 0, "dp": 1}
    with pytest.raises(ValueError):
        grid.coords(16)
