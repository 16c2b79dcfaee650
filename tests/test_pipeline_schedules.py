"""Every pipeline schedule is valid, complete, and its simulated bubble and memory match theory."""
from collections import Counter
from fractions import Fraction

import pytest

from minipar.parallel.pipeline import (BUILDERS, bubble_fraction, bubble_theory, build, peak_inflight,
                                       simulate, validate)
from minipar.parallel.pipeline.actions import (B, BW, F, FB, OPT_STEP, RECVS, SENDS, W, message_key,
                                               message_tag, weight_versions)
from minipar.parallel.pipeline.schedules import ArgumentError

# the schedules whose B is the input gradient only, its W a pass of its own (zero bubble);
# dualpipev also runs whole backwards, BW (a B and its W in one pass), alone or in an F&B pair
SPLIT_BACKWARD = ("zb-h1", "zb-v", "zb-interleaved", "dualpipev")


def refused(name, p, m):
    """Sizes a builder refuses by design: interleaved 1F1B needs p | m, interleaved zero bubble
    (as torch's) m a multiple of its number of rounds max(1, m // p), DualPipeV (as torch's)
    at least as many micro-batches as stages, m >= 2p."""
    return ((name == "interleaved" and m % p) or (name == "zb-interleaved" and m % max(1, m // p))
            or (name == "dualpipev" and m < 2 * p))


def grid():
    for p in (1, 2, 3, 4):
        for m in sorted({1, max(1, p - 1), p, 2 * p, 2 * p + 1}):
            for name in BUILDERS:
                yield name, p, m


def passes(s):
    """Every computation of ``s`` as (kind, stage, mb), an F&B pair counted as its two halves."""
    return Counter((part.kind, part.stage, part.mb) for acts in s.actions for a in acts
                   for part in a.parts)


def test_the_grid_builds_every_schedule_and_dualpipev_only_from_m_2p():
    cases = list(grid())
    assert {name for name, _, _ in cases} == set(BUILDERS) >= {"dualpipev", *SPLIT_BACKWARD}
    built = {(name, p, m) for name, p, m in cases if not refused(name, p, m)}
    assert {(p, m) for name, p, m in built if name == "dualpipev"} == \
        {(p, m) for _, p, m in cases if m >= 2 * p}
    assert {name for name, _, _ in built} == set(BUILDERS)  # each one is built somewhere


@pytest.mark.parametrize("name,p,m", list(grid()))
def test_every_schedule_is_valid_and_complete(name, p, m):
    if refused(name, p, m):  # refused by name and rule, before anything is built
        with pytest.raises(ArgumentError if name != "zb-interleaved" else ValueError):
            build(name, p, m)
        return
    s = validate(build(name, p, m))
    counts = passes(s)
    assert s.split_backward == (name in SPLIT_BACKWARD)
    for stage in range(s.n_stages):
        for mb in range(m):
            if s.split_backward:  # a W of its own after a B, or both in one BW; never both
                done = ([counts[(F, stage, mb)], counts[(B, stage, mb)], counts[(W, stage, mb)]],
                        counts[(BW, stage, mb)])
                assert done in (([1, 1, 1], 0), ([1, 0, 0], 1)), (stage, mb, done)
            else:
                assert [counts[(k, stage, mb)] for k in (F, B)] == [1, 1]
    if not s.split_backward:
        assert not any(kind == W for kind, _, _ in counts)
    if name != "dualpipev":  # only DualPipeV runs whole backwards and F&B pairs
        assert not any(kind in (BW, FB) for kind, _, _ in counts)
        assert not any(a.kind == FB for acts in s.actions for a in acts)
    opt = [sum(a.kind == OPT_STEP for a in acts) for acts in s.actions]
    assert opt == ([m] * p if name == "pipedream" else [1] * p)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_simulated_bubble_equals_theory_on_a_grid(name):
    sizes = 0
    for p in range(1, 6):
        for m in range(1, 11):
            if refused(name, p, m):
                continue
            sizes += 1
            s = build(name, p, m)
            _, num, den = bubble_theory(s)
            assert bubble_fraction(simulate(s), p) == pytest.approx(num / den, abs=1e-9), (p, m)
    assert sizes >= 20  # of the 50 sizes: interleaved (p | m) 22, dualpipev (m >= 2p) 25


ISSUE_FIGURES = [("gpipe", None, Fraction(3, 11)), ("1f1b", None, Fraction(3, 11)),
                 ("interleaved", 2, Fraction(3, 19)), ("zb-h1", None, Fraction(3, 27)),
                 ("naive", None, Fraction(3, 4)), ("pipedream", None, Fraction(3, 11)),
                 ("dualpipev", None, Fraction(3, 27))]


@pytest.mark.parametrize("name,v,expected", ISSUE_FIGURES)
def test_issue_figures_for_p4_m8(name, v, expected):
    s = build(name, 4, 8, v)
    _, num, den = bubble_theory(s)
    assert Fraction(num, den) == expected
    assert bubble_fraction(simulate(s), 4) == pytest.approx(float(expected), abs=1e-12)


def test_remat_gpipe_bubble_and_memory():
    for p, m in [(2, 3), (4, 8), (3, 1)]:
        s = validate(build("gpipe", p, m, remat=True))
        _, num, den = bubble_theory(s)
        events = simulate(s)
        assert bubble_fraction(events, p) == pytest.approx(num / den)
        assert peak_inflight(events, p) == [1] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7), (4, 2)])
def test_peak_inflight_gpipe_m_and_1f1b_p_minus_r(p, m):
    assert peak_inflight(simulate(build("gpipe", p, m)), p) == [m] * p
    for name in ("1f1b", "zb-h1", "pipedream"):
        assert peak_inflight(simulate(build(name, p, m)), p) == [min(p - r, m) for r in range(p)]


def test_interleaved_needs_m_multiple_of_p_and_chunks_only_there():
    with pytest.raises(ValueError, match="multiple of p=4"):
        build("interleaved", 4, 6)
    with pytest.raises(ValueError, match="only the interleaved"):
        build("1f1b", 4, 8, v=2)
    with pytest.raises(ValueError, match="zb-v holds exactly two chunks"):
        build("zb-v", 4, 8, v=3)
    with pytest.raises(ValueError, match="unknown schedule 'dualpipe': choose one of .*dualpipev"):
        build("dualpipe", 4, 8)
    with pytest.raises(ArgumentError, match=r"m >= 2p .*try m=8"):
        build("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="at least 1"):
        build("gpipe", 0, 8)
    s = validate(build("interleaved", 4, 8, v=2))
    assert {a.stage % 4 for a in s.actions[1] if a.stage >= 0} == {1}
    assert {a.chunk for a in s.actions[1] if a.kind == F} == {0, 1}


def test_interleaved_on_one_rank_hands_chunks_over_locally():
    s = validate(build("interleaved", 1, 3, v=3))
    assert not any(a.kind in SENDS or a.kind in RECVS for a in s.actions[0])


def test_pipedream_weight_stashing_versions():
    p, m = 4, 8
    s = validate(build("pipedream", p, m))
    versions = weight_versions(s)
    for (stage, mb), (fwd, bwd) in versions.items():
        assert fwd == bwd == max(0, mb - (p - 1 - stage))  # backward uses the stashed weights
    for r, acts in enumerate(s.actions):  # each OPT_STEP produces the next version, in order
        steps = [a.version for a in acts if a.kind == OPT_STEP]
        assert steps == list(range(1, m + 1))


def test_message_tags_pair_sends_with_receives_and_are_unique():
    s = build("interleaved", 4, 8)
    sends = [a for acts in s.actions for a in acts if a.kind in SENDS]
    recvs = [a for acts in s.actions for a in acts if a.kind in RECVS]
    tags = [sorted(message_tag(a, s.n_stages) for a in side) for side in (sends, recvs)]
    assert tags[0] == tags[1]
    assert len({message_tag(a, s.n_stages) for a in sends}) == len(sends)
    assert {message_key(a) for a in sends} == {message_key(a) for a in recvs}


def test_simulator_takes_costs_and_latency():
    s = build("1f1b", 2, 2)
    slow = simulate(s, cost=lambda a: {F: 1.0, B: 2.0}.get(a.kind, 0.0), latency=lambda a: 0.5)
    fast = simulate(s)
    assert max(e.end for e in slow) == max(e.end for e in fast) + 2 * 0.5  # two hops on the path
    assert {e.kind for e in slow} >= {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "OPT_STEP"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
def test_stages_of_equal_cost_simulate_as_the_textbook_units(name):
    from minipar.parallel.pipeline import cost_by_stage, makespan, unit_cost
    s = build(name, 2, 4, 2 if name == "interleaved" else None)
    # a stage of cost v (F : B : W = 1 : 1 : 1) is unit_cost's rank of 1 per pass, split in v
    equal = simulate(s, cost_by_stage(s, [3 / s.chunks] * s.n_stages))
    assert makespan(equal) == pytest.approx(makespan(simulate(s, unit_cost(s))))


def test_a_dearer_stage_holds_up_the_pipeline():
    from minipar.parallel.pipeline import cost_by_stage, makespan
    s = build("gpipe", 2, 1)
    # one micro-batch goes down and back: every pass in turn, the two stages' costs added
    assert makespan(simulate(s, cost_by_stage(s, [3.0, 1.0]))) == pytest.approx(4.0)
    # 1F1B's steady state runs at the dearer stage's pace: 4 more micro-batches add 4 x 3
    few, many = (makespan(simulate(build("1f1b", 2, m), cost_by_stage(build("1f1b", 2, m),
                                                                      [3.0, 1.0])))
                 for m in (4, 8))
    assert many - few == pytest.approx(4 * 3.0)
