"""FLOPs per training iteration of a GPT, counted from its matrix multiplications (Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
§5.1 and Appendix): B sequences of s tokens, l layers of width h, vocabulary V.

    F = 96·B·s·l·h²·(1 + s/6h + V/16lh)    with full activation recomputation
    F = 72·B·s·l·h²·(1 + s/6h + V/12lh)    without

    flops_per_iteration(B=1536, s=2048, l=96, h=12288, V=51200, recompute=True)
"""
import dataclasses


def layer_forward_flops(B, s, h):
    """One transformer layer's forward matmuls, 2 FLOPs per multiply-add (Appendix): QKV
    (6Bsh²), QKᵀ (2Bs²h), attention over V (2Bs²h), output projection (2Bsh²), MLP h -> 4h
    -> h (16Bsh²): 24Bsh² + 4Bs²h."""
    return 24 * B * s * h * h + 4 * B * s * s * h


def layer_gemms(B, s, h, heads, tp=1, cp=1, experts=0, top_k=1, ep=1):
    """The forward matmuls of one layer as (batch, m, k, n), one rank's share under tp (Megatron's
    split: QKV and the first MLP matmul by columns, both output projections by rows, heads/tp
    heads each) and cp (its s/cp queries against all s keys): the shapes ``layer_forward_flops``
    counts, 2·batch·m·k·n FLOPs each. A backward runs two of the same FLOPs, dX = dY Wᵀ (m, n, k)
    and dW = Xᵀ dY (k, m, n). With ``experts`` (minipar's MoE layer) the MLP's two products are
    the router's (h -> E) and, for each of the rank's E/ep experts, its MLP on the rows routed
    to it: T·top_k·ep/E when routing is balanced (the capacity factor keeps it near)."""
    T, q, d = B * s // cp, s // cp, h // heads
    attention = [(1, T, h, 3 * h // tp), (B * heads // tp, q, d, s), (B * heads // tp, q, s, d),
                 (1, T, h // tp, h)]
    if not experts:
        return attention + [(1, T, h, 4 * h // tp), (1, T, 4 * h // tp, h)]
    rows = T * top_k * ep // experts
    return attention + [(1, T, h, experts)] + experts // ep * [(1, rows, h, 4 * h // tp),
                                                               (1, rows, 4 * h // tp, h)]


def flops_per_iteration(B, s, l, h, V, recompute=False):
    """Model FLOPs of one iteration, an exact integer: the backward pass costs two forwards,
    full recomputation one more forward of every layer (not of the logits, computed once);
    the logit layer, B·s tokens x h x V, is 2BshV forward and 6BshV in all."""
    passes = 4 if recompute else 3
    return passes * l * layer_forward_flops(B, s, h) + 3 * 2 * B * s * h * V


def training_seconds(tokens, params, gpus, flops_per_gpu, recompute=True):
    """The paper's end-to-end estimate (§5.1): 8TP/(nX) seconds for T tokens, P parameters, n
    GPUs at X FLOP/s each, the formula above with its small terms dropped (72 -> 6TP without
    recomputation): GPT-3 175B on 300B tokens, 1024 GPUs at 140 TFLOP/s, 34 days."""
    return (8 if recompute else 6) * tokens * params / (gpus * flops_per_gpu)


def expert_flops_per_iteration(B, s, l, h, experts, top_k, recompute=False):
    """What an MoE model (minipar's ``nn.MoEBlock``: a router h x E, top-k of E expert MLPs of
    4h) adds to ``flops_per_iteration``'s dense count: each token's MLP runs in top_k experts
    instead of one (16Bsh² forward each), and the router's logits (2BshE forward)."""
    passes = 4 if recompute else 3
    return passes * l * ((top_k - 1) * 16 * B * s * h * h + 2 * B * s * h * experts)


def shape_layer_flops(shape, B):
    """One layer's forward matmul FLOPs for B sequences of any family: QKV (q h wide, k and v
    kv·d each), the output projection, the MLP (GPT-2's two h x f matrices, Llama's three; with
    experts, top_k of them and the router), QKᵀ and attention over V (4Bs²h)."""
    h, s, f = shape.hidden, shape.seq, shape.inner
    qkv = h + 2 * shape.kv * (h // shape.heads)
    mlp = (3 if shape.style == "llama" else 2) * h * f
    if shape.experts:
        mlp = shape.top_k * mlp + h * shape.experts
    return 2 * B * s * (h * qkv + h * h + mlp) + 4 * B * s * s * h


def step_flops(shape, B, recompute="none"):
    """The matmul FLOPs one step executes (``flops_per_step``): forward and backward (2x) of
    every layer and of the logits, and what recomputation replays: full, every layer's forward
    again (Narayanan's 96·B·s·l·h²(1 + s/6h + V/16lh) for a GPT, exactly); selective, the
    attention core's QKᵀ and attention over V (Korthikanti et al. 2022, §5)."""
    s, l = shape.seq, shape.layers
    layer = shape_layer_flops(shape, B)
    replay = {"full": layer, "selective": 4 * B * s * s * shape.hidden}.get(recompute, 0)
    return l * (3 * layer + replay) + 6 * B * s * shape.hidden * shape.vocab


def model_flops(shape, B):
    """The FLOPs MFU divides (``model_flops_per_step``), PaLM's definition (Chowdhery et al.
    2022, Appendix B): 6N + 12·l·h·s per token, N the parameters a token's matmuls use (not the
    input embedding unless it is the tied head, not learned positions; of an MoE layer, its
    router and top_k experts), whatever is recomputed."""
    h = shape.hidden
    unused = (0 if shape.tied else shape.vocab * h) + (shape.seq * h if shape.style == "gpt2"
                                                       else 0)
    if shape.experts:  # the experts a token does not visit
        one = dataclasses.replace(shape, experts=1, top_k=1).layer_parameters()
        two = dataclasses.replace(shape, experts=2, top_k=1).layer_parameters()
        unused += shape.layers * (shape.experts - shape.top_k) * (two - one - h)
    N = shape.parameters() - unused
    return B * shape.seq * (6 * N + 12 * shape.layers * h * shape.seq)
