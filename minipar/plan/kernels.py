"""One micro-batch of a model on a GPU profile, kernel by kernel: each GEMM by its shape
(``gemm.py``), the element-wise kernels and attention's softmax by the bytes they stream.

The kernels are Megatron-LM's (fused LayerNorm, scale-mask-softmax, bias-dropout-add and
bias-GeLU; Llama: RMSNorm, rotary, SwiGLU, no dropout); attention keeps its s x s scores in HBM
(no FlashAttention). Each row below counts what a kernel reads and writes, in the activation's
width w (1-byte dropout masks), split by tp always or only under sequence parallelism.

    layer_seconds(PRESETS["gpt3-175b"].shape, Layout(tp=8, pp=8), PROFILES["h100"])
"""
import collections
import functools

from .gemm import forward_seconds, gemms_seconds, stream_seconds

# units: SBH = s·b·h, SBF = s·b·f (the MLP's inner width), KV = s·b·kv·d, AS2B = (a·s·s)·b
SBH, SBF, KV, AS2B = "sbh", "sbf", "kv", "as2b"
TP, SP = "tp", "sp"  # split by tp always, or only under sequence parallelism
# (what, bytes per element as (times w, plus), unit, split, in the forward?, part of the
# attention core a selective recompute replays?); GPT-2's rows include Megatron's dropout (0.1)
Kernel = collections.namedtuple("Kernel", "what w plus unit split forward core")
GPT2_KERNELS = [
    Kernel("LayerNorm x2", 4, 0, SBH, SP, True, False),
    Kernel("scale-mask-softmax", 2, 0, AS2B, TP, True, True),
    Kernel("attention dropout", 2, 1, AS2B, TP, True, True),
    Kernel("context transpose", 2, 0, SBH, TP, True, False),
    Kernel("bias-dropout-add x2", 6, 2, SBH, SP, True, False),
    Kernel("bias-GeLU", 2, 0, SBF, TP, True, False),
    Kernel("LayerNorm backward x2", 6, 0, SBH, SP, False, False),
    Kernel("softmax backward", 3, 0, AS2B, TP, False, True),
    Kernel("attention dropout backward", 2, 1, AS2B, TP, False, True),
    Kernel("context transpose backward", 2, 0, SBH, TP, False, False),
    Kernel("bias-dropout-add backward and residual x2", 10, 2, SBH, SP, False, False),
    Kernel("GeLU backward", 3, 0, SBF, TP, False, False)]
LLAMA_KERNELS = [
    Kernel("RMSNorm x2", 4, 0, SBH, SP, True, False),
    Kernel("rotary on q", 2, 0, SBH, TP, True, False),
    Kernel("rotary on k", 2, 0, KV, TP, True, False),
    Kernel("scale-mask-softmax", 2, 0, AS2B, TP, True, True),
    Kernel("context transpose", 2, 0, SBH, TP, True, False),
    Kernel("residual add x2", 6, 0, SBH, SP, True, False),
    Kernel("SwiGLU (reads gate and up)", 3, 0, SBF, TP, True, False),
    Kernel("RMSNorm backward x2", 6, 0, SBH, SP, False, False),
    Kernel("rotary backward on q", 2, 0, SBH, TP, False, False),
    Kernel("rotary backward on k", 2, 0, KV, TP, False, False),
    Kernel("softmax backward", 3, 0, AS2B, TP, False, True),
    Kernel("context transpose backward", 2, 0, SBH, TP, False, False),
    Kernel("residual gradients x2", 6, 0, SBH, SP, False, False),
    Kernel("SwiGLU backward (writes dgate and dup)", 5, 0, SBF, TP, False, False)]
# FP8 (per-tile scaling): each linear's input is quantised in the forward and its output's
# gradient in the backward (read 2, write 1, a float32 scale per 128 elements)
FP8_CAST = 2 + 1 + 4 / 128
# bytes per logit of the vocabulary-parallel cross entropy in float32 (Megatron's): the logits
# read and a float32 softmax written, two more passes over it (max, sum), then its gradient
CROSS_ENTROPY = (1, 16)  # (times w, plus)


def products(shape, b, tp=1, cp=1, ep=1):
    """The forward GEMMs of one layer as (batch, m, k, n), one rank's share: QKV by columns
    (q h wide, k and v kv·d each), the heads' QKᵀ and attention over V (s/cp queries, all s
    keys), the output projection by rows; the MLP (GPT-2: h -> f -> h; Llama: gate and up in
    one h -> 2f GEMM, then down) or the router and the rank's E/ep experts on balanced rows."""
    h, f, s, a = shape.hidden, shape.inner, shape.seq, shape.heads
    T, d = b * s // cp, h // a
    qkv = h + 2 * shape.kv * d
    attention = [(1, T, h, qkv // tp), (b * a // tp, s // cp, d, s), (b * a // tp, s // cp, s, d),
                 (1, T, h // tp, h)]
    up = 2 * f if shape.style == "llama" else f
    mlp = [(1, T, h, up // tp), (1, T, f // tp, h)]
    if not shape.experts:
        return attention + mlp
    rows = T * shape.top_k * ep // shape.experts
    return attention + [(1, T, h, shape.experts)] + shape.experts // ep * [
        (1, rows, h, up // tp), (1, rows, f // tp, h)]


def stream_bytes(shape, b, tp, sp, cp, width, which):
    """Bytes one layer's element-wise kernels stream (``which``: "forward", "backward" or
    "core", the attention core's forward a selective recompute replays)."""
    h, f, s, a = shape.hidden, shape.inner, shape.seq // cp, shape.heads
    T = s * b
    f_rows = f * (shape.top_k if shape.experts else 1)
    size = {SBH: T * h, SBF: T * f_rows, KV: T * shape.kv * (h // a), AS2B: a * s * shape.seq * b}
    rows = LLAMA_KERNELS if shape.style == "llama" else GPT2_KERNELS
    total = 0.0
    for k in rows:
        if which == "core" and not (k.core and k.forward) or \
                which != "core" and k.forward != (which == "forward"):
            continue
        split = tp if k.split == TP or sp else 1
        total += (k.w * width + k.plus) * size[k.unit] / split
    return total


def fp8_cast_bytes(shape, b, tp, cp, which):
    """What FP8's quantisation streams in one layer: the linears' inputs (forward) or their
    outputs' gradients (backward), a rank's elements."""
    elements = sum(bb * m * (k if which == "forward" else n)
                   for bb, m, k, n in products(shape, b, tp, cp) if bb == 1)
    return FP8_CAST * elements


def by_precision(gemms, precision):
    """[(precision, gemms)]: under FP8 the linears run in FP8 and attention's per-head
    products in bf16 (Transformer Engine's and torchao's recipes); else all in ``precision``."""
    if precision != "fp8":
        return [(precision, gemms)]
    return [("fp8", [g for g in gemms if g[0] == 1]), ("bf16", [g for g in gemms if g[0] > 1])]


def layer_seconds(shape, layout, profile):
    """Seconds of one layer's forward, backward and recomputation for one micro-batch on one
    GPU of ``profile``: its GEMMs by shape, its kernels by bytes."""
    L = layout
    return _layer(shape, L.micro_batch, L.tp, L.sp, L.cp, L.ep, L.recompute, L.precision,
                  profile)


@functools.lru_cache(maxsize=4096)
def _layer(shape, b, tp, sp, cp, ep, recompute, precision, profile):
    width = 4 if precision == "fp32" else 2  # FP8 keeps the element-wise kernels in bf16
    gemms = products(shape, b, tp, cp, ep)
    forward = sum(forward_seconds(profile, p, g) for p, g in by_precision(gemms, precision))
    backward = sum(gemms_seconds(profile, p, g)
                   for p, g in by_precision(gemms, precision)) - forward

    def streamed(which):
        extra = fp8_cast_bytes(shape, b, tp, cp, which) if precision == "fp8" and \
            which != "core" else 0
        return stream_seconds(profile, stream_bytes(shape, b, tp, sp, cp, width, which) + extra)
    forward += streamed("forward")
    backward += streamed("backward")
    if recompute == "full":
        return 2 * forward + backward
    if recompute == "selective":  # the attention core (QKᵀ, softmax, dropout, over V) again
        core = forward_seconds(profile, "bf16" if precision == "fp8" else precision, gemms[1:3])
        return forward + backward + core + streamed("core")
    return forward + backward


def head_seconds(shape, layout, profile):
    """Seconds of the last stage's extras for one micro-batch: the final norm, the logits
    GEMM (forward and backward, V/tp columns) and the vocabulary-parallel cross entropy."""
    L = layout
    T, h = L.micro_batch * shape.seq // L.cp, shape.hidden
    width = 4 if L.precision == "fp32" else 2
    precision = "bf16" if L.precision == "fp8" else L.precision  # the head stays in bf16
    logits = T * shape.vocab // L.tp
    w, plus = CROSS_ENTROPY
    norm = 5 * width * T * h / (L.tp if L.sp else 1)
    return gemms_seconds(profile, precision, [(1, T, h, shape.vocab // L.tp)]) + stream_seconds(
        profile, (w * width + plus) * logits + norm)


def optimizer_seconds(parameters, precision, profile):
    """Seconds of an Adam step over ``parameters`` on one GPU: the gradient and the parameter
    read and written in their widths, the float32 master and two moments read and written."""
    width = {"fp32": 4, "fp8": 1}.get(precision, 2)
    master = 0 if precision == "fp32" else 8
    return stream_seconds(profile, parameters * (2 * width + master + 16))
