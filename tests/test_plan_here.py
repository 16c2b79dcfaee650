"""``--profile here`` (issue 26): the engine costs the profile measures at start, the compute
term they price, and scripts/bench_plan.py run end to end at its smallest setting (its ratios
are not asserted: performance is never a timed test)."""
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from minipar.plan import hardware
from minipar.plan.flops import layer_forward_flops, layer_gemms
from minipar.plan.models import GPTShape
from minipar.plan import time as time_module
from minipar.plan.search import LayoutError, check
from minipar.plan.time import (Cluster, Layout, engine_seconds, expert_parameters, predict,
                               zero3_units)
from minipar.testing import run_on_ranks

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_plan.py"
SHAPE = GPTShape(4, 32, 4, 16, 64)
# made-up costs: the tests check how predict combines them, not this machine's values
ENGINE = hardware.Engine(layer=1e-4, activation=1e-9, rest=5e-5, logit=2e-9, tensor=1e-6,
                         element=1e-9, cores=2)


@dataclasses.dataclass(frozen=True)
class Blocks(hardware.Engine):
    """An engine whose block costs 1 s and whose ends cost nothing (with GEMMs priced at 0)."""

    def layer_cost(self, *args, **kwargs):
        return 1.0, 0.0

    def ends_cost(self, *args):
        return 0.0, 0.0

    def embedding_cost(self, *args):
        return 0.0


def test_layer_gemms_are_the_flops_megatron_counts():
    for B, s, h, a in ((3, 8, 12, 4), (2, 16, 32, 2)):
        gemms = layer_gemms(B, s, h, a)
        assert sum(2 * b * m * k * n for b, m, k, n in gemms) == layer_forward_flops(B, s, h)
        # tp and cp split every product: a rank's share is 1/(tp·cp) of the FLOPs
        split = layer_gemms(B, s, h, a, tp=2, cp=2)
        assert 4 * sum(2 * b * m * k * n for b, m, k, n in split) == layer_forward_flops(B, s, h)


def test_gemm_seconds_times_the_shape_and_prices_large_ones_at_the_large_rate():
    assert hardware.gemm_seconds(1, 8, 16, 8, repeats=2) > 0
    big = 2 * 1024**3 / hardware.large_gemm_rate()
    assert hardware.gemm_seconds(1, 1024, 1024, 1024) == big
    # a forward and its two backward products
    one = hardware.gemm_seconds(1, 8, 4, 6)
    assert hardware.gemms_seconds([(1, 8, 4, 6)]) == pytest.approx(
        one + hardware.gemm_seconds(1, 8, 6, 4) + hardware.gemm_seconds(1, 4, 8, 6))


def test_measure_engine_gives_every_cost_and_a_core_count():
    engine = hardware.measure_engine()
    # contention is measured on the ranks, where there are some (contention below)
    assert engine.contention is None
    for field in dataclasses.fields(engine)[:-2]:
        assert getattr(engine, field.name) >= 0, field.name
    # a Block's F, B and W: B and W together about one whole backward, each more than nothing
    assert len(engine.fbw) == 3 and min(engine.fbw) > 0
    assert engine.layer > 0 and engine.rest > 0 and engine.cores >= 1
    assert ENGINE.share(1) == ENGINE.share(2) == 1.0 and ENGINE.share(8) == 0.25


def test_here_has_an_engine_and_the_named_profiles_none():
    assert hardware.here().engine is not None
    assert all(p.engine is None for p in hardware.PROFILES.values())


def test_engine_seconds_prices_micro_batches_ranks_and_oversubscription():
    serial = engine_seconds(SHAPE, Layout(micro_batch=2), ENGINE, 1, 3)
    # each micro-batch costs the same again; the optimizer's step once a step
    step = ENGINE.tensor * (12 * 4 + 5) + ENGINE.element * SHAPE.parameters()
    two = engine_seconds(SHAPE, Layout(micro_batch=2), ENGINE, 2, 3)
    assert two - serial == pytest.approx(serial - step)
    # four ranks on two cores take turns: twice the time of one rank's work alone
    dp4 = engine_seconds(SHAPE, Layout(dp=4, micro_batch=2), ENGINE, 1, 3)
    assert dp4 == pytest.approx(2 * serial)
    # ... unless how much slower they compute together was measured on them: that, instead
    crowded = dataclasses.replace(ENGINE, contention=2.5)
    assert engine_seconds(SHAPE, Layout(dp=4, micro_batch=2), crowded, 1, 3) == \
        pytest.approx(2.5 * serial)
    # ZeRO shards the optimizer's elements over dp
    zero = engine_seconds(SHAPE, Layout(dp=4, zero=1, micro_batch=2), ENGINE, 1, 3)
    assert dp4 - zero == pytest.approx(2 * ENGINE.element * SHAPE.parameters() * 3 / 4)
    # a recomputed forward: a third more of each layer
    assert engine_seconds(SHAPE, Layout(micro_batch=2), ENGINE, 1, 4) > serial


def test_predict_on_here_uses_the_engine():
    profile = dataclasses.replace(hardware.PROFILES["h100"], engine=ENGINE)
    layout = Layout(micro_batch=2, recompute="none", precision="fp32")
    got = predict(SHAPE, layout, Cluster(1, 1, profile), 4)
    assert got["time_s"]["compute"] == engine_seconds(SHAPE, layout, ENGINE, 2, 3)


def contention_on_ranks():
    from minipar import comm
    return hardware.contention(comm.world(), rounds=2, iters=2)


@pytest.mark.mpi
def test_contention_is_measured_on_the_ranks_and_agreed():
    # one rank alone computes as fast as it does alone (the median of the same calls: about 1)
    assert 0.25 < hardware.contention(hardware.one_rank_group(), rounds=5, iters=2) < 4
    # on 3 ranks (beyond 2 cores where CI runs) every rank gets rank 0's number
    got = run_on_ranks(contention_on_ranks, 3, timeout=120)
    assert len(set(got)) == 1 and got[0] > 0


@pytest.mark.mpi
def test_bench_plan_runs_end_to_end_and_prints_its_summary():
    """The smallest setting: the quick GPT, serial and DP on 2 ranks, 3 steps."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--layouts", "serial,DP 2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.startswith(("serial", "DP 2"))] == \
        ["serial", "DP"]
    assert lines[-1].startswith("summary: ") and lines[-1].endswith(
        " of 2 layouts predicted within 0.75-1.33 of the measured median step time "
        "(--profile here)")


def test_bench_plan_refuses_an_unknown_layout():
    out = subprocess.run([sys.executable, str(SCRIPT), "--layouts", "serial,PP 9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown layout(s) PP 9" in out.stderr


def test_small_sizes_are_timed_and_large_ones_priced_at_the_moderate_rate():
    # a 175B model's layer and head cannot be built here: the moderate size's rates
    assert ENGINE.layer_cost(1, 2048, 12288, 96) == (ENGINE.layer, ENGINE.activation)
    assert ENGINE.ends_cost(1, 2048, 12288, 51200) == (ENGINE.rest, ENGINE.logit)
    # a small one is timed at its own sizes, once
    fixed, rate = ENGINE.layer_cost(2, 16, 32, 4)
    spent, nbytes = hardware.layer_spent(2, 16, 32, 4, "gpt", 1, 0, 1)
    assert rate == max(0.0, spent - ENGINE.layer) / nbytes and nbytes == 16 * 2 * 32 * (34 + 10)
    assert ENGINE.ends_cost(2, 16, 32, 64, "tensor")[1] >= 0
    # the 3D trainer's block (tp and pp layouts) has its own fixed cost, timed on one rank
    tensor, _ = ENGINE.layer_cost(2, 16, 32, 4, "sequence")
    assert tensor == hardware.layer_spent(*hardware.TINY, "sequence", 1, 0, 1, repeats=20)[0]


def test_tp_and_pp_layouts_are_priced_with_the_3d_trainers_block():
    asked = []

    @dataclasses.dataclass(frozen=True)
    class Recording(hardware.Engine):
        def layer_cost(self, b, s, h, heads, block="gpt", cp=1):
            asked.append((block, cp))
            return self.layer, self.activation

        def ends_cost(self, b, s, h, vocab, block="gpt"):
            asked.append(block)
            return self.rest, self.logit

    engine = Recording(**dataclasses.asdict(ENGINE))
    for layout in (Layout(dp=2), Layout(pp=2), Layout(tp=2), Layout(cp=2)):
        engine_seconds(SHAPE, layout, engine, 1, 3)
    assert asked == [("gpt", 1), "gpt", ("tensor", 1), "tensor", ("sequence", 1), "sequence",
                     ("tensor", 2), "tensor"]


def test_an_moe_layer_is_priced_by_its_router_and_the_ranks_experts(monkeypatch):
    asked = []

    @dataclasses.dataclass(frozen=True)
    class Recording(hardware.Engine):
        def layer_cost(self, b, s, h, heads, block="gpt", cp=1, experts=0, top_k=1):
            asked.append((block, experts, top_k))
            return 0.0, 0.0

        def ends_cost(self, b, s, h, vocab, block="gpt"):
            return 0.0, 0.0

    # the GEMMs priced at nothing: what is left is the optimizer's step
    monkeypatch.setattr(time_module, "gemms_seconds", lambda gemms: 0.0)
    engine = Recording(**dataclasses.asdict(ENGINE))
    moe = GPTShape(4, 32, 4, 16, 64, experts=4, top_k=2)
    serial = engine_seconds(moe, Layout(micro_batch=2), engine, 1, 3)
    ep = engine_seconds(moe, Layout(dp=2, ep=2, micro_batch=2), engine, 1, 3)
    # nn.MoEBlock alone, the 4D trainer's block under ep: each timed with its experts
    assert asked == [("gpt", 4, 2), ("tensor", 4, 2)]
    # AdamW steps the rank's E/ep experts: 2 of 4 fewer, 4 tensors each, in each of 4 layers
    assert serial - ep == pytest.approx(ENGINE.tensor * 4 * 2 * 4
                                        + ENGINE.element * expert_parameters(moe) / 2)
    # the GEMMs: the router's, then top_k MLPs' FLOPs per token in E/ep products of T·k·ep/E
    # rows each
    T, h = 2 * 16, 32
    gemms = layer_gemms(2, 16, h, 4, experts=4, top_k=2, ep=2)
    assert gemms[4] == (1, T, h, 4) and gemms[5:] == 2 * [(1, T, h, 4 * h), (1, T, 4 * h, h)]
    # timed with all E experts on one process, less those GEMMs at ep = 1
    spent, _ = hardware.layer_spent(2, 16, 32, 4, "gpt", 1, 4, 2)
    assert spent > 0


def test_here_refuses_tensor_parallel_experts_by_name():
    profile = dataclasses.replace(hardware.PROFILES["h100"], engine=ENGINE)
    moe = GPTShape(4, 32, 4, 16, 64, experts=4, top_k=2)
    with pytest.raises(LayoutError, match="tp=2 with 4 experts: --profile here prices MoE "
                                          "layers at tp = 1 only") as err:
        check(moe, Layout(tp=2, micro_batch=2), Cluster(2, 2, profile), 4)
    assert err.value.reason == "not priced here"
    check(moe, Layout(tp=2, micro_batch=2), Cluster(2, 2, hardware.PROFILES["h100"]), 4)


def test_ring_attention_is_timed_on_one_process_with_its_messages_looped_back():
    import numpy as np

    from minipar.parallel.context.ring import ring_attention
    from minipar.parallel.context.work import RingLog
    import minipar
    q = minipar.tensor(np.random.default_rng(0).standard_normal((1, 2, 8, 4)).astype(np.float32),
                       requires_grad=True)
    with RingLog() as log:
        ring_attention(q, q, q, hardware.LoopbackRing(2)).sum().backward()
    # rank 0 of a balanced ring of 2 (chunks 0 and 3): its own block, then rank 1's (1 and 2),
    # as a real ring's rank 0 computes and skips them
    assert log.steps("forward") == [[(0, 0, "diagonal"), (0, 3, "skipped"), (3, 0, "full"),
                                     (3, 3, "diagonal")],
                                    [(0, 1, "skipped"), (0, 2, "skipped"), (3, 1, "full"),
                                     (3, 2, "full")]]
    assert log.work("backward")["blocks"] == 5
    # the layer's time under cp: the ring's work less the rank's GEMMs, for s/cp of 16 tokens
    spent, nbytes = hardware.layer_spent(2, 8, 16, 2, "tensor", 2)
    assert nbytes == hardware.activation_bytes(2, 8, 16, 2) and spent > 0


def test_zero3_adds_its_own_work_per_unit_measured_on_one_rank():
    @dataclasses.dataclass(frozen=True)
    class PerUnit(hardware.Engine):
        def zero3_unit_cost(self, b, s, h, heads, vocab, layers):
            return 1e-3

    engine = PerUnit(**dataclasses.asdict(ENGINE))
    units = zero3_units(SHAPE, 1, 1, "1f1b", None, 1)
    plain, sharded = (engine_seconds(SHAPE, Layout(dp=4, zero=z, micro_batch=2), engine, 2, 3)
                      for z in (2, 3))
    # every micro-batch gathers every unit; 4 ranks on 2 cores take turns
    assert sharded - plain == pytest.approx(2 * units * 1e-3 * 2)
    # measured: a ZeRO3 step on a one-rank group costs more than the plain step
    assert hardware.zero3_spent(2, 16, 32, 4, 64, 2, repeats=2) > 0


def test_tp_on_here_adds_the_3d_trainers_own_collectives():
    from minipar.comm import cost
    h100 = hardware.PROFILES["h100"]
    layout = Layout(tp=2, micro_batch=2, recompute="none", precision="fp32")
    named, here = (predict(SHAPE, layout, Cluster(2, 2, p), 4)["time_s"]["tp"]
                   for p in (h100, dataclasses.replace(h100, engine=ENGINE)))
    link = h100.link(True)
    act = SHAPE.seq * 2 * SHAPE.hidden * 4

    def all_reduce(n):
        return cost.predict("all_reduce", cost.cheapest("all_reduce", cost.AUTO_CANDIDATES, 2,
                                                        n, link), 2, n, link)
    pair = (cost.predict("all_gather", "ring", 2, act, link)
            + cost.predict("reduce_scatter", "ring", 2, act, link))
    # each of m = 2 micro-batches: the ends' two pairs, the loss's three all-reduces of b·s
    # floats; once a step: the replicated gradients one by one (6 a layer, ln_f's 2, wpe)
    per_mb = 2 * pair + 3 * all_reduce(2 * SHAPE.seq * 4)
    once = (6 * SHAPE.layers + 2) * all_reduce(4 * SHAPE.hidden) + all_reduce(
        4 * SHAPE.seq * SHAPE.hidden)
    assert here - named == pytest.approx(2 * per_mb + once)


def test_each_collective_waits_the_measured_sync_for_its_ranks():
    h100 = hardware.PROFILES["h100"]
    layout = Layout(pp=2, micro_batch=1, recompute="none", precision="fp32")
    plain, waiting = (predict(SHAPE, layout, Cluster(2, 2, p), 4)["time_s"]
                      for p in (h100, dataclasses.replace(h100, sync=1e-3)))
    # m = 4 micro-batches, each an activation forward and a gradient back: 8 messages
    assert waiting["pp"] - plain["pp"] == pytest.approx(8 * 1e-3)
    # measured on a group's ranks (here one: it waits for no one, but it runs)
    assert hardware.sync_seconds(hardware.one_rank_group(), iters=2, rounds=1) >= 0


@pytest.mark.parametrize("schedule, chunks", [("1f1b", None), ("interleaved", 2), ("zb-v", None)])
def test_a_pipeline_rank_is_priced_by_the_blocks_the_trainer_gives_it(schedule, chunks,
                                                                     monkeypatch):
    from minipar.plan.layout_bytes import rank_modules
    from minipar.plan.time import stages_by_rank, trainer_cut

    shape, layout = GPTShape(4, 32, 4, 16, 64), Layout(pp=2, schedule=schedule, chunks=chunks)
    cut = trainer_cut(shape.layers + 3, 2 * layout.v)
    # the same cut the memory side counts, to the byte, against the trainer: each rank's blocks
    for rank, stages in enumerate(stages_by_rank(layout)):
        timed = sum(min(stop, 5) - max(start, 1) for start, stop in (cut[s] for s in stages)
                    if min(stop, 5) > max(start, 1))
        held = {name.split(".")[1] for module in rank_modules(shape, pp=2, pp_rank=rank,
                                                              schedule=schedule, chunks=chunks)
                for name, _ in module if name.startswith("blocks.")}
        assert timed == len(held)

    # a block at 1 s, the ends free: the busiest rank's blocks are the step's compute
    monkeypatch.setattr(time_module, "gemms_seconds", lambda gemms: 0.0)
    engine = Blocks(**{**dataclasses.asdict(ENGINE), "tensor": 0.0, "element": 0.0})
    busiest = max(len({name.split(".")[1] for module in rank_modules(
        shape, pp=2, pp_rank=r, schedule=schedule, chunks=chunks) for name, _ in module
        if name.startswith("blocks.")}) for r in range(2))
    assert engine_seconds(shape, layout, engine, 1, 3) == pytest.approx(busiest)
    assert time_module.engine_bubble(shape, layout, engine, 4, 3, 0.0) >= 0


def test_zero_bubble_fills_less_idle_time_with_a_cheaper_w(monkeypatch):
    monkeypatch.setattr(time_module, "gemms_seconds", lambda gemms: 0.0)
    shape, layout = GPTShape(6, 32, 4, 16, 64), Layout(pp=2, schedule="zb-h1")
    bubbles = [time_module.engine_bubble(shape, layout, Blocks(**{**dataclasses.asdict(ENGINE),
                                                                  "fbw": fbw}), 4, 3, 0.0)
               for fbw in ((1.0, 1.0, 1.0), (1.0, 1.1, 0.5))]
    # the textbook's W of a full third fills the drain; minipar's W, half a forward, less of it
    assert bubbles[1] > bubbles[0] >= 0
