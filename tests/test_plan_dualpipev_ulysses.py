"""The planner prices DualPipeV (``--schedule dualpipev``) and Ulysses (``--cp-comm a2a``): the
bubble is the schedule's simulated bubble, the activations follow its 2p+1 in-flight chunk
micro-batches (F&B and BW read as the runtime runs them), the all-to-alls' bytes are the
trainer's formula exactly, and each refusal names its flag with exit 2. No MPI job."""
import json

import pytest

from minipar.comm import cost
from minipar.parallel.pipeline import build, makespan, peak_inflight, simulate, unit_cost
from minipar.plan import GPTShape, megatron_activation_bytes
from minipar.plan.activations import layout_activation_bytes, walk
from minipar.plan.hardware import PROFILES
from minipar.plan.search import LayoutError, check, search
from minipar.plan.time import Cluster, Layout, cp_bytes, pipeline_shape, predict
from test_plan_cli import FULL, GPT3, H100, run
from test_ulysses_trainer import attention_bytes


# --- DualPipeV ------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("passes", [3, 4])
def test_dualpipev_bubble_is_the_simulated_bubble_at_any_m(p, passes):
    u = 1 / passes
    for m in (2 * p, 3 * p + 1, 6 * p):
        schedule = build("dualpipev", p, m)
        events = simulate(schedule, unit_cost(schedule, u, u * (passes - 2), u))
        bubble, inflight = pipeline_shape("dualpipev", p, m, 2, passes)
        assert bubble == pytest.approx(makespan(events) - m)
        # the DualPipe README's (p-1) stage passes of idle per rank, at F = B = W = 1/3
        if passes == 3:
            assert bubble == pytest.approx((p - 1) / 3)
        assert inflight == max(peak_inflight(events, p)) == 2 * p + 1


def test_dualpipev_priced_bubble_is_the_bubble_units_times_the_stage():
    from minipar.plan.kernels import optimizer_seconds
    from minipar.plan.time import rank_parameters
    layout = Layout(tp=8, pp=8, dp=16, zero=1, schedule="dualpipev")
    p = predict(GPT3, layout, H100, 1536)
    m = 1536 // 16
    units, _ = pipeline_shape("dualpipev", 8, m, 2, 3)
    # a GPU's compute is m micro-batches of the last stage, then Adam's step (not in a stage)
    step = optimizer_seconds(rank_parameters(GPT3, layout), "bf16", H100.profile)
    stage = (p["time_s"]["compute"] - step + p["time_s"]["tp"] + p["time_s"]["cp"]
             + p["time_s"]["ep"]) / m
    assert p["layout"]["v"] == 2 and p["layout"]["schedule"] == "dualpipev"
    assert p["time_s"]["bubble"] == pytest.approx(units * stage)
    assert units == pytest.approx(7 / 3)


@pytest.mark.parametrize("p", [2, 4])
def test_walk_reads_fb_and_bw(p):
    """With every stage storing one unit and nothing kept for W, the walk's peak is the
    in-flight count (2p+1); with a W share kept, a BW frees all of its stage (no W follows it),
    a B all but the kept bytes until its W: the walk equals a hand replay of the parts."""
    schedule = build("dualpipev", p, 2 * p)
    ones = {s: (1, 0, 0) for s in range(2 * p)}
    assert max(walk(schedule, r, ones) for r in range(p)) == 2 * p + 1
    kept = {s: (10, 0, 3) for s in range(2 * p)}
    for r in range(p):
        live = peak = 0
        for action in schedule.actions[r]:
            for part in action.parts:
                if part.kind == "F":
                    live += 10
                    peak = max(peak, live)
                elif part.kind == "B":
                    live -= 7
                elif part.kind == "BW":
                    live -= 10
                elif part.kind == "W":
                    live -= 3
        assert live == 0  # everything freed by the end of the step
        assert walk(schedule, r, kept) == peak


def test_dualpipev_activations_follow_the_in_flight_count():
    # Megatron's model: one chunk's layers x the 2p+1 chunk micro-batches in flight
    layout = Layout(tp=8, pp=8, dp=16, zero=1, schedule="dualpipev", activations="megatron")
    mem = predict(GPT3, layout, H100, 1536)["memory_bytes"]
    per_layer = megatron_activation_bytes(GPT3.seq, 1, GPT3.hidden, GPT3.heads, 8, True,
                                          "selective")
    assert mem["activations"] == pytest.approx(float(per_layer) * GPT3.layers / 16 * 17)
    # minipar's model: the walk over every rank, the same at 2p and 3p micro-batches (exact)
    small = GPTShape(8, 64, 4, 32, 128)
    at = {m: layout_activation_bytes(small, "fp32", 1, 1, 2, 2, 1, "none", m, "dualpipev")
          for m in (4, 6, 9)}
    assert at[4] == at[6] == at[9] > 0
    # the first rank holds the embedding and the head: 5 chunk micro-batches of the V at most
    schedule = build("dualpipev", 2, 4)
    assert max(peak_inflight(simulate(schedule), 2)) == 5


def test_dualpipev_fewer_than_2p_micro_batches_is_refused_by_its_flag(capsys):
    with pytest.raises(LayoutError, match="--schedule dualpipev"):
        check(GPT3, Layout(tp=8, pp=8, dp=16, zero=1, schedule="dualpipev"), H100, 128)
    code, out, err = run(FULL + ["--schedule", "dualpipev", "--global-batch", "128"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--schedule dualpipev" in err and "m = " in err and "8 < 2·8 = 16" in err


def test_cli_names_dualpipev(capsys):
    code, out, _ = run(FULL + ["--schedule", "dualpipev"], capsys)
    assert code == 0 and "dualpipev (v=2, m=96" in out
    code, out, _ = run(FULL + ["--schedule", "dualpipev", "--json"], capsys)
    result = json.loads(out)
    assert result["layout"]["schedule"] == "dualpipev" and result["time_s"]["bubble"] > 0


# --- Ulysses --------------------------------------------------------------------------------

@pytest.mark.parametrize("cp, tp, rows", [(2, 1, 2), (2, 2, 2), (4, 1, 3), (4, 2, 1)])
def test_a2a_bytes_are_the_trainers_formula_exactly(cp, tp, rows):
    """The planner's bytes for one micro-batch equal tests/test_ulysses_trainer.py's formula,
    which the communicator's counters match on 2 and 4 ranks (float64: width 8)."""
    from test_context_gpt import T
    shape = GPTShape(2, 16, 4, T, 16)
    layout = Layout(tp=tp, cp=cp, dp=1, micro_batch=rows, cp_comm="a2a", precision="fp32")
    heads, head_dim = 4 // tp, 16 // 4
    assert cp_bytes(shape, layout, 8) == attention_bytes(2, rows, cp, heads, head_dim)
    # a recomputed forward runs its 4 all-to-alls again
    assert cp_bytes(shape, layout, 8, passes=4) * 2 == attention_bytes(2, rows, cp, heads,
                                                                       head_dim) * 3


def test_a2a_time_is_the_all_to_alls_priced_by_comm_cost():
    layout = Layout(tp=8, pp=8, dp=8, cp=2, zero=1, cp_comm="a2a")
    p = predict(GPT3, layout, H100, 1536)
    m = 1536 // 8
    block = 1 * (GPT3.seq // 2) * (GPT3.hidden // 8) * 2  # b x s/cp x h/tp, bf16
    # the cp group (ranks 0 and 8 with tp = 8) spans nodes: the inter-node link
    one = cost.predict("all_to_all", "pairwise", 2, block, PROFILES["h100"].link(False))
    assert p["time_s"]["cp"] == pytest.approx(m * 4 * 2 * one * GPT3.layers / 8)
    assert p["bytes_sent"]["cp"] == m * 4 * 2 * (block // 2) * GPT3.layers // 8
    ring = predict(GPT3, Layout(tp=8, pp=8, dp=8, cp=2, zero=1), H100, 1536)
    assert ring["layout"]["cp_comm"] == "ring"
    kv = 2 * GPT3.seq * GPT3.kv * (GPT3.hidden // GPT3.heads) // 8 * 2
    assert ring["bytes_sent"]["cp"] == m * 3 * (kv // 2) * GPT3.layers // 8
    assert p["bytes_sent"]["cp"] < ring["bytes_sent"]["cp"]


def test_a2a_heads_not_divisible_by_tp_cp_is_refused_with_the_numbers(capsys):
    with pytest.raises(LayoutError, match="tp·cp = 8·16 = 128 does not divide heads=96"):
        check(GPT3, Layout(tp=8, pp=8, dp=1, cp=16, zero=1, cp_comm="a2a"), H100, 1536)
    code, out, err = run(FULL + ["--cp", "16", "--dp", "1", "--cp-comm", "a2a"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--cp-comm a2a" in err and "128" in err and "heads=96" in err
    code, _, err = run(FULL + ["--cp", "2", "--cp-comm", "ulysses"], capsys)
    assert code == 2 and "--cp-comm ulysses" in err


def test_cli_names_the_cp_comm(capsys):
    for comm, words in (("a2a", "Ulysses' all-to-alls"), ("ring", "ring attention")):
        code, out, _ = run(FULL + ["--cp", "2", "--cp-comm", comm], capsys)
        assert code == 0 and f"cp2 {comm}" in out and words in out
    code, out, _ = run(FULL + ["--cp", "2"], capsys)  # the default
    assert code == 0 and "cp2 ring" in out


def test_search_tries_both_cp_comms_where_heads_allow():
    ranked, rejected = search(GPT3, H100, 1536, {"tp": 8, "pp": 8, "zero": 1})
    seen = {(p["layout"]["cp"], p["layout"]["cp_comm"]) for p in ranked}
    assert (2, "a2a") in seen and (2, "ring") in seen and (1, "ring") in seen
    assert (1, "a2a") not in seen
    # 96 heads / tp 8 = 12: cp = 16 is ring only, never refused for Ulysses
    assert not any(L.cp_comm == "a2a" and L.cp == 16 for L, *_ in rejected)
    fixed, _ = search(GPT3, H100, 1536, {"tp": 8, "pp": 8, "zero": 1, "cp_comm": "ring"})
    assert {p["layout"]["cp_comm"] for p in fixed} == {"ring"}


def test_a2a_is_not_priced_on_here():
    from minipar.plan.hardware import here
    cluster = Cluster(2, 2, here())
    shape = GPTShape(2, 32, 4, 16, 64)
    with pytest.raises(LayoutError, match="--cp-comm a2a"):
        check(shape, Layout(cp=2, cp_comm="a2a", precision="fp32"), cluster, 4)


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 2)])
def test_a2a_activations_are_plain_attention_over_the_whole_sequence(cp, tp):
    """Ulysses keeps what the plain attention keeps (q, k, v after the all-to-alls: the bytes
    of c_attn's output) and P of this rank's s/cp queries over all s keys, no ring rows."""
    from minipar.plan.activations import layer_bytes
    s, b, h, a = 64, 2, 32, 8
    plain = layer_bytes(s // cp, b, h, a, "fp32", tp, tp > 1)
    extra_p = a * (s // cp) * (s - s // cp) * b * 4 / tp  # P's keys beyond the rank's own
    assert layer_bytes(s, b, h, a, "fp32", tp, tp > 1, cp, cp_comm="a2a") == plain + extra_p
    # selective recompute drops P, as without cp
    assert layer_bytes(s, b, h, a, "fp32", tp, tp > 1, cp, "selective", cp_comm="a2a") == \
        layer_bytes(s // cp, b, h, a, "fp32", tp, tp > 1, 1, "selective")


def test_dualpipev_places_its_stages_in_zb_vs_v_and_is_priced_on_here():
    """Placement is read from a schedule of 2p micro-batches (DualPipeV refuses fewer): the V of
    ZB-V, so a rank's model states are ZB-V's; --profile here simulates its unequal stages."""
    from minipar.plan.hardware import here
    from minipar.plan.layout_bytes import rank_state_bytes
    from minipar.plan.time import stages_by_rank
    shape = GPTShape(2, 6, 2, 7, 10)
    for rank in (0, 1):
        assert rank_state_bytes(shape, "fp32", pp=2, pp_rank=rank, schedule="dualpipev") == \
            rank_state_bytes(shape, "fp32", pp=2, pp_rank=rank, schedule="zb-v")
    layout = Layout(pp=2, schedule="dualpipev", precision="fp32", micro_batch=4, zero=0)
    assert stages_by_rank(layout) == [[0, 3], [1, 2]]
    small = GPTShape(4, 64, 4, 64, 256)
    cluster = Cluster(2, 2, here())
    check(small, layout, cluster, 16)
    p = predict(small, layout, cluster, 16)
    assert p["layout"]["m"] == 4 and p["time_s"]["total"] > p["time_s"]["compute"] > 0
