"""``minipar plan``: the step-time model adds up, the search is fast and gives its reasons, the
command's JSON is pure and every impossible request is one line and exit 2. No MPI job."""
import json
import time

import pytest

from minipar.cli import main
from minipar.parallel.pipeline import build, makespan, peak_inflight, simulate, unit_cost
from minipar.plan import PRESETS, GPTShape, model_state_bytes
from minipar.plan.flops import expert_flops_per_iteration
from minipar.plan.hardware import PROFILES, gemm_rate, here
from minipar.plan.search import LayoutError, check, reasons, search
from minipar.plan.time import Cluster, Layout, expert_parameters, pipeline_shape, predict

GPT3 = PRESETS["gpt3-175b"].shape
H100 = Cluster(1024, 8, PROFILES["h100"])
FULL = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8", "--zero", "1"]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_175b_on_1024_gpus_is_ranked_in_under_5_seconds(capsys):
    # about 1 s on the 2-core CI machine (2.7 s for the whole command, imports included); the
    # process's CPU time, which other jobs on a shared machine do not inflate
    start = time.process_time()
    code, out, _ = run(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--json"], capsys)
    assert time.process_time() - start < 5.0
    result = json.loads(out)
    assert code == 0 and result["layouts"] > 100
    times = [p["time_s"]["total"] for p in result["ranked"]]
    assert times == sorted(times) and all(p["fits"] for p in result["ranked"])
    assert set(result["rejected"]) == {"tp beyond a node", "divisibility", "memory"}


def test_json_is_pure_and_has_the_documented_keys(capsys):
    code, out, err = run(FULL + ["--json"], capsys)
    assert code == 0 and err == ""
    result = json.loads(out)  # the whole of stdout is one JSON document
    assert {"params", "grads", "optimizer", "activations", "buffers", "total"} <= set(
        result["memory_bytes"])
    assert {"compute", "comm", "bubble", "total"} <= set(result["time_s"])
    assert {"flops_per_step", "mfu", "fits", "tokens_per_s", "layout", "notes"} <= set(result)


def test_a_bf16_layout_on_here_says_its_compute_is_priced_as_float32(capsys):
    small = ["plan", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab",
             "64", "--global-batch", "4", "--gpus", "1", "--tp", "1", "--pp", "1", "--zero", "0",
             "--micro-batch", "4", "--recompute", "none"]
    code, out, _ = run(small + ["--profile", "here", "--json"], capsys)  # bf16 by default
    notes = json.loads(out)["notes"]
    assert code == 0 and len(notes) == 1 and "priced as float32's" in notes[0]
    code, out, _ = run(small + ["--profile", "here"], capsys)
    assert out.splitlines()[-1] == f"note: {notes[0]}"
    # float32 on here, and any precision on a GPU profile, is modelled: nothing to say
    for extra in (["--profile", "here", "--precision", "fp32"], ["--profile", "h100"]):
        code, out, _ = run(small + extra + ["--json"], capsys)
        assert json.loads(out)["notes"] == []


def test_the_table_names_each_kind(capsys):
    code, out, _ = run(FULL, capsys)
    assert code == 0
    for word in ("params", "optimizer", "activations", "bubble", "tokens/s", "MFU", "fits: yes"):
        assert word in out


@pytest.mark.parametrize("extra, says", [
    (["--gpus", "8"], "no layout of gpt3-175b on 8 GPUs fits"),
    (["--gpus", "1024", "--tp", "16", "--pp", "8", "--zero", "1"], "tp=16 does not fit"),
    (["--gpus", "1024", "--tp", "8", "--pp", "5", "--zero", "1"], "divisible"),
    (["--gpus", "1024", "--tp", "8", "--pp", "8", "--zero", "1", "--precision", "int8"],
     "--precision int8"),
    (["--gpus", "1024", "--tp", "8", "--pp", "8", "--zero", "4"], "--zero 4"),
    (["--gpus", "1024", "--schedule", "pipedream"], "--schedule pipedream"),
    (["--gpus", "1024", "--layers", "4"], "drop --layers"),
    (["--gpus", "1024", "--profile", "no-such-gpu"], "--profile no-such-gpu: no such hardware"),
    (["--gpus", "1024", "--layers", "4"], "--seq and --global-batch may override"),
    (["--gpus", "1024", "--tp", "8", "--pp", "8", "--zero", "1", "--profile", "a100",
      "--precision", "fp8"], "--precision fp8: A100 SXM 80GB has no fp8 matrix units"),
])
def test_an_impossible_request_is_one_line_and_exit_2(extra, says, capsys):
    code, out, err = run(["plan", "--model", "gpt3-175b"] + extra, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("minipar plan: error: ") and says in err


SMALL = ["plan", "--layers", "4", "--hidden", "96", "--heads", "6", "--seq", "64", "--vocab",
         "100", "--global-batch", "8", "--gpus", "8"]


@pytest.mark.parametrize("extra, says", [
    (["--tp", "4", "--pp", "1", "--zero", "0"], "tp=4 does not divide heads=6"),
    (["--ep", "2"], "--ep 2: expert parallelism needs --experts"),
    (["--experts", "3", "--ep", "2", "--tp", "1", "--pp", "1", "--zero", "0"],
     "ep=2 does not divide experts=3"),
    (["--tp", "1", "--pp", "2", "--zero", "0", "--schedule", "interleaved", "--global-batch",
      "12"], "m=3 must be a multiple of p=2"),
])
def test_a_small_model_is_refused_by_the_rule_it_breaks(extra, says, capsys):
    code, _, err = run(SMALL + extra, capsys)
    assert code == 2 and err.count("\n") == 1 and says in err


def test_experts_are_split_over_ep_and_exchanged_all_to_all():
    shape = GPTShape(8, 1024, 16, 1024, 32000, experts=8, top_k=2)
    cluster = Cluster(32, 8, PROFILES["h100"])
    p = predict(shape, Layout(tp=2, pp=2, dp=8, ep=4, zero=1), cluster, 256)
    experts = expert_parameters(shape)
    dense = model_state_bytes(shape.parameters() - experts, "bf16", 1, 8, 2, 2)
    routed = model_state_bytes(experts / 4, "bf16", 1, 2, 2, 2)
    assert p["memory_bytes"]["params"] == dense["params"] + routed["params"]
    assert p["time_s"]["ep"] > 0
    # the experts are the MLPs: 8 layers x 8 experts x (h·4h + 4h + 4h·h + h)
    assert experts == 8 * 8 * (8 * 1024 * 1024 + 5 * 1024)


def test_the_kinds_add_up():
    p = predict(GPT3, Layout(tp=8, pp=8, dp=16, zero=1, schedule="interleaved", chunks=2),
                H100, 1536)
    mem, t = p["memory_bytes"], p["time_s"]
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert t["comm"] == pytest.approx(t["tp"] + t["cp"] + t["pp"] + t["dp"] + t["ep"])
    assert t["total"] == pytest.approx(t["compute"] + t["comm"] + t["bubble"])
    assert p["tokens_per_s"] == pytest.approx(1536 * GPT3.seq / t["total"])
    assert p["mfu"] == pytest.approx(p["model_flops_per_step"] / (t["total"] * 989e12 * 1024))


def test_model_states_are_the_formulas_by_kind():
    # the bytes themselves are checked against the optimizer and ZeRO's Table 1 in
    # test_plan_papers.py; here: the planner regroups them (optimizer = master + moments), ZeRO
    # sharding over dp·cp, the ranks of a stage holding 1/(tp·pp)
    layout = Layout(tp=4, pp=4, dp=32, cp=2, zero=2)
    mem = predict(GPT3, layout, H100, 1536)["memory_bytes"]
    states = model_state_bytes(GPT3.parameters(), "bf16", zero=2, dp=64, tp=4, pp=4)
    assert (mem["params"], mem["grads"]) == (states["params"], states["grads"])
    assert mem["optimizer"] == states["master"] + states["moments"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("passes", [3, 4])
def test_the_bubble_of_2p_micro_batches_is_the_bubble_of_m(name, passes):
    # the planner simulates at most 2p micro-batches: the idle time no longer grows beyond
    p, m = 4, 24
    v = 2 if name in ("interleaved", "zb-v") else 1
    schedule = build(name, p, m, 2 if name == "interleaved" else None)
    u = 1 / passes
    events = simulate(schedule, unit_cost(schedule, u, u * (passes - 2), u))
    bubble, inflight = pipeline_shape(name, p, m, v, passes)
    assert bubble == pytest.approx(makespan(events) - m)
    assert inflight == max(peak_inflight(events, p))


def test_search_fixes_what_is_given_and_says_why_others_fail():
    ranked, rejected = search(GPT3, H100, 1536, {"tp": 8, "zero": 1})
    assert ranked and all(p["layout"]["tp"] == 8 and p["layout"]["zero"] == 1 for p in ranked)
    assert "memory" in reasons(rejected)
    best = ranked[0]["layout"]
    again = predict(GPT3, Layout(**{k: best[k] for k in ("tp", "pp", "dp", "cp", "zero")}),
                    H100, 1536)
    assert again["time_s"] == ranked[0]["time_s"]
    with pytest.raises(LayoutError, match="does not divide layers=96") as err:
        check(GPT3, Layout(tp=8, pp=64, dp=2), H100, 1536)
    assert err.value.reason == "divisibility"


def test_the_profiles_and_here():
    assert PROFILES["h100"].peak("bf16") == 989e12 and PROFILES["a100"].peak("bf16") == 312e12
    assert PROFILES["h100"].link(inside_node=True).beta(1) == pytest.approx(1 / 450e9)
    assert gemm_rate(n=64, repeats=2) > 0
    mine = here()
    assert mine.link(True) is mine.link(False)  # one machine: the one fitted model


def test_plot_draws_the_layouts_shown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    code, out, _ = run(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--top", "3",
                        "--plot", str(path)], capsys)
    assert code == 0 and f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expert_flops_are_k_mlps_and_the_router():
    B, s, l, h, E = 2, 16, 3, 8, 4
    mlp = 16 * B * s * h * h  # the 4h MLP's forward, as layer_forward_flops counts it
    for k, recompute, passes in ((1, False, 3), (2, False, 3), (3, True, 4)):
        assert expert_flops_per_iteration(B, s, l, h, E, k, recompute) == \
            passes * l * ((k - 1) * mlp + 2 * B * s * h * E)


def test_a_full_layout_that_does_not_fit_is_still_predicted(capsys):
    code, out, _ = run(["plan", "--model", "gpt3-175b", "--gpus", "8", "--tp", "8", "--pp", "1",
                        "--zero", "0", "--json"], capsys)
    assert code == 0 and json.loads(out)["fits"] is False


def test_zero3_is_priced_unit_by_unit_as_minipar_gathers():
    """ZeRO-3's collectives are per unit (a module holding parameters, ZeRO3's layer_units):
    the planner counts the units of minipar's GPT, and each pays its own alpha steps."""
    from minipar import nn
    from minipar.parallel.data.zero3_units import layer_units
    from minipar.plan.time import zero3_units
    shape = GPTShape(4, 16, 2, 8, 10)
    model = nn.GPT(nn.GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=10))
    assert zero3_units(shape, 1, 1, "1f1b", None, 1) == len(layer_units(model)) == 28
    cluster = Cluster(gpus=8, gpus_per_node=8, profile=PROFILES["h100"])
    # not hidden behind the compute (dp_overlap=False): all of the exchange is exposed
    exposed = predict(shape, Layout(dp=8, zero=3, dp_overlap=False), cluster, 8)["time_s"]["dp"]
    # 28 units x (a reduce-scatter and two all-gathers) x 7 ring steps of alpha each, at least
    # (one collective of all the parameters would pay 3 x 7 alphas)
    assert exposed >= 28 * 3 * 7 * PROFILES["h100"].alpha_intra


FIXED = ["plan", "--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--zero", "1"]


@pytest.mark.parametrize("extra, says", [
    (["--gpus", "1024", "--gpu-memory", "-80"], "--gpu-memory -80: "),
    (["--gpus", "1024", "--gpu-memory", "nan"], "--gpu-memory nan: "),
    (["--gpus", "1024", "--gpu-memory", "inf"], "--gpu-memory inf: "),
    (["--gpus", "1024", "--gpu-memory", "0"], "--gpu-memory 0: "),
    (["--gpus", str(10 ** 13)], f"--gpus {10 ** 13}: "),
    (["--gpus", "1024", "--gpus-per-node", str(10 ** 13)], f"--gpus-per-node {10 ** 13}: "),
])
def test_an_absurd_number_is_refused_by_its_flag(extra, says, capsys):
    code, out, err = run(FIXED + extra, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("minipar plan: error: ") and says in err


def test_a_billion_gpus_are_counted_not_materialised(capsys):
    # a layout and the search on 10^9 GPUs: the grid is counted, never built (np.arange(10^9)
    # is 7.45 GiB), and the divisors come from the factors (2^9·5^9: 100 of them)
    import tracemalloc
    billion = ["--gpus", str(10 ** 9), "--global-batch", str(10 ** 9 // 64), "--json"]
    tracemalloc.start()
    start = time.process_time()
    code, out, _ = run(FIXED + billion, capsys)
    fixed = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert code == 0 and json.loads(out)["layout"]["dp"] == 10 ** 9 // 64
    start = time.process_time()
    code, _, err = run(["plan", "--model", "gpt3-175b", "--gpus", str(10 ** 9)], capsys)
    searched = time.process_time() - start
    assert code == 2 and "no layout of gpt3-175b on 1000000000 GPUs fits" in err
    assert fixed < 1.0 and searched < 1.0 and peak < 100 * 2 ** 20, (fixed, searched, peak)
