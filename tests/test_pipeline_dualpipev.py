"""DualPipeV as data: torch's per-rank order, valid, simulated, and equal to serial training.

The schedule: the same per-rank order as torch.distributed.pipelining's ScheduleDualPipeV
(its F&B pairs, whole and split backwards, deferred W's), the micro-batch rule m >= 2p, each
pair's receives before it and its sends after it, and a simulated bubble equal to theory.py's
and to DualPipe's README formula (PP/2-1)(F&B + B - 3W), beside 1F1B, ZB-H1 and ZB-V, its
peak activations the README's PP+1. The runtime: dualpipev on 2 and 4 ranks equals the serial
model (float64, 1e-10).
"""
from collections import Counter

import pytest

from minipar.parallel.pipeline import (ScheduleError, bubble_fraction, bubble_theory, build, makespan,
                                       peak_inflight, simulate, text_gantt, validate)
from minipar.parallel.pipeline.actions import B, BW, COMPUTE, F, FB, RECVS, SENDS, W
from minipar.parallel.pipeline.schedules import ArgumentError
from minipar.testing import run_on_ranks


def step(a):
    """(kind, stage, mb), or for an F&B pair (F&B, its F's step, its B's step)."""
    if a.kind == FB:
        return (FB,) + tuple(step(part) for part in a.pair)
    return (a.kind, a.stage, a.mb)


def compute_order(schedule):
    return [[step(a) for a in acts if a.kind in COMPUTE] for acts in schedule.actions]


def torch_order(p, m):
    """torch's per-rank order, read from ScheduleDualPipeV's own planning method (building the
    class needs a process group and stages): its FULL_BACKWARD is minipar's BW, BACKWARD_INPUT
    minipar's B, OVERLAP_F_B minipar's F&B with the same two sub-actions."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {schedules.FORWARD: F, schedules.BACKWARD_INPUT: B, schedules.BACKWARD_WEIGHT: W,
             schedules.FULL_BACKWARD: BW}

    def theirs(a):
        if a.computation_type == schedules.OVERLAP_F_B:
            return (FB,) + tuple(theirs(sub) for sub in a.sub_actions)
        return (kinds[a.computation_type], a.stage_index, a.microbatch_index)

    plan = object.__new__(schedules.ScheduleDualPipeV)
    plan.pp_group_size, plan._n_microbatches = p, m
    return [[theirs(a) for a in plan._calculate_single_rank_operations(r) if a is not None]
            for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 4), (2, 5), (2, 8), (4, 8), (4, 9), (4, 16)])
def test_per_rank_order_equals_torchs(p, m):
    assert compute_order(build("dualpipev", p, m)) == torch_order(p, m)  # rank by rank


def test_torchs_order_for_every_size_it_builds():
    for p in range(1, 7):
        for m in range(2 * p, 2 * p + 10):
            assert compute_order(build("dualpipev", p, m)) == torch_order(p, m), (p, m)


def passes(schedule):
    """Each computation once, a pair as its two halves: [(kind, stage, mb)] over all ranks."""
    return [part for acts in schedule.actions for a in acts for part in a.parts if a.kind in COMPUTE]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_valid_complete_and_in_a_v(p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        s = validate(build("dualpipev", p, m))
        assert (s.chunks, s.placement, s.split_backward) == (2, "v", True)
        assert [s.stages_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]
        counts = Counter((a.kind, a.stage, a.mb) for a in passes(s))
        for stage in range(2 * p):
            for mb in range(m):
                # one F, and one backward: whole (BW), or split into a B and its deferred W
                whole, split = counts[(BW, stage, mb)], counts[(B, stage, mb)]
                assert (counts[(F, stage, mb)], whole + split, counts[(W, stage, mb)]) == (1, 1, split)
        pairs = [a for acts in s.actions for a in acts if a.kind == FB]
        assert pairs and all([x.kind for x in a.pair] == [F, BW] for a in pairs)


def test_a_pairs_messages_come_before_and_after_it():
    s = build("dualpipev", 4, 8)
    for acts in s.actions:
        for i, a in enumerate(acts):
            if a.kind != FB:
                continue
            f, b = a.pair
            before, after = [], []
            for j in range(i - 1, -1, -1):  # the receives just before, the sends just after
                if acts[j].kind not in RECVS:
                    break
                before.insert(0, (acts[j].kind, acts[j].stage, acts[j].mb))
            for later in acts[i + 1:]:
                if later.kind not in SENDS:
                    break
                after.append((later.kind, later.stage, later.mb))
            wanted_before = [("RECV_F", f.stage, f.mb)] * (f.stage not in (0, 4)) + \
                            [("RECV_B", b.stage, b.mb)] * (b.stage not in (7, 3))
            wanted_after = [("SEND_F", f.stage, f.mb)] * (f.stage not in (3, 7)) + \
                           [("SEND_B", b.stage, b.mb)] * (b.stage not in (0, 4))
            assert (before, after) == (wanted_before, wanted_after)


def test_refusals_name_the_rule():
    with pytest.raises(ArgumentError, match="at least as many micro-batches as stages"):
        build("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="dualpipev holds exactly two chunks"):
        build("dualpipev", 2, 4, v=3)
    s = build("dualpipev", 2, 4)  # a deferred W left out: the validator names it
    s.actions[0] = [a for a in s.actions[0] if not (a.kind == W and a.stage == 0 and a.mb == 3)]
    with pytest.raises(ScheduleError, match=r"W\(stage 0, mb 3\) appears 0 times"):
        validate(s)


# --- the bubble: simulated, theory.py, DualPipe's README, the other schedules -----------------

def idle_per_rank(events, p):
    """Each rank's idle time (makespan - its work), in units of a whole stage's forward."""
    work = [0.0] * p
    for e in events:
        if e.kind in (F, B, W, BW):
            work[e.rank] += e.duration
    return [makespan(events) - w for w in work]


def readme_idle(p):
    """DualPipe's README bubble (PP/2-1)(F&B + B - 3W) in minipar's unit costs. PP = 2p stages
    (chunks) of 1/2 a stage each: F = 1/2, B (a whole backward, B + W) = 1, W = 1/2, and F&B =
    F + B = 3/2, since minipar runs a pair's halves one after the other (no overlap): p - 1.
    Its rows for 1F1B, (PP-1)(F+B), and ZB1P, (PP-1)(F+B-2W), with PP = p, F = 1, B = 2, W = 1,
    give 3(p-1) and p-1."""
    pp, f, b, w = 2 * p, 0.5, 1.0, 0.5
    return (pp / 2 - 1) * ((f + b) + b - 3 * w)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16), (6, 12)])
def test_simulated_bubble_equals_theory_readme_and_sits_beside_the_others(p, m):
    s = build("dualpipev", p, m)
    events = simulate(s)
    _, num, den = bubble_theory(s)
    assert (num, den) == (p - 1, 3 * m + p - 1)
    assert bubble_fraction(events, p) == pytest.approx(num / den, abs=1e-12)
    assert idle_per_rank(events, p) == pytest.approx([readme_idle(p)] * p, abs=1e-12)
    others = {name: simulate(build(name, p, m)) for name in ("1f1b", "zb-h1", "zb-v")}
    idle = {name: makespan(ev) - 3 * m for name, ev in others.items()}
    assert idle["1f1b"] == pytest.approx(3 * (p - 1))  # README: (PP-1)(F+B)
    assert idle["zb-h1"] == pytest.approx(p - 1)       # README: (PP-1)(F+B-2W)
    assert idle["zb-v"] == pytest.approx((p - 1) / 2)
    # with F&B = F + B, DualPipeV idles as ZB-H1 does: what it saves is the overlap of a
    # pair's halves (communication hidden under compute), which these costs do not model
    assert makespan(events) - 3 * m == pytest.approx(idle["zb-h1"])
    rows = [("dualpipev", events)] + list(others.items())
    print(f"\np={p} m={m}: README (PP/2-1)(F&B+B-3W) = {readme_idle(p):g} idle per rank")
    for name, ev in rows:
        print(f"  {name:10s} bubble {bubble_fraction(ev, p):.4f}  idle/rank {makespan(ev) - 3 * m:g}")


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16), (6, 12)])
def test_peak_activations_are_the_readmes_pp_plus_one(p, m):
    # the README's activation column: DualPipeV PP+1 chunk micro-batches per rank, one more
    # than ZB-V's PP (= 2p), on every rank
    assert peak_inflight(simulate(build("dualpipev", p, m)), p) == [2 * p + 1] * p
    assert peak_inflight(simulate(build("zb-v", p, m)), p) == [2 * p] * p


def test_the_gantt_shows_pairs_as_their_halves():
    chart = text_gantt(simulate(build("dualpipev", 2, 4)), legend=True)
    assert "BW" in chart and "BW backward with its weight gradient" in chart
    assert chart.count("\nrank 1 ") == 1


# --- the runtime against its serial twin, on 2 and 4 ranks -----------------------------------

def dualpipev_equivalence(p):
    """p ranks: dualpipev for m in {2p, 2p+1} (and 8 on 2 ranks: unequal micro-batches of the 11
    samples), MLPs (one with an op that reads its weight only in backward); on 2 ranks a GPT."""
    from test_pipeline_runtime import gpt_and_resnet_models, mlp, run_sync_cases

    from minipar import comm

    world = comm.world()
    cases = [("dualpipev", {})]
    ms = [2 * p, 2 * p + 1] + ([8] if p == 2 else [])
    problems = run_sync_cases(world, p, ms, schedules=cases)
    problems += run_sync_cases(world, p, [2 * p], make_model=lambda seed: mlp(seed, scaled=True),
                               schedules=cases)
    if p == 2:
        make, batch, loss = gpt_and_resnet_models()[0]
        problems += run_sync_cases(world, 2, [4], make, batch, loss, cases)
    return problems


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 4])
def test_dualpipev_equals_serial(p):
    from test_pipeline_runtime import assert_none

    assert_none(run_on_ranks(dualpipev_equivalence, p, timeout=240, args=(p,)))
