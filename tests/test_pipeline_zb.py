"""Zero-bubble pipelines: ZB-V and interleaved zero bubble as data, and the split backward.

The schedules: the same per-rank order as torch.distributed.pipelining's ScheduleZBVZeroBubble
and ScheduleInterleavedZeroBubble (so, with F = B = W, the same makespan), valid, and their
simulated bubble equal to theory.py's formula. The split backward (graph.WeightPass): B computes
every gradient but the weights', W only the weights', each gradient function called once, and
the two together give a whole backward's numbers. The runtime: zb-v, zb-interleaved and zb-h1
on 1 to 4 ranks equal the serial model (float64, 1e-10).
"""
import numpy as np
import pytest

from minipar.parallel.pipeline import (ScheduleError, bubble_fraction, bubble_theory, build, makespan,
                                       peak_inflight, simulate, validate)
from minipar.parallel.pipeline.actions import (B, COMPUTE, F, RECVS, SENDS, W, assemble)
from minipar.testing import run_on_ranks


def compute_order(schedule):
    return [[(a.kind, a.stage, a.mb) for a in acts if a.kind in COMPUTE] for acts in schedule.actions]


def torch_order(name, p, m):
    """torch's per-rank order of (kind, stage, mb), read from the schedule classes' own planning
    method (building the classes needs a process group), or None where torch refuses m."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {schedules._ComputationType.FORWARD: F, schedules._ComputationType.BACKWARD_INPUT: B,
             schedules._ComputationType.BACKWARD_WEIGHT: W}
    if name == "zb-v":
        plan = object.__new__(schedules.ScheduleZBVZeroBubble)
        plan.num_stages = 2 * p
    else:
        plan = object.__new__(schedules.ScheduleInterleavedZeroBubble)
        plan.n_local_stages = 2
        plan.number_of_rounds = max(1, m // p)  # as its __init__ does, which refuses the rest
        if m % plan.number_of_rounds:
            return None
        plan.microbatches_per_round = m // plan.number_of_rounds
    plan.pp_group_size, plan._n_microbatches = p, m
    return [[(kinds[a.computation_type], a.stage_index, a.microbatch_index)
             for a in plan._calculate_single_rank_operations(r) if a is not None] for r in range(p)]


@pytest.mark.parametrize("name", ["zb-v", "zb-interleaved"])
def test_p4_m8_has_torchs_order_and_makespan(name):
    ours = build(name, 4, 8)
    theirs = torch_order(name, 4, 8)
    assert compute_order(ours) == theirs  # exactly, rank by rank
    replayed = assemble("torch", 4, 8, 2, theirs, split_backward=True, placement=ours.placement)
    # F = B = W = 1 per chunk: makespan 51 chunk steps (25.5 stage forwards), bubble 3/51
    assert makespan(simulate(ours)) == makespan(simulate(validate(replayed))) == 25.5
    assert bubble_theory(ours)[1:] == (3, 51)


@pytest.mark.parametrize("name", ["zb-v", "zb-interleaved"])
def test_torchs_order_for_every_size_it_builds(name):
    for p in range(1, 7):
        for m in range(1, 17):
            theirs = torch_order(name, p, m)
            if theirs is None:
                with pytest.raises(ValueError, match="rounds of equal size"):
                    build(name, p, m)
            else:
                assert compute_order(build(name, p, m)) == theirs, (p, m)


def test_zb_v_places_the_stages_in_a_v():
    p = 4
    s = validate(build("zb-v", p, 8))
    assert [s.stages_of(r) for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert {a.chunk for a in s.actions[0] if a.stage == 7} == {1}
    messages = [a for acts in s.actions for a in acts if a.kind in SENDS + RECVS]
    # stage 3 hands over to stage 4 on rank 3 itself; every other hop is a message
    assert not any({a.stage, a.peer} == {3} or (a.stage in (3, 4) and a.peer == 3) for a in messages)
    assert sum(a.kind == "SEND_F" for a in messages) == (2 * p - 2) * 8
    with pytest.raises(ValueError, match="zb-v holds exactly two chunks"):
        build("zb-v", p, 8, v=3)


def test_interleaved_zero_bubble_with_one_chunk_is_zb_h1():
    for p in range(1, 6):
        for m in range(1, 11):
            assert compute_order(build("zb-interleaved", p, m, v=1)) == compute_order(build("zb-h1", p, m))


@pytest.mark.parametrize("name,chunks", [("zb-v", (2,)), ("zb-interleaved", (1, 2, 3, 4))])
def test_simulated_bubble_equals_theory(name, chunks):
    for v in chunks:
        for p in range(1, 7):
            for m in range(1, 15):
                try:
                    s = validate(build(name, p, m, v))
                except ValueError as err:
                    assert "rounds of equal size" in str(err)
                    continue
                _, num, den = bubble_theory(s)
                assert bubble_fraction(simulate(s), p) == pytest.approx(num / den, abs=1e-12), (v, p, m)
                if m >= p and name == "zb-interleaved":
                    assert (num, den) == (p - 1, 3 * v * m + p - 1)  # ZB-H1's idle over v


def test_zb_v_halves_zb_h1s_idle_time_at_the_same_peak_memory():
    for p, m in [(2, 4), (4, 8), (4, 16), (5, 10)]:
        v, h1 = (simulate(build(name, p, m)) for name in ("zb-v", "zb-h1"))
        assert makespan(v) - 3 * m == pytest.approx((makespan(h1) - 3 * m) / 2)
        assert peak_inflight(v, p) == [2 * p] * p  # chunk micro-batches: p whole stages' worth
        assert peak_inflight(simulate(build("zb-interleaved", p, m)), p) == [2 * p - r for r in range(p)]


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="m=9 must be a multiple of 2"):
        build("zb-interleaved", 4, 9)
    with pytest.raises(ValueError, match="at least 1"):
        build("zb-v", 0, 4)
    s = build("zb-v", 2, 2)
    s.actions[0] = [a for a in s.actions[0] if a.kind != W or a.mb]
    with pytest.raises(ScheduleError, match=r"W\(stage 0, mb 0\) appears 0 times"):
        validate(s)


def test_minipar_schedule_draws_them_and_names_bad_chunks(capsys, monkeypatch):
    from minipar.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "3/51 = 0.0588, simulated 0.0588" in out.replace("\n  ", " ")
    assert "peak in-flight micro-batch chunks (each 1/2) per rank: 8 8 8 8" in out
    for args, text in [(["zb-v", "--chunks", "3"], "zb-v holds exactly two chunks per rank"),
                       (["zb-h1", "--chunks", "2"], "only the interleaved schedules"),
                       (["zb-interleaved", "--microbatches", "9"], "m=9 must be a multiple of 2")]:
        with pytest.raises(SystemExit) as exit_:
            main(["schedule", "--schedule", *args, "--stages", "4"]
                 + ([] if "--microbatches" in args else ["--microbatches", "8"]))
        assert exit_.value.code == 2 and text in capsys.readouterr().err


# --- the split backward, in one process -------------------------------------------------------

def device(a):
    from minipar import backend

    return backend.xp().asarray(a)


def host(a):
    from minipar import backend

    return backend.to_numpy(a)


def _mlp(conv=False):
    import minipar
    from minipar import nn

    minipar.manual_seed(3)
    if conv:
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3)).double()
    return nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 4), nn.ReLU(),
                         nn.Linear(4, 3)).double()


def _split(model, x, dy):
    from minipar import Tensor
    from minipar.graph import WeightPass, run_backward

    xt = Tensor(x, requires_grad=True)
    weights = WeightPass(model.parameters())
    run_backward([model(xt)], [dy], defer=weights)
    return xt, weights


@pytest.mark.parametrize("conv", [False, True])
def test_b_then_w_equals_one_backward(conv):
    from minipar import Tensor

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 5, 5) if conv else (4, 5))
    full = _mlp(conv)
    xt = Tensor(x, requires_grad=True)
    y = full(xt)
    dy = device(rng.standard_normal(y.shape))
    y.backward(dy)
    split = _mlp(conv)
    xs, weights = _split(split, x, dy)
    assert np.array_equal(host(xs.grad), host(xt.grad))  # B: the input gradient, final
    assert all(q.grad is None for q in split.parameters())  # ... and no weight gradient yet
    # convolutions and Linears split (W calls their weight functions), LayerNorm's are held
    assert (len(weights.work), len(weights.held)) == ((2, 0) if conv else (3, 2))
    weights.run()
    for q, ref in zip(split.parameters(), full.parameters()):
        assert np.allclose(host(q.grad), host(ref.grad), rtol=0, atol=1e-14)
    assert not weights.work and not weights.held


@pytest.mark.parametrize("conv", [False, True])
def test_w_leaves_frozen_weights_without_a_gradient(conv):
    """A weight with requires_grad=False gets no gradient from W, as from a whole backward."""
    from minipar import Tensor

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, 5, 5) if conv else (4, 5))
    model = _mlp(conv)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    y = model(Tensor(x))
    _, weights = _split(model, x, device(rng.standard_normal(y.shape)))
    weights.run()
    assert frozen.grad is None
    assert all(q.grad is not None for q in model.parameters() if q.requires_grad)


def test_b_calls_only_input_gradients_and_w_only_weight_gradients():
    """A spy op through ``apply``: which of its two gradient functions each pass calls."""
    from minipar import Tensor, nn
    from minipar.autograd import apply
    from minipar.graph import WeightPass, run_backward

    calls = []

    def spy_mul(x, w):
        return x * w, (lambda g: calls.append("dx") or g * w, lambda g: calls.append("dw") or g * x)

    w = nn.Parameter(np.full(3, 2.0))
    x = Tensor(np.ones(3), requires_grad=True)
    h = apply(spy_mul, x, w)
    y = apply(spy_mul, h.tanh(), w)
    hooked = []
    w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.copy()))
    weights = WeightPass([w])
    run_backward([y], [device(np.ones(3))], defer=weights)
    assert calls == ["dx", "dx"] and w.grad is None and not hooked
    weights.run()
    assert calls == ["dx", "dx", "dw", "dw"]
    assert len(hooked) == 1 and np.array_equal(host(hooked[0]), host(w.grad))  # once, with the whole sum


@pytest.mark.parametrize("split", ["only", None])
def test_b_splits_a_node_whose_op_declared_it(split):
    """The op's declaration (``make_result(..., split="only")``) is what lets B leave a weight's
    gradient for W: the same ``backward(g, only)`` undeclared runs whole, its gradient held."""
    from minipar import Tensor, nn
    from minipar.autograd import make_result
    from minipar.graph import WeightPass, run_backward

    w = nn.Parameter(np.full(3, 2.0))
    x = Tensor(np.arange(3.0), requires_grad=True)

    def backward(g, only=(True, True)):
        return [g * w.data if only[0] else None, g * x.data if only[1] else None]

    y = make_result(x.data * w.data, (x, w), backward, "scale", split=split)
    weights = WeightPass([w])
    run_backward([y], [device(np.ones(3))], defer=weights)
    assert w.grad is None and np.array_equal(host(x.grad), [2.0, 2.0, 2.0])
    assert (len(weights.work), len(weights.held)) == ((1, 0) if split else (0, 1))
    weights.run()
    assert np.array_equal(host(w.grad), [0.0, 1.0, 2.0])


def test_b_frees_what_w_does_not_need():
    from minipar import Tensor
    from minipar.graph import WeightPass, run_backward

    model = _mlp()
    h = model[0](Tensor(np.ones((2, 5)), requires_grad=True))  # Linear: feeds a weight
    a = model[1](h)                                              # GELU: feeds none
    y = model[2:](a)
    weights = WeightPass(model.parameters())
    run_backward([y], [device(np.ones(y.shape))], defer=weights)
    assert [node._op for node, _, _ in weights.work] == ["linear"] * 3  # Linear: split
    assert set(weights.held) == {id(model[2].weight), id(model[2].bias)}  # LayerNorm: all in B
    assert a._parents == () and h._parents != ()  # GELU freed by B, the Linear kept for W
    weights.run()
    assert h._parents == () and y._parents == ()  # and freed by W


def test_checkpointed_segment_defers_its_weights_too():
    from minipar import Tensor
    from minipar.checkpoint import checkpoint
    from minipar.graph import WeightPass, run_backward

    model = _mlp()
    x = np.random.default_rng(1).standard_normal((3, 5))
    ref = _mlp()
    ref(Tensor(x)).sum().backward()
    weights = WeightPass(model.parameters())
    y = checkpoint(model, Tensor(x))
    run_backward([y], [device(np.ones(y.shape))], defer=weights)
    assert all(q.grad is None for q in model.parameters())
    weights.run()
    for q, r in zip(model.parameters(), ref.parameters()):
        assert np.allclose(host(q.grad), host(r.grad), rtol=0, atol=1e-14)


# --- the runtime against its serial twin, on 1 to 4 ranks ------------------------------------

ZB = [("zb-v", {}), ("zb-interleaved", {}), ("zb-interleaved", {"v": 3}), ("zb-h1", {})]


def zb_equivalence(p):
    """p ranks: the zero-bubble schedules, m in {1, p-1, p, 2p}, MLPs (one with an op that reads
    its weight only in backward); on 2 ranks also p = 1 per rank, a GPT and a ResNet."""
    from test_pipeline_runtime import gpt_and_resnet_models, mlp, run_sync_cases

    from minipar import comm

    world = comm.world()
    ms = sorted({1, max(1, p - 1), p, 2 * p})
    cases = ZB if p < 4 else ZB[:2] + ZB[3:]  # 3 chunks of 4 ranks: 12 stages of the 16 layers
    problems = run_sync_cases(world, p, ms, schedules=cases)
    problems += run_sync_cases(world, p, [p], make_model=lambda seed: mlp(seed, scaled=True),
                               schedules=cases)
    if p == 2:
        alone = world.split(color=world.rank)
        problems += run_sync_cases(alone, 1, [1, 3], schedules=ZB)
        for make, batch, loss in gpt_and_resnet_models():
            problems += run_sync_cases(world, 2, [2, 4], make, batch, loss, ZB[:2])
    return problems


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_bubble_schedules_equal_serial(p):
    from test_pipeline_runtime import assert_none

    assert_none(run_on_ranks(zb_equivalence, p, timeout=240, args=(p,)))
