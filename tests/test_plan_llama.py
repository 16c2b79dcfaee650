"""The planner's model families and options (issues 41 and 39.6): Llama 3's presets counted
from their published shapes, FLOPs by each family's own formula (what the layout computes, and
PaLM's for MFU), a preset's sequence and batch overridden, the defaults a user expects said in
the JSON and the text, and FP8 priced from the H100's data sheet. Pure, no MPI."""
import dataclasses
import json

import pytest

from minipar.cli import main
from minipar.plan import PRESETS, GPTShape, bytes_per_parameter
from minipar.plan.flops import model_flops, step_flops
from minipar.plan.hardware import PROFILES
from minipar.plan.search import check
from minipar.plan.time import Cluster, Layout, predict

# The Llama 3 model cards' parameter counts, and Dubey et al. 2024 (arXiv:2407.21783) Table 3's
# shapes: layers, model dimension, FFN dimension, attention heads; 8 key/value heads, a
# vocabulary of 128,256 (the released tokenizer), untied
LLAMA3 = {"llama3-8b": (8.03e9, 32, 4096, 14336, 32), "llama3-70b": (70.6e9, 80, 8192, 28672, 64),
          "llama3-405b": (405.9e9, 126, 16384, 53248, 128)}


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", list(LLAMA3))
def test_llama3_presets_count_the_published_parameters(name):
    published, layers, hidden, ffn, heads = LLAMA3[name]
    shape = PRESETS[name].shape
    assert (shape.layers, shape.hidden, shape.inner, shape.heads, shape.kv, shape.vocab,
            shape.style, shape.tied) == (layers, hidden, ffn, heads, 8, 128256, "llama", False)
    # counted by hand from the shapes: q and o h x h, k and v h x 8·d, gate, up and down
    # h x f, two RMSNorms a layer, the final one, the embedding and the untied head
    d = hidden // heads
    layer = 2 * hidden * hidden + 2 * hidden * 8 * d + 3 * hidden * ffn + 2 * hidden
    assert shape.parameters() == layers * layer + hidden + 2 * 128256 * hidden
    assert abs(shape.parameters() / published - 1) < 1e-3


def test_llama_flops_are_its_own_and_mfu_divides_palms():
    shape, B = PRESETS["llama3-8b"].shape, 4
    h, f, s, l, V = 4096, 14336, 8192, 32, 128256
    kv = 8 * 128
    # a layer's forward: q, k, v, o; gate, up, down; QKᵀ and attention over V
    layer = 2 * B * s * (h * (h + 2 * kv) + h * h + 3 * h * f) + 4 * B * s * s * h
    head = 2 * B * s * h * V
    assert step_flops(shape, B, "none") == 3 * (l * layer + head)
    assert step_flops(shape, B, "full") == 4 * l * layer + 3 * head
    assert step_flops(shape, B, "selective") == 3 * (l * layer + head) + l * 4 * B * s * s * h
    # PaLM's 6N + 12·l·h·s a token, N without the input embedding (a lookup)
    N = shape.parameters() - V * h
    assert model_flops(shape, B) == B * s * (6 * N + 12 * l * h * s)
    # the GPT-3 preset ties its head: N keeps it, drops only the learned positions
    gpt3 = PRESETS["gpt3-175b"].shape
    assert model_flops(gpt3, 1) == 2048 * (6 * (gpt3.parameters() - 2048 * 12288)
                                           + 12 * 96 * 12288 * 2048)


def test_a_presets_seq_and_batch_are_overridden(capsys):
    code, out, _ = run(["plan", "--model", "llama3-8b", "--seq", "32768", "--global-batch",
                        "256", "--gpus", "64", "--tp", "8", "--pp", "1", "--cp", "2", "--zero",
                        "1", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["seq"] == 32768 and result["global_batch"] == 256
    longer = dataclasses.replace(PRESETS["llama3-8b"].shape, seq=32768)
    assert result["flops_per_step"] == step_flops(longer, 256, "selective")
    assert result["model_flops_per_step"] == model_flops(longer, 256)
    # the shape itself stays the preset's
    code, _, err = run(["plan", "--model", "llama3-8b", "--hidden", "1024", "--gpus", "8"],
                       capsys)
    assert code == 2 and "drop --hidden" in err


def test_json_and_text_say_both_flops_and_which_defaults_were_used(capsys):
    argv = ["plan", "--model", "llama3-70b", "--gpus", "512", "--tp", "8", "--pp", "4",
            "--zero", "1"]
    code, out, _ = run(argv + ["--json"], capsys)
    result = json.loads(out)
    L = result["layout"]
    assert code == 0 and L["activations"] == "megatron" and L["sequence_parallel"] is True
    assert result["flops_per_step"] > result["model_flops_per_step"] > 0
    assert any("Llama block" in note for note in result["notes"])
    code, out, _ = run(argv, capsys)
    assert "megatron activations, sequence parallel on" in out
    assert "computed" in out and "model's (MFU's)" in out
    assert "note: a Llama block's GEMMs" in out
    code, out, _ = run(argv + ["--sequence-parallel", "off", "--activations", "minipar",
                               "--json"], capsys)
    L = json.loads(out)["layout"]
    assert L["sequence_parallel"] is False and L["activations"] == "minipar"


def test_sequence_parallelism_off_all_reduces_and_keeps_the_layers_whole():
    gpt3 = PRESETS["gpt3-175b"].shape
    cluster = Cluster(1024, 8, PROFILES["h100"])
    on, off = (predict(gpt3, Layout(tp=8, pp=8, dp=16, sequence_parallel=sp), cluster, 1536)
               for sp in (True, False))
    # Korthikanti et al. Table 2, selective recompute: sbh·34/t with sp, sbh(10 + 24/t) without
    assert off["memory_bytes"]["activations"] / on["memory_bytes"]["activations"] == \
        pytest.approx((10 + 24 / 8) / (34 / 8))
    # without sp the element-wise kernels outside the tp regions run whole on every rank
    assert off["time_s"]["compute"] > on["time_s"]["compute"]


H100 = Cluster(1024, 8, PROFILES["h100"])
GPT3 = PRESETS["gpt3-175b"].shape


def test_fp8_prices_one_byte_weights_messages_and_the_fp8_peak():
    """39.6: FP8 weights (1 byte and a float32 scale per 128 x 128 block) and messages (1 byte
    and one per 1 x 128 tile), float32 masters and moments, the linears at 1,979 TFLOP/s."""
    assert bytes_per_parameter("fp8") == {"params": 1 + 4 / 128**2, "grads": 2, "master": 4,
                                          "moments": 8}
    layout = dict(tp=8, pp=8, dp=16, zero=1)
    bf16, fp8 = (predict(GPT3, Layout(precision=p, **layout), H100, 1536)
                 for p in ("bf16", "fp8"))
    assert fp8["memory_bytes"]["params"] == pytest.approx(
        bf16["memory_bytes"]["params"] * (1 + 4 / 128**2) / 2)
    assert fp8["memory_bytes"]["optimizer"] == bf16["memory_bytes"]["optimizer"]
    # the linears at twice the peak: faster, not twice (attention and the kernels stay bf16)
    assert 0.5 < fp8["time_s"]["compute"] / bf16["time_s"]["compute"] < 0.9
    # tensor parallelism's gathers in FP8 (reduce-scatters in bf16), the gradients in FP8
    assert fp8["time_s"]["tp"] < bf16["time_s"]["tp"]
    # the same FLOPs; MFU against the FP8 peak
    assert fp8["model_flops_per_step"] == bf16["model_flops_per_step"]
    assert fp8["mfu"] == pytest.approx(fp8["model_flops_per_step"]
                                       / (fp8["time_s"]["total"] * 1979e12 * 1024))
    assert fp8["memory_bytes"]["activations"] < bf16["memory_bytes"]["activations"]


def test_fp8_is_refused_where_it_is_not_priced(capsys):
    small = GPTShape(2, 64, 2, 16, 64)
    with pytest.raises(ValueError, match="--precision fp8: A100 SXM 80GB has no fp8"):
        check(small, Layout(dp=8, precision="fp8"), Cluster(8, 8, PROFILES["a100"]), 8)
    with pytest.raises(ValueError, match="--activations minipar"):
        check(small, Layout(dp=8, precision="fp8", activations="minipar"),
              Cluster(8, 8, PROFILES["h100"]), 8)
    here_like = dataclasses.replace(PROFILES["h100"], engine=object())
    with pytest.raises(ValueError, match="--profile here"):
        check(small, Layout(dp=8, precision="fp8"), Cluster(8, 8, here_like), 8)
    code, out, _ = run(["plan", "--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--pp",
                        "1", "--zero", "1", "--precision", "fp8", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["layout"]["precision"] == "fp8"
    assert any(note.startswith("fp8: ") and "1 x 128 tile" in note for note in result["notes"])
