"""Step time and memory per GPU of one layout, by kind, from the library's own formulas.

Compute kernel by kernel on a GPU (``kernels.py``: GEMMs by shape, the rest by bytes), by
minipar's measured engine on ``here``; every collective by
``comm.cost.predict`` over the link its group spans (the rank grid says which); the bubble by
the schedule simulator run with the predicted stage times; memory from ``model_state_bytes``
and ``activations.py`` (or Megatron's). What overlaps what, and what is counted: docs/plan.md.

    cluster = Cluster(gpus=1024, gpus_per_node=8, profile=PROFILES["h100"])
    p = predict(PRESETS["gpt3-175b"].shape, Layout(tp=8, pp=8, dp=16), cluster, global_batch=1536)
    p["time_s"]["total"], p["memory_bytes"]["total"], p["mfu"]
"""
import dataclasses
import functools

from minipar.comm import cost
from minipar.parallel.groups import RankGrid
from minipar.parallel.pipeline import (balanced_split, build, cost_by_stage, makespan,
                                       peak_inflight, simulate, stage_costs, unit_cost)
from minipar.parallel.pipeline.schedules import CHUNKED, chunks_of

from .activations import layout_activation_bytes
from .flops import layer_gemms, model_flops, step_flops
from .hardware import gemms_seconds
from .kernels import head_seconds, layer_seconds, optimizer_seconds
from .layout_bytes import rank_modules
from .memory import bytes_per_parameter, megatron_activation_bytes, model_state_bytes

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
# how attention reaches the cp group's other tokens (Trainer3D's cp_comm, Megatron's
# --cp-comm-type): ring attention's k/v blocks, or Ulysses' all-to-alls
CP_COMMS = ("ring", "a2a")
# A thousand times the largest cluster yet; its divisors come from trial division up to its
# square root (5·10^5 odd trials at most), so any count allowed is factored in under a second.
MAX_GPUS = 10 ** 12


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "selective"
    schedule: str = "1f1b"
    chunks: int = None       # model chunks per pipeline rank (interleaved; zb-v has 2)
    cp_comm: str = "ring"    # or "a2a": Ulysses' all-to-alls over the cp group (CP_COMMS)
    precision: str = "bf16"
    activations: str = None  # "megatron" or "minipar": whose activation model memory_bytes
    #                          uses; None: minipar's on --profile here, Megatron's on a GPU
    sequence_parallel: bool = None  # None: on whenever tp > 1 (Megatron's recipes)
    dp_overlap: bool = True  # the data-parallel exchange hides behind the last backward (False:
    #                          after it, as Megatron-LM's local DDP did in 2021)

    @property
    def gpus(self):
        return self.tp * self.cp * self.dp * self.pp

    @property
    def v(self):
        return chunks_of(self.schedule, self.chunks)

    @property
    def sp(self):
        """Sequence parallelism: as given, else on whenever tp > 1; never at tp = 1."""
        return self.tp > 1 and self.sequence_parallel is not False

    def resolved(self, profile):
        """This layout with its defaults decided for ``profile``: the activation model
        (minipar's where minipar's engine is timed, ``here``; else Megatron's) and sp."""
        activations = self.activations or ("minipar" if profile.engine is not None
                                           else "megatron")
        return dataclasses.replace(self, activations=activations, sequence_parallel=self.sp)


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    profile: object
    gpu_memory: float = None  # bytes; None: the profile's HBM

    def __post_init__(self):
        # each refusal names the flag that gave the number: minipar plan prints it as it is
        for flag, n in (("--gpus", self.gpus), ("--gpus-per-node", self.gpus_per_node)):
            if not isinstance(n, int) or not 1 <= n <= MAX_GPUS:
                raise ValueError(f"{flag} {n}: must be a whole number of GPUs, 1 to {MAX_GPUS:.0e}")
        gb = self.gpu_memory
        if gb is not None and not 0 < gb < float("inf"):  # NaN compares false both ways
            raise ValueError(f"--gpu-memory {gb / 1e9:g}: must be a positive, finite number of "
                             f"GB (1e9 bytes)")

    @property
    def memory(self):
        return self.gpu_memory or self.profile.memory


def spans_nodes(grid, kind, gpus_per_node):
    """Whether rank 0's group of ``kind`` holds ranks of more than one node (ranks fill nodes
    in order, gpus_per_node each): its collectives then run over the inter-node link."""
    # its last rank, counted from the strides: the group itself may hold millions of ranks
    last = sum((grid.sizes[a] - 1) * grid.stride(kind, a) for a in kind.split("-"))
    return last >= gpus_per_node


def expert_parameters(shape):
    """The parameters of the expert MLPs (all layers, all E), which ep splits; the router and
    the rest are replicated. One expert's MLP is what a second expert adds, less its router
    column."""
    if not shape.experts:
        return 0
    one, two = (dataclasses.replace(shape, experts=e, top_k=1).layer_parameters() for e in (1, 2))
    return shape.layers * shape.experts * (two - one - shape.hidden)


@functools.lru_cache(maxsize=None)
def zero3_units(shape, tp, pp, schedule, chunks, ep):
    """The units ZeRO-3 gathers one by one on the pipeline rank holding most (of the first and
    the last): minipar's modules holding parameters (``layer_units``), laid out as
    ``layout_bytes.rank_modules`` lays them. A shape minipar's GPT cannot build (Llama's block,
    a tied head) is counted as its block: 6 modules a layer (two LayerNorms, c_attn, c_proj,
    c_fc, c_proj), and the 4 ends (wte, wpe, ln_f, the head) on the first and last stage."""
    try:
        return max(len(rank_modules(shape, tp, pp, rank, schedule, chunks, ep))
                   for rank in {0, pp - 1})
    except ValueError:
        return -(-6 * shape.layers // pp) + (4 if pp == 1 else 2)


@functools.lru_cache(maxsize=None)
def pipeline_shape(name, p, m, v, passes):
    """(bubble, peak in-flight) of schedule ``name`` in units of one micro-batch's stage time,
    simulated. The bubble (idle time per rank) no longer grows with m once m >= 2p for these
    schedules (the fill and drain are the same; tests/test_plan_cli.py checks it), so at most 2p
    micro-batches are simulated; a schedule that holds every simulated micro-batch at once
    (GPipe) holds all m."""
    simulated = min(m, 2 * p)
    schedule = build(name, p, simulated, v if name in CHUNKED else None)
    # F : B : W = 1 : 1 : 1 of the forward-backward's three passes; full recompute adds one
    # more forward to the backward B
    unit = 1 / passes
    events = simulate(schedule, unit_cost(schedule, unit, unit * (passes - 2), unit))
    bubble = makespan(events) - simulated * 1.0
    peak = max(peak_inflight(events, p))
    return bubble, (m * v if peak >= simulated * v else peak)


def predict(shape, layout, cluster, global_batch):
    """The prediction of one layout as a dict: ``memory_bytes`` and ``time_s`` by kind,
    ``flops_per_step``, ``tokens_per_s``, ``mfu``, ``fits`` (the keys of ``minipar plan
    --json``). The layout must be valid (search.check)."""
    hw = cluster.profile
    L = layout.resolved(hw)
    s, b, h, layers = shape.seq, L.micro_batch, shape.hidden, shape.layers
    # bytes per element of what goes over the links: activations (and their gradients),
    # gradients and parameters; FP8's carry their scales (message_widths)
    width, grad_width, param_width = message_widths(L.precision)
    m = global_batch // (L.dp * b)  # micro-batches per step
    grid = RankGrid(L.gpus, tp=L.tp, pp=L.pp, cp=L.cp, ep=L.ep)
    link = {kind: hw.link(not spans_nodes(grid, kind, cluster.gpus_per_node))
            for kind in ("tp", "dp-cp", "pp", "cp", "ep", "edp")}
    full = L.recompute == "full"

    def comm_time(collective, algorithm, p, nbytes, model):
        # each collective by comm.cost's formula, plus what it waits for its ranks to arrive
        # (``Profile.sync``, measured on this machine's ranks; 0 on a GPU profile)
        return cost.predict(collective, algorithm, p, nbytes, model) + hw.sync
    passes = 4 if full else 3  # forward, backward (2x), and the recomputed forward

    executed, model = step_flops(shape, global_batch, L.recompute), model_flops(shape,
                                                                                global_batch)
    if hw.engine is not None:  # this machine: minipar's own costs, measured (hardware.Engine)
        compute = engine_seconds(shape, L, hw.engine, m, passes)
        per_mb = compute / m
    else:  # a GPU: the last stage's layers and the head, kernel by kernel, then Adam's step
        per_mb = (layer_seconds(shape, L, hw) * layers / L.pp
                  + head_seconds(shape, L, hw))
        compute = m * per_mb + optimizer_seconds(rank_parameters(shape, L), L.precision, hw)
    # tensor parallel with sequence parallelism (Korthikanti et al.): per layer, 2 all-gathers
    # and 2 reduce-scatters of the s/cp x b x h activation in the forward, as many in the
    # backward, again in the recomputed forward; exposed (nothing overlaps them)
    act = s // L.cp * b * h * width
    tp_pair = 0
    if L.tp > 1 and L.sp:  # FP8 gathers the norms' outputs in FP8, reduces in bf16
        tp_pair = (comm_time("all_gather", "ring", L.tp, act, link["tp"]) + comm_time(
            "reduce_scatter", "ring", L.tp, act * grad_width / width, link["tp"]))
    elif L.tp > 1:  # without sp: one all-reduce of the whole activation in its place
        tp_pair = comm_time("all_reduce", "ring", L.tp, act * grad_width / width, link["tp"])
    tp_per_mb = 2 * (passes - 1) * tp_pair * layers / L.pp
    tp_step = 0
    if hw.engine is not None and L.tp > 1:
        tp_per_mb, tp_step = minipar_tp_extras(shape, L, link["tp"], tp_pair, tp_per_mb,
                                               comm_time)
    # context parallel, per layer and micro-batch, exposed (cp_bytes: the bytes a rank sends).
    # ring attention: k and v of the whole sequence go round the cp ring in the forward (an
    # all-gather: (cp-1)/cp of them per rank), and again with their gradients in the backward
    # (all-gather + reduce-scatter). Ulysses (a2a): 4 all-to-alls of the rank's b x s/cp x h/tp
    # (q, k, v, then the output) in the forward, as many in the backward and in a recomputed
    # forward
    cp_time = 0
    if L.cp > 1:
        if L.cp_comm == "a2a":
            one = comm_time("all_to_all", "pairwise", L.cp, a2a_block(shape, L, width),
                            link["cp"])
            cp_time = 4 * (passes - 1) * one * layers / L.pp
        else:
            kv = kv_block(shape, L, width)
            gather = comm_time("all_gather", "ring", L.cp, kv, link["cp"])
            cp_time = (gather * (passes - 1) + comm_time("reduce_scatter", "ring", L.cp, kv,
                                                        link["cp"])) * layers / L.pp
    # expert parallel: per MoE layer the tokens go to their top_k experts' ranks and come back
    # (2 all-to-alls of the rank's s/cp x b tokens x top_k, split over tp by sp) in the forward,
    # as many in the backward and in a recomputed forward; exposed
    ep_time = 0
    if L.ep > 1:
        routed = act * shape.top_k // L.tp
        ep_time = 2 * (passes - 1) * comm_time("all_to_all", "pairwise", L.ep, routed,
                                               link["ep"]) * layers / L.pp
    # the stage time of one micro-batch, its compute and the communication inside it
    stage = per_mb + tp_per_mb + cp_time + ep_time
    # pipeline: each micro-batch's activation forward and its gradient back, one message each
    # (a broadcast to 2 ranks is one message: alpha + n beta(n)) per chunk, not overlapped
    p2p = act // (L.tp if L.tp > 1 else 1)
    pp_time = (2 * m * L.v * comm_time("broadcast", "binomial", 2, p2p, link["pp"])
               if L.pp > 1 else 0)
    bubble_units, inflight = pipeline_shape(L.schedule, L.pp, m, L.v, passes)
    bubble = bubble_units * stage
    if hw.engine is not None and L.pp > 1:  # this machine: the trainer's stages, unequal
        bubble = engine_bubble(shape, L, hw.engine, m, passes, stage - per_mb)
    # data parallel over dp x cp (each cp rank saw other tokens of the same samples): ZeRO
    # 0 all-reduces the gradients once a step, 1 reduce-scatters them and all-gathers the
    # updated parameters, 2 reduce-scatters every micro-batch's, 3 also gathers the
    # parameters for each forward and backward. Stages 0-2 overlap it with the last
    # micro-batch's backward; stage 3 with all of the compute.
    # The expert MLPs' gradients go over the expert-data group (dp·cp/ep ranks), the rest
    # over dp·cp.
    experts = expert_parameters(shape)
    dp_time = 0
    for group, n, kind in ((L.dp * L.cp, shape.parameters() - experts, "dp-cp"),
                           (L.dp * L.cp // L.ep, experts / L.ep, "edp")):
        if group == 1 or n == 0:
            continue
        local = n / (L.tp * L.pp)

        def c(collective, pieces=1):
            nbytes = local * (param_width if collective == "all_gather" else grad_width)
            return pieces * comm_time(collective, "ring", group, nbytes / pieces, link[kind])
        if L.zero == 0:
            dp_time += c("all_reduce")
        elif L.zero == 3:
            # ZeRO-3 gathers and reduce-scatters unit by unit, each collective paying its own
            # alpha steps: priced as that many equal pieces of the rank's parameters
            units = zero3_units(shape, L.tp, L.pp, L.schedule, L.chunks, L.ep)
            dp_time += m * (c("reduce_scatter", units) + 2 * c("all_gather", units))
        else:
            dp_time += (1 if L.zero == 1 else m) * c("reduce_scatter") + c("all_gather")
    window = compute if L.zero == 3 else stage * (passes - 1) / passes
    if not L.dp_overlap:
        window = 0.0
    # on a machine whose cores the ranks fill (a profile with a measured engine), nothing
    # hides it: the background all-reduce is CPU work, and DDP turns overlap off there
    # (comm.node.overlap_default)
    if hw.engine is not None and L.gpus >= hw.engine.cores:
        window = 0.0
    dp_exposed = max(0.0, dp_time - window)
    comm = m * (tp_per_mb + cp_time + ep_time) + tp_step + pp_time + dp_exposed
    total = compute + comm + bubble

    memory = memory_bytes(shape, L, inflight, m)
    return {"layout": dataclasses.asdict(L) | {"v": L.v, "m": m},
            "memory_bytes": memory,
            "time_s": {"compute": compute, "tp": m * tp_per_mb + tp_step, "cp": m * cp_time,
                       "pp": pp_time, "dp": dp_exposed, "ep": m * ep_time, "comm": comm,
                       "bubble": bubble, "total": total},
            "bytes_sent": {"cp": m * cp_bytes(shape, L, width, passes)},
            "flops_per_step": executed, "model_flops_per_step": model,
            "tokens_per_s": global_batch * s / total,
            "mfu": model / (total * hw.peak(L.precision) * L.gpus),
            "fits": memory["total"] <= cluster.memory}


def kv_block(shape, L, width):
    """Ring attention's all-gathered k and v of one layer: the whole sequence's, this tensor
    rank's kv heads."""
    return 2 * shape.seq * L.micro_batch * shape.kv * (shape.hidden // shape.heads) // L.tp * width


def a2a_block(shape, L, width):
    """One Ulysses all-to-all's buffer: this rank's b x s/cp tokens of its h/tp (q, k, v or the
    output), of which (cp-1)/cp leave the rank (ulysses.py)."""
    return L.micro_batch * (shape.seq // L.cp) * (shape.hidden // L.tp) * width


def cp_bytes(shape, L, width, passes=3):
    """Bytes one rank sends over its context group for one micro-batch, all its layers:
    Ulysses' 4 all-to-alls per layer each pass (forward, backward, a recomputed forward:
    ``passes`` - 1 of them), (cp-1)/cp of ``a2a_block`` each, as tests/test_ulysses_trainer.py
    counts them; ring attention's all-gathers (forward, recompute) and its backward's
    all-gather + reduce-scatter, (cp-1)/cp of ``kv_block`` each, as the planner prices them."""
    if L.cp == 1:
        return 0
    layers = shape.layers // L.pp  # check: pp·v divides the layers
    if L.cp_comm == "a2a":
        return 4 * (passes - 1) * (L.cp - 1) * a2a_block(shape, L, width) // L.cp * layers
    return passes * (L.cp - 1) * kv_block(shape, L, width) // L.cp * layers


def minipar_tp_extras(shape, L, link, tp_pair, tp_per_mb, comm_time):
    """(tp seconds per micro-batch, tp seconds once a step) of minipar's 3D trainer, which
    ``here`` runs: beside the layers' collectives, the GPT's ends gather and scatter the
    sequence too (the embedding's reduce-scatter, the head's all-gather, their backwards: one
    pair each on a stage with both ends, one on the first or last), the vocabulary-parallel
    loss all-reduces three rows of b·s floats (max, sum, target logit) in the forward, and once
    a step every replicated parameter's gradient is all-reduced on its own (6 tensors of h a
    layer, ln_f's 2, wpe's s x h), each by the algorithm ``auto`` picks, paying its alpha.
    (Megatron fuses these; a GPU profile does not price them.)"""
    def all_reduce(nbytes):
        return comm_time("all_reduce", cost.cheapest("all_reduce", cost.AUTO_CANDIDATES, L.tp,
                                                     nbytes, link), L.tp, nbytes, link)
    ends = 2 if L.pp == 1 else 1
    rows = L.micro_batch * shape.seq // L.cp * 4
    tp_per_mb += ends * tp_pair + 3 * all_reduce(rows)
    h = shape.hidden * 4
    step = (6 * shape.layers / L.pp + 2) * all_reduce(h) + all_reduce(shape.seq * h)
    return tp_per_mb, step


def engine_seconds(shape, L, engine, m, passes):
    """One rank's compute in a step on this machine, priced by minipar's measured costs: the
    busiest pipeline rank's m micro-batches of its stages (``stage_seconds``); then AdamW's
    step on the rank's parameters (1/(dp·cp) of them under ZeRO). The whole is a rank's
    alone, so it is multiplied by how much slower ranks compute beside each other
    (``Engine.slowdown``: measured on them, else ranks beyond the cores taking turns)."""
    stages = stage_seconds(shape, L, engine, passes)
    micro = max(sum(stages[s] for s in ranks) for ranks in stages_by_rank(L))
    # a Block's 12 weights and biases (an MoE block: the MLP's 4 are the router's weight and
    # the rank's E/ep experts' 4 each); wte, wpe, ln_f's two and the head
    block_tensors = 12 + (4 * shape.experts // L.ep - 3 if shape.experts else 0)
    tensors = (shape.layers * block_tensors + 5) / L.pp
    # the rank's parameters: ep splits the experts; ZeRO shards every one over dp·cp (the
    # experts' 1/ep over dp·cp/ep)
    experts = expert_parameters(shape)
    elements = (shape.parameters() / (L.dp * L.cp) if L.zero
                else shape.parameters() - experts + experts / L.ep) / (L.tp * L.pp)
    step = engine.tensor * tensors + engine.element * elements
    if L.zero == 3:  # its gathers into slots, hooks and flat gradients, unit by unit, each
        # micro-batch (on one rank a ZeRO3 step of the bench's GPT costs 60 % more than a plain
        # one): measured per unit, at the rank's micro-batch
        units = zero3_units(shape, L.tp, L.pp, L.schedule, L.chunks, L.ep)
        b, s, h = L.micro_batch, shape.seq // L.cp, shape.hidden
        micro += units * engine.zero3_unit_cost(b, s, h, shape.heads, shape.vocab, shape.layers)
    return (m * micro + step) * engine.slowdown(L.gpus)


def stage_seconds(shape, L, engine, passes):
    """One micro-batch's compute, alone on a core, in each of the pp·v pipeline stages as
    minipar's trainer cuts the GPT (``trainer_cut``): a block is its GEMMs timed at its own
    shapes (the rank's tp and cp share), the engine's fixed cost per layer and its element-wise
    passes per byte of the layer's activations (Megatron's count, tp-split as Megatron splits
    them), x passes/3 (a recomputed forward adds a third); the embedding on the first stage,
    the rest of the ends (final LayerNorm, head and loss: per logit) on the head's."""
    s, b, h = shape.seq // L.cp, L.micro_batch, shape.hidden
    activations = float(megatron_activation_bytes(s, b, h, shape.heads, L.tp, L.sp, "none"))
    # minipar runs tp, pp, cp and ep layouts with the 3D (4D) trainer's TensorParallelGPT
    # (hardware.BLOCKS); an MoE layer is its router and the rank's E/ep experts
    block = ("sequence" if L.sp else "tensor" if L.tp > 1 or L.pp > 1 or L.cp > 1 or L.ep > 1
             else "gpt")
    moe = dict(experts=shape.experts, top_k=shape.top_k) if shape.experts else {}
    fixed, per_byte = engine.layer_cost(b, s, h, shape.heads, block, L.cp, **moe)
    layer = (gemms_seconds(layer_gemms(b, shape.seq, h, shape.heads, L.tp, L.cp, ep=L.ep, **moe))
             + fixed + per_byte * activations)
    logits = b * s * shape.vocab // L.tp
    fixed, per_logit = engine.ends_cost(b, s, h, shape.vocab, block)
    ends = gemms_seconds([(1, b * s, h, shape.vocab // L.tp)]) + fixed + per_logit * logits
    embedding = min(ends, engine.embedding_cost(b, s, h, shape.vocab, block))
    costs = trainer_layers(shape, embedding, layer * passes / 3, ends - embedding)
    return stage_costs(costs, trainer_cut(len(costs), L.pp * L.v))


def trainer_layers(shape, embedding, block, head):
    """A value per pipeline layer of the trainer's GPT, in order: the embedding, each block,
    ln_f (0: priced with the head), the head with the loss."""
    return [embedding] + [block] * shape.layers + [0.0, head]


@functools.lru_cache(maxsize=None)
def trainer_cut(n_layers, n_stages):
    """The (start, stop) of each stage's layers: equally many (``balanced_split`` of unit
    costs), as Trainer3D cuts the GPT and ``layout_bytes.rank_modules`` counts it."""
    return tuple(balanced_split([1] * n_layers, n_stages))


def stages_by_rank(L):
    """The stages each pipeline rank holds under L's schedule (ZB-V's in a V)."""
    # the placement does not depend on m; 2p micro-batches are enough for every schedule
    # (DualPipeV needs them)
    plan = build(L.schedule, L.pp, 2 * L.pp, L.chunks) if L.pp > 1 else None
    return [plan.stages_of(r) for r in range(L.pp)] if plan else [[0]]


def engine_bubble(shape, L, engine, m, passes, comm_per_mb):
    """The pipeline's idle time in a step on this machine: L's schedule simulated with each
    stage at its measured cost (``stage_seconds`` x the contention) plus its blocks' share of
    a micro-batch's tp, cp and ep communication (``comm_per_mb``, a rank's), F : B : W as the
    engine's Block splits them (``Engine.fbw``); the makespan less the busiest rank's work. At
    most 2p micro-batches are simulated: each one more adds the busiest rank's work and no idle
    time (the steady state)."""
    stages = [c * engine.slowdown(L.gpus) for c in stage_seconds(shape, L, engine, passes)]
    # a stage's blocks, counted on the trainer's layers as stage_seconds prices them
    counted = trainer_layers(shape, 0, 1, 0)
    blocks = stage_costs(counted, trainer_cut(len(counted), L.pp * L.v))
    stages = [c + n * comm_per_mb * L.pp / shape.layers for c, n in zip(stages, blocks)]
    simulated = min(m, 2 * L.pp)
    schedule = build(L.schedule, L.pp, simulated, L.v if L.schedule in CHUNKED else None)
    # F : B : W as minipar's Block splits them (Engine.fbw); a recomputed forward runs in B
    f, b, w = engine.fbw
    events = simulate(schedule, cost_by_stage(schedule, stages, f, b + f * (passes - 3), w))
    busiest = max(sum(stages[s] for s in schedule.stages_of(r)) for r in range(L.pp))
    return max(0.0, makespan(events) - simulated * busiest)


def memory_bytes(shape, L, inflight, microbatches):
    """Per GPU by kind: model states (params, grads, optimizer = master + moments) sharded over
    dp x cp by ZeRO (the experts' 1/ep over dp·cp/ep); activations at the peak, by minipar's
    model (the worst rank's walk of its schedule over ``microbatches``) or Megatron's
    (``L.activations``: one chunk's layers x the ``inflight`` micro-batch chunks; a dense
    layer: an MoE layer's top_k MLPs are not added); buffers."""
    experts = expert_parameters(shape)
    dense = model_state_bytes(shape.parameters() - experts, L.precision, L.zero, L.dp * L.cp,
                              L.tp, L.pp)
    routed = model_state_bytes(experts / L.ep, L.precision, L.zero, L.dp * L.cp // L.ep, L.tp,
                               L.pp)
    states = {kind: dense[kind] + routed[kind] for kind in dense}
    if L.activations == "minipar":  # its own ops, embedding and loss included
        activations = layout_activation_bytes(shape, L.precision, L.tp, L.cp, L.pp, L.v,
                                              L.micro_batch, L.recompute, microbatches,
                                              L.schedule, L.cp_comm, L.sp)
    elif L.activations == "megatron":  # Korthikanti et al.'s layer, the blocks only
        per_layer = megatron_activation_bytes(shape.seq // L.cp, L.micro_batch, shape.hidden,
                                              shape.heads, L.tp, L.sp, L.recompute,
                                              fp8=L.precision == "fp8")
        activations = float(per_layer) * shape.layers / (L.pp * L.v) * inflight
    else:
        raise ValueError(f"activations={L.activations!r}: the planner has minipar's and "
                         f"megatron's activation models")
    # buffers: ZeRO-3's gathered copy of one layer's parameters, and the pipeline's message
    # pair (activation out, its gradient in) of one micro-batch
    width, _, param_width = message_widths(L.precision)
    layer = shape.layer_parameters() / L.tp * param_width if L.zero == 3 else 0
    p2p = 2 * shape.seq // L.cp * L.micro_batch * shape.hidden * width / L.tp if L.pp > 1 else 0
    kinds = {"params": states["params"], "grads": states["grads"],
             "optimizer": states["master"] + states["moments"], "activations": activations,
             "buffers": layer + p2p}
    return kinds | {"total": sum(kinds.values())}


def message_widths(precision):
    """Bytes an element of (activations, gradients, parameters) takes over a link and in the
    buffers: the precision's width; FP8's one byte plus its float32 scales, one per 1 x 128 tile
    of activations and gradients, one per 128 x 128 block of weights (DeepSeek-V3 §3.3)."""
    if precision == "fp8":
        return 1 + 4 / 128, 1 + 4 / 128, 1 + 4 / 128**2
    width = bytes_per_parameter(precision)["params"]
    return width, width, width


def rank_parameters(shape, L):
    """The parameters one GPU steps: 1/(tp·pp) of the model (the experts' 1/ep), of which ZeRO
    leaves each of the dp·cp ranks its share."""
    experts = expert_parameters(shape)
    local = (shape.parameters() - experts + experts / L.ep) / (L.tp * L.pp)
    return local / (L.dp * L.cp) if L.zero else local
