"""Bytes per device: model states by kind under ZeRO and model parallelism (Rajbhandari et al.
2020), activations per layer by Megatron's model (Korthikanti et al. 2022).

Model states follow minipar's own optimizer (``Optimizer.memory_bytes()``: params, grads,
master, moments): the same kinds, the same bytes per parameter, read from the same rule. One
real rank's bytes, whole tensors and ZeRO's padding, to the byte: ``layout_bytes.py``.

    state = model_state_bytes(7.5e9, "fp16", zero=3, dp=64)    # by kind: 1.875e9 bytes in all
    megatron_activation_bytes(s=2048, b=1, h=12288, a=96, t=8, sp=True, recompute="selective")
"""
from fractions import Fraction

from ..backend.dtypes import dtype, is_low_precision
from ..optim.adam import MOMENTS

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# FP8 training as torchao's and Transformer Engine's recipes hold it: the weights in FP8 with
# a float32 scale per 128 x 128 block (DeepSeek-V3 §3.3: 4 bytes per 16,384), gradients
# accumulated in bf16, float32 masters and moments (mixed precision's)
FP8_STATES = {"params": 1 + 4 / 128**2, "grads": 2, "master": 4, "moments": 2 * 4}
KINDS = ("params", "grads", "master", "moments")  # as Optimizer.memory_bytes()
GB = 10**9  # ZeRO's Table 1 counts GB as 1e9 bytes: 16 x 7.5e9 = 120 "GB" (2^30 gives 111.8)


def bytes_per_parameter(precision):
    """{kind: bytes} for one parameter trained by Adam in ``precision`` (fp32, or bf16/fp16 with
    fp32 masters): 4 + 4 + 0 + 8 in fp32, 2 + 2 + 4 + 8 = 16 mixed (ZeRO's 2 + 2 + K, K = 12)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: the planner models {PRECISIONS}")
    if precision == "fp8":
        return dict(FP8_STATES)
    width = dtype(precision).itemsize
    # Optimizer.step_group's rule: a 16-bit parameter is stepped through a float32 master
    # copy, and the moments are made like the array stepped (float32 then); the gradient
    # has the parameter's dtype
    low = is_low_precision(dtype(precision))
    stepped = 4 if low else width
    return {"params": width, "grads": width, "master": 4 if low else 0,
            "moments": len(MOMENTS) * stepped}


def model_state_bytes(n_params, precision="bf16", zero=0, dp=1, tp=1, pp=1):
    """{kind: bytes} one device holds for a model of ``n_params`` parameters: tensor and
    pipeline parallelism give it 1/(tp·pp) of the model; ZeRO then shards over the dp replicas
    the optimizer state (stage 1, P_os), the gradients too (2, P_os+g), the parameters too
    (3, P_os+g+p). Bytes as floats: a device's share of the model need not be whole."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: ZeRO's stages are 0, 1, 2, 3")
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp)):
        if degree < 1:
            raise ValueError(f"{name}={degree} must be >= 1")
    per = bytes_per_parameter(precision)
    local = n_params / (tp * pp)
    sharded = {"master": zero >= 1, "moments": zero >= 1, "grads": zero >= 2,
               "params": zero >= 3}
    return {kind: local * per[kind] / (dp if sharded[kind] else 1) for kind in KINDS}


# Korthikanti et al. 2022 (arXiv:2205.05198) §4.1: what one transformer layer stores for
# backward, 16-bit activations (2 bytes) and 1-byte dropout masks, for s tokens, micro-batch
# b, hidden h, a heads. (what, bytes as a multiple of sbh or of as²b, split by tensor
# parallelism, kept under selective recompute)
SBH, AS2B = "sbh", "as2b"
MEGATRON_LAYER = [
    ("layernorm inputs (2)", 4, SBH, False, True),
    ("QKV matmul input", 2, SBH, False, True),
    ("Q and K for QKᵀ", 4, SBH, True, True),
    ("softmax output", 2, AS2B, True, False),
    ("softmax dropout mask", 1, AS2B, True, False),
    ("dropout output, attention over V", 2, AS2B, True, False),
    ("V, attention over V", 2, SBH, True, True),
    ("output projection input", 2, SBH, True, True),
    ("attention dropout mask", 1, SBH, False, True),
    ("MLP first linear input", 2, SBH, False, True),
    ("GeLU input", 8, SBH, True, True),
    ("MLP second linear input", 8, SBH, True, True),
    ("MLP dropout mask", 1, SBH, False, True),
]
RECOMPUTE = ("none", "selective", "full")
LINEAR_INPUTS = ("QKV matmul input", "output projection input", "MLP first linear input",
                 "MLP second linear input")


def megatron_activation_bytes(s, b, h, a, t=1, sp=False, recompute="none", fp8=False):
    """Bytes one transformer layer holds for backward, Megatron's model, exactly (a Fraction):
    sbh(34 + 5as/h) alone; sbh(10 + 24/t + 5as/ht) with tensor parallelism t; sbh(34/t +
    5as/ht) with sequence parallelism too (it splits the ops tp leaves whole); selective
    recompute drops the 5as/h terms; full recompute keeps the layer's input, 2sbh (/t with sp).
    ``fp8``: the four linears' saved inputs in FP8 with a float32 scale per 1 x 128 tile."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: Megatron's model knows {RECOMPUTE}")
    if recompute == "full":
        return Fraction(2 * s * b * h, t if sp else 1)
    total = Fraction(0)
    for what, k, unit, split, kept in MEGATRON_LAYER:
        if recompute == "selective" and not kept:
            continue
        size = s * b * h if unit == SBH else a * s * s * b
        if fp8 and what in LINEAR_INPUTS:  # 2 bytes an element become 1 + 4/128
            k = Fraction(k, 2) * (1 + Fraction(4, 128))
        total += Fraction(k * size, t if split or sp else 1)
    return total
