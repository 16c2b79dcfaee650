"""The planner's formulas against the papers they come from, to the printed digits: ZeRO's Table 1
(model states per device), the Megatron-LM paper's FLOPs per iteration and parameter counts,
Korthikanti et al.'s activation memory per layer; and against minipar itself: the parameter
count nn.GPT has, the bytes per kind Optimizer.memory_bytes() measures. Pure, no MPI."""
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

import minipar
from minipar import nn, optim
from minipar.plan import (PRESETS, GPTShape, bytes_per_parameter, flops_per_iteration,
                          megatron_activation_bytes, model_state_bytes, preset,
                          training_seconds)
from minipar.plan.memory import GB, MEGATRON_LAYER


def printed(value, text):
    """``value`` rounded half up to as many decimals as ``text`` prints, as the papers round."""
    decimals = len(text.partition(".")[2])
    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-decimals), ROUND_HALF_UP)) == text


# Rajbhandari et al. 2020 (ZeRO, arXiv:1910.02054), Table 1: per-device memory in GB of the
# model states, mixed-precision Adam (K = 12), for P_os, P_os+g, P_os+g+p at DP degree N_d
ZERO_TABLE_1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
            1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513.5", "257.8", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
           16: ("4750", "2875", "1000"), 64: ("4187.5", "2218.8", "250"),
           256: ("4046.9", "2054.7", "62.5"), 1024: ("4011.7", "2013.7", "15.6")},
}


@pytest.mark.parametrize("psi", list(ZERO_TABLE_1))
def test_zero_table_1_to_the_printed_digits(psi):
    for dp, row in ZERO_TABLE_1[psi].items():
        for stage, text in zip((1, 2, 3), row):
            total = sum(model_state_bytes(psi, "fp16", zero=stage, dp=dp).values()) / GB
            assert printed(total, text), (psi, dp, stage, total, text)


def test_zero_counts_gb_as_1e9_bytes_and_k_is_12():
    # 2 + 2 + K bytes per parameter, K = 12: the fp32 master and Adam's two moments
    per = bytes_per_parameter("fp16")
    assert per["master"] + per["moments"] == 12 and sum(per.values()) == 16
    # 2^30-byte GB would print 111.8 for the 7.5B model on one device, not the paper's 120
    assert not printed(sum(model_state_bytes(7.5e9, "fp16").values()) / 2**30, "120")


def test_model_parallelism_divides_the_model_before_zero_shards_it():
    whole = model_state_bytes(8e9, "bf16", zero=1, dp=4)
    split = model_state_bytes(8e9, "bf16", zero=1, dp=4, tp=2, pp=4)
    assert split == {kind: b / 8 for kind, b in whole.items()}
    assert split["params"] == 8e9 * 2 / 8 and split["moments"] == 8e9 * 8 / 8 / 4


@pytest.mark.parametrize("kwargs, match", [(dict(zero=4), "zero=4"), (dict(dp=0), "dp=0"),
                                           (dict(precision="int8"), "int8")])
def test_model_state_bytes_refuses_what_it_does_not_model(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_state_bytes(1e9, **kwargs)


MEGATRON = [name for name in PRESETS if name.startswith("megatron-")]


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_flops_per_iteration_equal_the_papers_formula_exactly(name):
    p = PRESETS[name]
    B, s, l, h, V = p.global_batch, p.shape.seq, p.shape.layers, p.shape.hidden, p.shape.vocab
    s_, h_, l_, V_ = (Fraction(x) for x in (s, h, l, V))
    # Narayanan et al. 2021, §5.1: with and without full activation recomputation
    with_recompute = 96 * B * s * l * h**2 * (1 + s_ / (6 * h_) + V_ / (16 * l_ * h_))
    without = 72 * B * s * l * h**2 * (1 + s_ / (6 * h_) + V_ / (12 * l_ * h_))
    assert flops_per_iteration(B, s, l, h, V, recompute=True) == with_recompute
    assert flops_per_iteration(B, s, l, h, V, recompute=False) == without


@pytest.mark.parametrize("name", MEGATRON + ["gpt3-175b"])
def test_parameter_counts_print_as_the_papers(name):
    # Megatron's 12lh²(1 + 13/12h + (V + s)/12lh) is GPT-2's block with a tied head, without
    # the final LayerNorm (2h, below the printed digits)
    p = PRESETS[name]
    l, h, V, s = p.shape.layers, p.shape.hidden, p.shape.vocab, p.shape.seq
    assert p.shape.parameters() == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h
    if name == "gpt3-175b":  # GPT-3 prints 175.0B; its own shapes count 174.6B
        assert abs(p.shape.parameters() / 1e9 - 175.0) < 0.5
    else:
        assert printed(p.shape.parameters() / 1e9, p.billions)
        assert p.dp * p.tp * p.pp == p.gpus


def test_llama2_counts_as_the_released_checkpoints():
    # 6.74B and 68.98B: what the released Llama 2 7B and 70B checkpoints hold
    assert preset("llama2-7b").shape.parameters() == 6_738_415_616
    assert preset("llama2-70b").shape.parameters() == 68_976_648_192
    with pytest.raises(KeyError, match="known"):
        preset("gpt5")


# Korthikanti et al. 2022 (arXiv:2205.05198), Table 2: activation bytes per transformer layer
def table_2(s, b, h, a, t):
    s, b, h, a, t = (Fraction(x) for x in (s, b, h, a, t))
    sbh = s * b * h
    return {("none", 1, False): sbh * (34 + 5 * a * s / h),
            ("none", t, False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            ("none", t, True): sbh * (34 / t + 5 * a * s / (h * t)),
            ("selective", t, False): sbh * (10 + 24 / t),
            ("selective", t, True): sbh * 34 / t,
            ("full", t, False): sbh * 2}


# the paper's Table 3 models (22B, GPT-3 175B, MT-NLG 530B, 1T): a, h; s = 2048, t = 8; b = 1
# and a few small shapes
SHAPES = [(2048, 1, 6144, 64, 8), (2048, 1, 12288, 96, 8), (2048, 1, 20480, 128, 8),
          (2048, 1, 25600, 160, 8), (64, 4, 48, 6, 2), (32, 3, 64, 4, 4)]


@pytest.mark.parametrize("s, b, h, a, t", SHAPES)
def test_megatron_activations_per_layer_equal_korthikanti_table_2(s, b, h, a, t):
    for (recompute, tp, sp), expected in table_2(s, b, h, a, t).items():
        got = megatron_activation_bytes(s, b, h, a, t=int(tp), sp=sp, recompute=recompute)
        assert got == expected, (recompute, tp, sp)


def test_megatron_layer_ops_add_up_to_the_papers_terms():
    # §4.1: attention 11sbh + 5as²b, MLP 19sbh, the two layer norms 4sbh; tp splits 24sbh
    sbh = sum(k for _, k, unit, _, _ in MEGATRON_LAYER if unit == "sbh")
    as2b = sum(k for _, k, unit, _, _ in MEGATRON_LAYER if unit == "as2b")
    split = sum(k for _, k, unit, tp, _ in MEGATRON_LAYER if unit == "sbh" and tp)
    assert (sbh, as2b, split) == (34, 5, 24)
    with pytest.raises(ValueError, match="recompute='some'"):
        megatron_activation_bytes(8, 1, 8, 2, recompute="some")


SMALL = [dict(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64),
         dict(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=24, tie_weights=True),
         dict(vocab_size=7, block_size=5, n_layer=1, n_head=1, n_embd=8)]


def shape_of(c):
    return GPTShape(c["n_layer"], c["n_embd"], c["n_head"], c["block_size"], c["vocab_size"],
                    tied=c.get("tie_weights", False))


def count(module):
    return sum(p.size for p in module.parameters())


@pytest.mark.parametrize("config", SMALL)
def test_parameters_are_the_count_minipars_gpt_has(config):
    model = nn.GPT(nn.GPTConfig(**config))
    assert shape_of(config).parameters() == count(model)


def test_an_moe_layer_counts_as_minipars_moe_block():
    block = nn.MoEBlock(n_embd=16, n_head=2, n_experts=4, top_k=2)
    assert GPTShape(1, 16, 2, 8, 10, experts=4, top_k=2).layer_parameters() == count(block)
    assert GPTShape(1, 16, 2, 8, 10).layer_parameters() == count(nn.Block(16, 2))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_bytes_per_kind_are_what_the_optimizer_holds(precision):
    config = SMALL[0]
    model = nn.GPT(nn.GPTConfig(**config)).astype(minipar.backend.dtype(precision))
    opt = optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = minipar.backend.xp().zeros_like(p.data)
    opt.step()
    assert model_state_bytes(shape_of(config).parameters(), precision) == opt.memory_bytes()


def test_the_planner_needs_no_mpi():
    import subprocess
    import sys
    code = "import sys, minipar.plan; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name, tokens, gpus, tflops, days", [
    ("gpt3-175b", 300e9, 1024, 140, "34"), ("megatron-1008.0b", 450e9, 3072, 163, "84")])
def test_training_time_estimates_as_the_paper_prints_them(name, tokens, gpus, tflops, days):
    # Narayanan et al. 2021, §5.1: "about 34 days" and "about 84 days"
    seconds = training_seconds(tokens, PRESETS[name].shape.parameters(), gpus, tflops * 1e12)
    assert printed(seconds / 86400, days)
    assert PRESETS["gpt3-175b"].dp is None and PRESETS[name].tp in (None, 8)
