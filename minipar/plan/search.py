"""The layout search: every valid tp x pp x dp x cp x ep x ZeRO layout of a cluster, predicted and
ranked by step time among those that fit, each rejected one with its reason.

    ranked, rejected = search(PRESETS["gpt3-175b"].shape, cluster, global_batch=1536)
    ranked[0]["layout"], ranked[0]["time_s"]["total"]      # the fastest layout that fits
    rejected                            # [(Layout, reason, why, count), ...]

A size given is fixed; a size left out (None) takes every value that divides the GPUs.
"""
import collections
import dataclasses

from minipar.parallel.groups import RankGrid
from minipar.parallel.pipeline.schedules import ArgumentError, check_arguments

from .memory import PRECISIONS, RECOMPUTE
from .time import CP_COMMS, SCHEDULES, Layout, predict

REASONS = ("tp beyond a node", "divisibility", "not priced here", "memory")


class LayoutError(ValueError):
    """A layout the planner refuses: ``reason`` is one of REASONS, ``str()`` says why."""

    def __init__(self, reason, why):
        super().__init__(why)
        self.reason = reason


def check(shape, layout, cluster, global_batch):
    """Raise LayoutError if ``layout`` cannot run ``shape`` on ``cluster``; options the planner
    does not model are ValueErrors naming the option."""
    L = layout
    if L.precision not in PRECISIONS:
        raise ValueError(f"--precision {L.precision}: the planner models {', '.join(PRECISIONS)}")
    if L.precision == "fp8":  # once per tiling: a billion GPUs' search checks 48,400
        check_fp8(L.resolved(cluster.profile), cluster.profile)
    if L.recompute not in RECOMPUTE or L.schedule not in SCHEDULES:
        raise ValueError(f"--recompute {L.recompute} --schedule {L.schedule}: the planner "
                         f"models {RECOMPUTE} and {SCHEDULES}")
    if L.cp_comm not in CP_COMMS:
        raise ValueError(f"--cp-comm {L.cp_comm}: the planner models {', '.join(CP_COMMS)} "
                         f"(ring attention, Ulysses' all-to-alls)")
    if L.ep > 1 and not shape.experts:
        raise ValueError(f"--ep {L.ep}: expert parallelism needs --experts")
    # the cheap rule first: of a billion GPUs' 48,400 tilings, 39,380 put tp beyond a node
    if cluster.gpus_per_node % L.tp:
        raise LayoutError("tp beyond a node", f"tp={L.tp} does not fit in (divide) a node of "
                                              f"{cluster.gpus_per_node} GPUs")
    try:  # the rank grid's own rules: the GPUs tile into tp x cp x dp x pp, ep divides dp·cp
        RankGrid(cluster.gpus, tp=L.tp, pp=L.pp, cp=L.cp, ep=L.ep)
    except ValueError as err:
        raise LayoutError("divisibility", str(err)) from None
    if L.gpus != cluster.gpus:
        raise LayoutError("divisibility", f"tp·cp·dp·pp = {L.tp}·{L.cp}·{L.dp}·{L.pp} = "
                                          f"{L.gpus} is not the {cluster.gpus} GPUs")
    rules = [(shape.heads % L.tp, f"tp={L.tp} does not divide heads={shape.heads}"),
             (shape.kv % L.tp, f"tp={L.tp} does not divide kv_heads={shape.kv}"),
             (shape.layers % (L.pp * L.v),
              f"pp·chunks = {L.pp}·{L.v} does not divide layers={shape.layers}"),
             (global_batch % (L.dp * L.micro_batch),
              f"dp·micro-batch = {L.dp}·{L.micro_batch} does not divide the global batch "
              f"{global_batch}"),
             (L.cp > 1 and shape.seq % (2 * L.cp),
              f"2·cp = {2 * L.cp} does not divide seq={shape.seq} (ring attention's halves)"),
             (shape.experts % L.ep, f"ep={L.ep} does not divide experts={shape.experts}")]
    if L.cp > 1 and L.cp_comm == "a2a":  # Trainer3D's cp_attention: whole heads per cp rank
        rules.append((shape.heads % (L.tp * L.cp),
                      f"--cp-comm a2a: tp·cp = {L.tp}·{L.cp} = {L.tp * L.cp} does not divide "
                      f"heads={shape.heads} (Ulysses needs whole heads per cp rank: "
                      f"heads/(tp·cp) = {shape.heads}/{L.tp * L.cp})"))
    m = global_batch // (L.dp * L.micro_batch)
    if L.schedule == "dualpipev":  # pp = 1 too: predict simulates its one-rank V
        rules.append((m < 2 * L.pp,
                      f"--schedule dualpipev needs m >= 2·pp micro-batches: m = global batch / "
                      f"(dp·micro-batch) = {global_batch}/({L.dp}·{L.micro_batch}) = {m} < "
                      f"2·{L.pp} = {2 * L.pp} (torch's ScheduleDualPipeV)"))
    for broken, why in rules:
        if broken:
            raise LayoutError("divisibility", why)
    # --profile here times minipar's own blocks; its tensor-parallel experts are not timed
    # ... and its cp attention is ring attention looped back (hardware.LoopbackRing)
    if cluster.profile.engine is not None and L.cp > 1 and L.cp_comm == "a2a":
        raise LayoutError("not priced here", f"--cp-comm a2a with cp={L.cp}: --profile here "
                                             f"times ring attention only")
    if cluster.profile.engine is not None and shape.experts and L.tp > 1:
        raise LayoutError("not priced here", f"tp={L.tp} with {shape.experts} experts: "
                                             f"--profile here prices MoE layers at tp = 1 only")
    try:
        check_arguments(L.schedule, L.pp, global_batch // (L.dp * L.micro_batch), L.chunks)
    except (ArgumentError, ValueError) as err:
        raise LayoutError("divisibility", f"--schedule {L.schedule}: {err}") from None


def check_fp8(L, profile):
    """FP8 needs a GPU whose data sheet gives an FP8 peak, and Megatron's activation model
    (minipar's own ops have no FP8 kernels): else a ValueError naming what refuses it."""
    if profile.engine is not None:
        raise ValueError("--precision fp8: --profile here times minipar's NumPy engine, which "
                         "has no FP8 kernels")
    profile.peak("fp8")  # names the GPU when its data sheet has none
    if L.activations == "minipar":
        raise ValueError("--precision fp8 --activations minipar: minipar's activation model "
                         "has no FP8 ops (--activations megatron prices FP8's saved inputs)")


def divisors(n):
    """The divisors of n in ascending order, from its prime factors (trial division up to
    sqrt(n)): a billion GPUs have 100, found in 3·10^4 steps where counting to n takes 10^9."""
    found, p = [1], 2
    while n > 1:
        if p * p > n:
            p = n  # what is left is prime
        power = 1
        while n % p == 0:
            n //= p
            power += 1
        # each divisor so far times p, p², ..., one product per power of p in n
        found = [d * p ** k for d in found for k in range(power)]
        p += 1 if p == 2 else 2
    return sorted(found)


def layouts(cluster, fixed, experts=0, heads=1):
    """Every tiling (a Layout but for its ZeRO stage, zero=None) whose tp, pp, cp, dp, ep are
    ``fixed``'s where given (not None), the others each value that divides the GPUs (ep: each
    divisor of dp·cp and of the ``experts``, 1 without); dp is what the GPUs leave. With cp > 1
    and no ``cp_comm`` fixed, each tiling comes with ring attention and, where tp·cp divides
    the ``heads`` and the profile has no engine, with Ulysses' all-to-alls too."""
    n = cluster.gpus
    engineless = cluster.profile.engine is None

    def options(k, left):  # the size given, or each divisor of what the sizes before it leave
        return [fixed[k]] if fixed.get(k) is not None else divisors(left)
    rest = {k: v for k, v in fixed.items()
            if k not in ("tp", "pp", "cp", "dp", "ep", "zero", "cp_comm") and v is not None}
    for tp in options("tp", n):
        for pp in options("pp", n // tp):
            for cp in options("cp", n // (tp * pp)):
                dp = fixed.get("dp") or n // (tp * pp * cp)
                if tp * pp * cp * dp != n:
                    continue  # not a layout of this cluster
                eps = ([fixed["ep"]] if fixed.get("ep") is not None else
                       [e for e in divisors(dp * cp) if experts % e == 0] if experts else [1])
                # cp > 1: ring attention, and Ulysses where it is possible (whole heads per
                # rank, a profile that prices it), unless --cp-comm fixed one
                comms = ([fixed["cp_comm"]] if fixed.get("cp_comm") is not None else
                         ["ring"] if cp == 1 else
                         ["ring", "a2a"] if heads % (tp * cp) == 0 and engineless else ["ring"])
                for ep in eps:
                    for comm in comms:
                        yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=None,
                                     cp_comm=comm, **rest)


def search(shape, cluster, global_batch, fixed=None):
    """(predictions of the layouts that fit, fastest first; [(layout, reason, why, count)] of
    the others: a tiling that check refuses is one entry, zero=None, counting each ZeRO stage
    tried)."""
    fixed = fixed or {}
    zeros = [fixed["zero"]] if fixed.get("zero") is not None else [0, 1, 2, 3]
    ranked, rejected = [], []
    for tiling in layouts(cluster, fixed, shape.experts, shape.heads):
        # check reads every size but zero: once per tiling (a billion GPUs have 48,400 of
        # them), and a refused one is not built four times over
        try:
            check(shape, tiling, cluster, global_batch)
        except LayoutError as err:
            rejected.append((tiling, err.reason, str(err), len(zeros)))
            continue
        for zero in zeros:
            layout = dataclasses.replace(tiling, zero=zero)
            p = predict(shape, layout, cluster, global_batch)
            if p["fits"]:
                ranked.append(p)
            else:
                rejected.append((layout, "memory", f"needs {p['memory_bytes']['total'] / 1e9:.1f}"
                                                   f" GB of {cluster.memory / 1e9:.1f}", 1))
    # equal times (ZeRO 0 and 1 when the exchange hides behind the backward): less memory first
    ranked.sort(key=lambda p: (p["time_s"]["total"], p["memory_bytes"]["total"]))
    return ranked, rejected


def reasons(rejected):
    """{reason: count} of the rejected layouts, in REASONS' order."""
    counts = collections.Counter()
    for _, reason, _, count in rejected:
        counts[reason] += count
    return {r: counts[r] for r in REASONS if counts[r]}

