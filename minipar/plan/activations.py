"""minipar's own activation model: the bytes each op of its GPT keeps for backward, per rank.

Each row is what one op's backward closure captures (ops.py, functional.py, attention.py,
nn/moe.py, parallel/tensor/, parallel/expert/, parallel/context/ring.py): what
``memory.ActivationMemory`` counts. The table reads beside Megatron's
(``memory.MEGATRON_LAYER``); where they differ and why: docs/plan.md.
Recompute: "full" is ``checkpoint`` around each block, "selective" ``checkpoint`` around the
core attention (``F.attention_heads``); minipar's trainers run neither, a user wraps them. The
model is cast to the precision (the trainers' ``dtype=``), not run under autocast.

    layer_bytes(s=2048, b=1, h=12288, a=96, precision="bf16", tp=8, sp=True)
    rank_activation_bytes(shape, "fp32", tp=2, pp=2, pp_rank=0, microbatches=4)
"""
import collections
import functools

from ..backend.dtypes import dtype
from ..parallel.pipeline.actions import B, BW, F, FB, R, W
from ..parallel.pipeline.partition import balanced_split
from ..parallel.pipeline.schedules import CHUNKED, build

# units: (elements of one row per unit, bytes per element); ACT is the activation dtype's width
SBH, SB, AS2B, ASB, SBV, TOKENS, POSITIONS, ONE = "sbh", "sb", "as2b", "asb", "sbv", "tokens", \
    "s", "1"
# a mixture of experts': E experts, k per token, M = sbk rows through the experts (of width f)
SBE, SBK, SBKH, ASSIGNED, ROWS, MH, MF = "sbE", "sbk", "sbkh", "assigned", "M", "Mh", "Mf"
ACT = None
WIDTH = {SBH: ACT, SB: ACT, ASB: ACT, SBV: ACT, ONE: ACT, AS2B: 4, TOKENS: 1, POSITIONS: 1,
         SBE: ACT, SBK: ACT, SBKH: ACT, MH: ACT, MF: ACT, ASSIGNED: 1, ROWS: 1}
# how tensor parallelism t splits a row: always (heads, columns, vocabulary), only under sequence
# parallelism (the regions between the collectives), or never
TP, SP, WHOLE = "tp", "sp", "whole"
# what a row is: "W" a matmul's input (zero bubble's B keeps it for W), "P" the attention
# probabilities (selective recompute drops them), "qkv" kept by the fused attention only (ring
# attention keeps RING instead), "dropout" only with dropout > 0, "k>1" only with top_k > 1
Op = collections.namedtuple("Op", "what k unit split kind", defaults=("",))

MINIPAR_LAYER = [
    # LayerNorm keeps its normalised x̂ and 1/σ (the backward's formula), not its input
    Op("ln_1: x̂", 1, SBH, SP), Op("ln_1: 1/σ per token", 1, SB, SP),
    # under sp the column-parallel linear keeps the all-gathered input, the whole sequence
    Op("c_attn input (ln_1's output)", 1, SBH, WHOLE, "W"),
    # q, k, v are strided views of c_attn's output: one array, kept whole by the attention
    Op("q, k, v (c_attn's output)", 3, SBH, TP, "qkv"),
    # the scores are computed and normalised in float32 whatever the dtype (attention.py)
    Op("softmax probabilities P, float32", 1, AS2B, TP, "P"),
    Op("attention dropout mask, float32", 1, AS2B, TP, "P dropout"),
    Op("c_proj input (the heads side by side)", 1, SBH, TP, "W"),
    # a dropout mask has the activation's dtype; under sp the slice's base is the whole mask
    Op("attention output dropout mask", 1, SBH, WHOLE, "dropout"),
    Op("ln_2: x̂", 1, SBH, SP), Op("ln_2: 1/σ per token", 1, SB, SP),
    Op("c_fc input (ln_2's output)", 1, SBH, WHOLE, "W"),
    # GeLU keeps its input and σ(2u) (functional.gelu): two 4h-wide arrays
    Op("GeLU input (c_fc's output)", 4, SBH, TP), Op("GeLU σ(2u)", 4, SBH, TP),
    Op("MLP c_proj input (GeLU's output)", 4, SBH, TP, "W"),
    Op("MLP dropout mask", 1, SBH, WHOLE, "dropout"),
]
# nn.MoE in place of the MLP (nn/moe.py): s·b tokens each go to k of E experts, which run the
# M rows expert by expert. Routing is data: the model takes it balanced, s·b·k/E rows per expert,
# none dropped (minipar's capacity, 1.25·sbk/E, keeps them all): M = sbk
MOE_MLP = [
    Op("router input (ln_2's output)", 1, SBH, SP, "W"),
    Op("router probabilities", 1, SBE, SP),
    # gather keeps its index, the top-k experts: (sb, k) int64 on a GPU (NumPy keeps the view's
    # base, the argsort's whole (sb, E) rows)
    Op("top-k experts, int64", 8, ASSIGNED, SP),
    # k > 1: the top-k gates divided by their sum keeps both
    Op("top-k gates", 1, SBK, SP, "k>1"), Op("their sum per token", 1, SB, SP, "k>1"),
    Op("expert-major order of the rows, int64", 8, ROWS, SP),
    # under sp each expert gathers its rows from every tensor rank (SequenceParallelExpert)
    Op("expert input rows", 1, MH, WHOLE, "W"),
    Op("experts' GeLU input and σ(2u)", 2, MF, TP), Op("experts' c_proj input", 1, MF, TP, "W"),
    Op("combine's row of each assignment, int64", 8, ASSIGNED, SP),
    Op("gates (combine's weights)", 1, SBK, SP), Op("each token's k expert outputs", 1, SBKH, SP),
    Op("load-balancing loss l_aux", 1, ONE, WHOLE)]
# TensorParallelMoEGPT (every 4D layout): the all-to-all's arrival order and its inverse
EXPERT_PARALLEL = [Op("arrival order of the rows and its inverse, int64", 16, ROWS, SP)]
# cp > 1: ring attention (context/ring.py) keeps contiguous copies of q, k, v, its output and the
# log-sum-exp per query instead of c_attn's output and P; backward recomputes P block by block
RING_ATTENTION = [Op("q, k, v contiguous copies", 3, SBH, TP),
                  Op("ring output O", 1, SBH, TP), Op("log-sum-exp per query", 1, ASB, TP)]
# the first and last pipeline layers: nn.GPT's (DP, ZeRO) and TensorParallelGPT's (every layout
# with tp, pp or cp > 1: the trainers build it). A constant operand (TensorParallelGPT's
# vocabulary mask) is a leaf: ActivationMemory does not count it
EMBEDDING = [Op("token ids, int64", 8, TOKENS, WHOLE, "W"), Op("positions, int64", 8, POSITIONS,
             WHOLE, "W"), Op("embedding dropout mask", 1, SBH, WHOLE, "dropout")]
HEAD = [Op("ln_f: x̂", 1, SBH, SP), Op("ln_f: 1/σ per token", 1, SB, SP),
        Op("lm_head input (ln_f's output)", 1, SBH, WHOLE, "W"),
        Op("logits (the loss keeps them, or their softmax)", 1, SBV, TP)]
# functional.cross_entropy: softmax(z) in place of the logits (counted with them), row and
# target indices (int64), the kept-target mask
CROSS_ENTROPY = [Op("row and target indices, int64", 16, TOKENS, WHOLE),
                 Op("kept-target mask, bool", 1, TOKENS, WHOLE), Op("their count n", 1, ONE, WHOLE)]
# vocab_parallel_cross_entropy: exp(z − max) of the local vocabulary beside the logits, the sum
VOCAB_PARALLEL_CROSS_ENTROPY = [Op("exp(z − max)", 1, SBV, TP),
                                Op("Σ exp per token", 1, SB, WHOLE),
                                Op("row and local target indices, int64", 16, TOKENS, WHOLE),
                                Op("target-here and kept masks, bool", 2, TOKENS, WHOLE),
                                Op("the count n of kept targets", 1, ONE, WHOLE)]
RECOMPUTE = ("none", "selective", "full")


def table_bytes(ops, s, b, h, a, V, width, t=1, sp=False, dropout=False, experts=(1, 1, 0),
                keys=None):
    """Bytes the rows of ``ops`` hold for s tokens (this rank's: s/cp), micro-batch b;
    ``experts`` = (E, k, f); ``keys``: the tokens each query attends over (default s; Ulysses:
    the whole sequence, s·cp, for a/cp heads: the same bytes as a·s x s·cp)."""
    E, k, f = experts
    M = s * b * k  # balanced routing: every assignment kept
    size = {SBH: s * b * h, SB: s * b, AS2B: a * s * (keys or s) * b, ASB: a * s * b,
            SBV: s * b * V,
            TOKENS: s * b, POSITIONS: s, ONE: 1, SBE: s * b * E, SBK: M, SBKH: M * h,
            ASSIGNED: M, ROWS: M, MH: M * h, MF: M * f}
    total = 0
    for op in ops:
        if "dropout" in op.kind and not dropout or "k>1" in op.kind and k == 1:
            continue
        split = t if op.split == TP or (op.split == SP and sp) else 1
        total += op.k * size[op.unit] * (WIDTH[op.unit] or width) / split
    return total


def layer_rows(ring=False, one_head=False, experts=False, parallel=False):
    """The rows of one block kept for backward: the fused attention's, or the ring's (cp); the
    MLP's, or with ``experts`` the mixture of experts' (``parallel``: TensorParallelMoEGPT's)."""
    rows = MINIPAR_LAYER
    if experts:
        i = next(i for i, op in enumerate(rows) if op.what.startswith("c_fc input"))
        rows = rows[:i] + MOE_MLP + (EXPERT_PARALLEL if parallel else [])
    if not ring:
        return rows
    i = next(i for i, op in enumerate(rows) if op.kind == "qkv")
    rows = rows[:i] + RING_ATTENTION + rows[i + 1:]
    if one_head:  # (B, 1, T, d) -> (B, T, d) is a view: c_proj's input is the ring's output
        rows = [op._replace(kind="W") if op.what == "ring output O" else op for op in rows
                if op.what != "c_proj input (the heads side by side)"]
    return [op for op in rows if "P" not in op.kind]


# A segment of a stage: (stored, replay, kept for W). ``stored``: held from its forward to its
# backward; ``replay``: more bytes while its backward runs (a checkpoint's recomputed graph);
# ``W``: what a split backward keeps until W (the matmuls' inputs).
Segment = collections.namedtuple("Segment", "stored replay W")


def segments(layer, s, b, h, a, V, precision="fp32", tp=1, sp=False, cp=1, recompute="none",
             dropout=False, parallel=None, experts=None, cp_comm="ring"):
    """The segments of one pipeline layer ("embedding", "block", "ln_f", "head" with the loss)
    for this rank's s/cp tokens. ``parallel``: TensorParallelGPT (default: any of tp, cp > 1);
    ``experts`` = (E, k, f): the blocks are MoEBlocks. ``cp_comm="a2a"`` (Ulysses): after the
    all-to-alls the rank's attention is the plain one over the whole sequence of a/(tp·cp)
    heads: it keeps q, k, v (the same bytes as c_attn's output) and P of s x s/cp per head of
    the a/tp, and no ring rows."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: minipar's model knows {RECOMPUTE}")
    width = dtype(precision).itemsize
    s = s // cp
    parallel = tp > 1 or cp > 1 if parallel is None else parallel
    ulysses = cp > 1 and cp_comm == "a2a"
    args = dict(s=s, b=b, h=h, a=a, V=V, width=width, t=tp, sp=sp, dropout=dropout,
                experts=experts or (1, 1, 0), keys=s * cp if ulysses else None)

    def seg(rows):
        return Segment(table_bytes(rows, **args), 0, table_bytes(
            [op for op in rows if op.kind == "W"], **args))

    if layer == "embedding":
        return [seg(EMBEDDING)]
    if layer == "ln_f":
        return [seg(HEAD[:2])]
    if layer == "head":
        return [seg(HEAD[2:] + (VOCAB_PARALLEL_CROSS_ENTROPY if parallel else CROSS_ENTROPY))]
    ring = cp > 1 and not ulysses
    rows = layer_rows(ring=ring, one_head=a == tp, experts=bool(experts), parallel=parallel)
    if recompute == "full":  # checkpoint(block, x): the block's input only, its graph replayed
        kept = table_bytes([Op("block input", 1, SBH, SP)], **args)
        return [Segment(kept, table_bytes(rows, **args), 0)]
    if recompute == "selective" and not ring:  # checkpoint(attention_heads, qkv, n_head)
        i = next(i for i, op in enumerate(rows) if op.kind == "qkv") + 1
        probabilities = [op for op in rows if "P" in op.kind]
        rest = [op for op in rows[i:] if "P" not in op.kind]
        return [seg(rows[:i]), Segment(0, table_bytes(probabilities, **args), 0), seg(rest)]
    return [seg(rows)]  # ring attention keeps no P: selective changes nothing under cp


def layer_bytes(s, b, h, a, precision="bf16", tp=1, sp=False, cp=1, recompute="none",
                dropout=False, cp_comm="ring"):
    """Bytes one block keeps between its forward and its backward (a checkpoint's replay not
    counted): the minipar counterpart of ``megatron_activation_bytes``."""
    return sum(g.stored for g in segments("block", s, b, h, a, 1, precision, tp, sp, cp,
                                          recompute, dropout, cp_comm=cp_comm))


def stage(segs):
    """(stored, backward bump, kept for W) of a stage: the bump is the most its backward adds
    above ``stored`` (segments go back in reverse, each freed after its backward runs)."""
    stored = prefix = sum(g.stored for g in segs)
    bump = 0
    for g in reversed(segs):  # while g's backward runs, the segments before it and g are held
        bump = max(bump, prefix + g.replay - stored)
        prefix -= g.stored
    return stored, bump, sum(g.W for g in segs)


def gpt_segments(shape, micro_batch=1, precision="fp32", tp=1, sp=False, cp=1,
                 recompute="none", dropout=False, parallel=None, strict=True, cp_comm="ring"):
    """Segments of each of ``nn.GPT.to_sequential()``'s layers (``moe_gpt``'s with experts),
    the loss with the head. Other blocks (Llama-style, grouped-query) are refused, or with
    ``strict=False`` counted as nn.GPT's block of the same s, h, a (as the planner counts their
    FLOPs)."""
    if strict and (shape.style != "gpt2" or shape.kv != shape.heads
                   or not shape.experts and shape.inner != 4 * shape.hidden):
        raise ValueError(f"minipar's activation model is nn.GPT's (GPT-2 style, kv_heads = "
                         f"heads, a 4·hidden MLP or experts), not {shape}")
    # with cp an MoE block keeps the ring's rows and the experts' routing of whole sequences
    # (Trainer4D since issue 38), which this model does not count yet
    if strict and shape.experts and (dropout or cp > 1):
        raise ValueError("minipar's activation model has no mixture of experts with dropout or "
                         "context parallelism yet (Trainer4D trains cp > 1 with experts; its "
                         "activations are not modelled)")
    experts = (shape.experts, shape.top_k, shape.inner) if shape.experts else None
    common = (shape.seq, micro_batch, shape.hidden, shape.heads, shape.vocab, precision, tp, sp,
              cp, recompute, dropout, parallel, experts)
    names = ["embedding"] + ["block"] * shape.layers + ["ln_f", "head"]
    # every block is alike
    of = {name: segments(name, *common, cp_comm=cp_comm) for name in set(names)}
    return [of[name] for name in names], names


def rank_activation_bytes(shape, precision="fp32", tp=1, sp=False, cp=1, pp=1, pp_rank=0,
                          schedule="1f1b", chunks=None, microbatches=1, micro_batch=1,
                          recompute="none", dropout=False, parallel=None, ep=1):
    """Peak bytes of activations one rank holds over a training step, as ActivationMemory
    measures it: pipeline rank ``pp_rank``'s stages (``balanced_split`` of the layers, the
    pipeline's default), its actions walked in order: F adds a stage's bytes, B frees them
    (zero bubble: all but the matmul inputs, which W frees), R (re-materialisation) adds them.
    ``parallel``: the trainers' model (default: any of tp, pp, cp, ep > 1)."""
    if parallel is None:
        parallel = tp > 1 or pp > 1 or cp > 1 or ep > 1
    layers, names = gpt_segments(shape, micro_batch, precision, tp, sp, cp, recompute, dropout,
                                 parallel)
    if pp == 1:
        stored, bump, _ = stage([g for layer in layers for g in layer])
        return stored + bump
    plan = build(schedule, pp, microbatches, chunks)
    return walk(plan, pp_rank, stage_summaries(layers, names, plan.n_stages, recompute))


@functools.lru_cache(maxsize=256)
def split(n_layers, n_stages):
    """``balanced_split`` of n layers of equal cost (the pipeline's default), once per size."""
    return balanced_split([1] * n_layers, n_stages)


def stage_summaries(layers, names, n_stages, recompute):
    """{stage: (stored, bump, kept for W)} of the pipeline's stages over ``layers``."""
    summary = {}
    for st, (lo, hi) in enumerate(split(len(layers), n_stages)):
        segs = [g for layer in layers[lo:hi] for g in layer]
        if recompute == "full" and lo > 0 and names[lo] == "block":  # its input is a message
            segs[0] = segs[0]._replace(stored=0)
        summary[st] = stage(segs)
    return summary


def walk(plan, rank, summary):
    """The peak of the rank's live bytes over its actions, ``summary[stage]`` = (stored, bump,
    kept for W). An F&B pair (DualPipeV) is its F, then its backward (``Action.parts``); a BW
    is a whole backward, B and its W in one pass, freeing all of the stage's bytes."""
    live = peak = 0
    adds = (R,) if plan.remat else (F, R)
    for a in (part for action in plan.actions[rank] for part in (
            action.parts if action.kind == FB else (action,))):
        stored, bump, kept = summary.get(a.stage, (0, 0, 0))  # messages have no stage
        if a.kind in adds:
            live += stored
            peak = max(peak, live)
        elif a.kind in (B, BW):
            peak = max(peak, live + bump)
            live -= stored - (kept if plan.split_backward and a.kind == B else 0)
        elif a.kind == W:
            live -= kept
    return peak


schedule_of = functools.lru_cache(maxsize=256)(build)  # the search asks for few, many times


@functools.lru_cache(maxsize=4096)
def layout_activation_bytes(shape, precision, tp, cp, pp, v, micro_batch, recompute,
                            microbatches, schedule="1f1b", cp_comm="ring", sp=None):
    """The planner's activations per GPU, the most any rank holds (sequence parallelism ``sp``,
    None: whenever tp > 1): with pp = 1 the serial peak; with pipelines the walk of every
    rank's schedule (``rank_activation_bytes``'s). A rank's peak stops growing at 2p micro-batches, or grows by
    the same bytes with each one more (GPipe holds them all): p..3p micro-batches are walked
    and the line through 2p and 3p extended to ``microbatches`` (tests/test_plan_activations)."""
    # an MoE model runs in Trainer4D, whose model is TensorParallelMoEGPT at any sizes
    parallel = tp > 1 or pp > 1 or cp > 1 or shape.experts > 0
    sp = tp > 1 if sp is None else sp
    layers, names = gpt_segments(shape, micro_batch, precision, tp, sp, cp, recompute,
                                 parallel=parallel, strict=False, cp_comm=cp_comm)
    if pp == 1:
        stored, bump, _ = stage([g for layer in layers for g in layer])
        return stored + bump

    def peak(m):
        plan = schedule_of(schedule, pp, m, v if schedule in CHUNKED else None)
        summary = stage_summaries(layers, names, plan.n_stages, recompute)
        return max(walk(plan, rank, summary) for rank in range(pp))

    simulated = min(microbatches, 2 * pp)
    low = peak(simulated)
    if microbatches == simulated:
        return low
    more = min(microbatches, 3 * pp)
    return low + (peak(more) - low) * (microbatches - simulated) / (more - simulated)
