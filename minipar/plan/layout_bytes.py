"""Model-state bytes of one rank of a minipar layout, exactly: the bytes its wrappers measure.

``memory.model_state_bytes`` divides Ψ by tp·pp·dp; a real rank holds whole tensors instead:
tensor parallelism splits some (tensor/gpt.py) and replicates the rest, the pipeline gives a
rank whole layers (``balanced_split``, the schedule's ``stages_of``), and ZeRO pads each flat
vector it shards (a bucket, or a ZeRO-3 unit) to a multiple of the data group (``padded_numel``).

    rank_state_bytes(GPTShape(2, 16, 2, 8, 16), "bf16", zero=2, dp=4)
    rank_state_bytes(shape, "fp32", tp=2, pp=2, dp=2, pp_rank=1, schedule="1f1b")
"""
import types

from ..backend.dtypes import dtype
from ..flat import padded_numel
from ..parallel.data.buckets import make_buckets
from ..parallel.pipeline.partition import balanced_split
from ..parallel.pipeline.schedules import build
from .memory import KINDS, bytes_per_parameter


def gpt_layers(shape, ep=1):
    """``nn.GPT(config).to_sequential()``'s layers (embedding, blocks, final LayerNorm, head),
    each a list of its modules (ZeRO-3's units: ``layer_units``), each a list of (parameter
    name, elements, split by tp): TensorParallelGPT splits the token table and the head by
    vocabulary, c_attn and c_fc by columns (with their biases), both c_proj by rows; it
    replicates the positions, the LayerNorms and the row-parallel biases. With experts, each
    block's MLP is ``moe_gpt``'s: a router (replicated) and this expert rank's E/ep experts."""
    if shape.style != "gpt2" or shape.tied or shape.kv != shape.heads \
            or (not shape.experts and shape.inner != 4 * shape.hidden):
        raise ValueError(f"rank_state_bytes models minipar's nn.GPT and moe_gpt (GPT-2 style, "
                         f"untied, kv_heads = heads, a dense MLP 4·hidden wide), not {shape}")
    if (shape.experts or 1) % ep:  # a dense model has no experts to split: ep = 1
        raise ValueError(f"ep={ep} must divide the experts ({shape.experts}) "
                         f"(ExpertParallelMoE)")
    h, f, V = shape.hidden, shape.inner, shape.vocab

    def linear(name, n_in, n_out, column, bias=True):
        return [(f"{name}.weight", n_in * n_out, True)] + \
            ([(f"{name}.bias", n_out, column)] if bias else [])

    def norm(name):
        return [(f"{name}.weight", h, False), (f"{name}.bias", h, False)]

    def mlp(name):
        return [linear(f"{name}.c_fc", h, f, True), linear(f"{name}.c_proj", f, h, False)]

    def block(i):
        name = f"blocks.{i}"
        if shape.experts:  # the router is h x E without bias, replicated: each rank routes
            ffn = [[(f"{name}.mlp.router.weight", h * shape.experts, False)]] + \
                [m for e in range(shape.experts // ep) for m in mlp(f"{name}.mlp.experts.{e}")]
        else:
            ffn = mlp(f"{name}.mlp")
        return [norm(f"{name}.ln_1"), linear(f"{name}.attn.c_attn", h, 3 * h, True),
                linear(f"{name}.attn.c_proj", h, h, False), norm(f"{name}.ln_2"), *ffn]

    embed = [[("embed.wte.weight", V * h, True)], [("embed.wpe.weight", shape.seq * h, False)]]
    blocks = [block(i) for i in range(shape.layers)]
    return [embed, *blocks, [norm("ln_f")], [linear("lm_head", h, V, True, bias=False)]]


def rank_modules(shape, tp=1, pp=1, pp_rank=0, schedule="1f1b", chunks=None, ep=1):
    """The modules pipeline rank ``pp_rank`` holds, each a list of (name, local elements), in
    the order the pipeline hands its parameters to the optimizer: the stages of ``schedule``
    on that rank, each a contiguous run of equally many layers (the pipeline's default)."""
    for what, n in (("hidden", shape.hidden), ("heads", shape.heads), ("vocab", shape.vocab)):
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by tp={tp} (tensor/shard.py)")
    layers = gpt_layers(shape, ep)
    if pp > 1:
        plan = build(schedule, pp, 2 * pp, chunks)  # the placement; DualPipeV needs m >= 2p
        bounds = balanced_split([1] * len(layers), plan.n_stages)
        layers = [layer for s in plan.stages_of(pp_rank) for layer in
                  layers[bounds[s][0]:bounds[s][1]]]
    return [[(name, n // tp if split else n) for name, n, split in module]
            for layer in layers for module in layer]


def bucket_numels(modules, itemsize, bucket_cap_mb=None):
    """Elements of each ZeRO-1/2 bucket: ``make_buckets`` (the wrapper's own rule) over
    stand-ins of the parameters, one param group (None: one bucket)."""
    params = [types.SimpleNamespace(dtype=None, size=n, data=types.SimpleNamespace(
        nbytes=n * itemsize)) for module in modules for _, n in module]
    cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2**20
    return [sum(p.size for p in bucket) for bucket in make_buckets(params, cap)]


def rank_state_bytes(shape, precision="fp32", zero=0, dp=1, tp=1, pp=1, cp=1, pp_rank=0,
                     schedule="1f1b", chunks=None, bucket_cap_mb=None, ep=1):
    """{kind: bytes} (params, grads, master, moments) one rank holds, as the wrappers measure
    them after backward: ZeRO's stage over the data group of dp·cp ranks (gradients averaged
    over both), on pipeline rank ``pp_rank`` of a tp x pp layout with E/ep experts per MoE
    block, Adam with one param group. ZeRO is not combined with experts (as in minipar)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: ZeRO's stages are 0, 1, 2, 3")
    if zero and ep > 1:
        raise ValueError(f"zero={zero} with ep={ep}: minipar's ZeRO does not shard experts")
    per = bytes_per_parameter(precision)
    N = dp * cp
    modules = rank_modules(shape, tp, pp, pp_rank, schedule, chunks, ep)
    n = sum(size for module in modules for _, size in module)
    if zero == 0:
        return {kind: n * per[kind] for kind in KINDS}
    if zero == 3:  # each unit (a module) padded on its own
        shard = sum(padded_numel(sum(s for _, s in m), N) for m in modules) // N
        return {kind: shard * per[kind] for kind in KINDS}
    # ZeRO-1/2: the buckets' flat vectors whole; optimizer state (and stage 2's gradients)
    # of this rank's chunk of each
    flats = sum(padded_numel(b, N) for b in bucket_numels(
        modules, dtype(precision).itemsize, bucket_cap_mb))
    return {"params": flats * per["params"],
            "grads": (flats // N if zero == 2 else n) * per["grads"],
            "master": flats // N * per["master"], "moments": flats // N * per["moments"]}
