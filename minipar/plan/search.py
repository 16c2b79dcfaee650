"""The layout search: every valid tp x pp x dp x cp x ep x ZeRO layout of a cluster, predicted and
ranked by step time among those that fit, each rejected one with its reason.

    ranked, rejected = search(PRESETS["gpt3-175b"].shape, cluster, global_batch=1536)
    ranked[0]["layout"], ranked[0]["time_s"]["total"]      # the fastest layout that fits
    rejected                                               # [(Layout, reason, why), ...]

A size given is fixed; a size left out (None) takes every value that divides the GPUs.
"""
import collections

from minipar.parallel.groups import RankGrid
from minipar.parallel.pipeline.schedules import ArgumentError, check_arguments

from .memory import PRECISIONS, RECOMPUTE
from .time import SCHEDULES, Layout, predict

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
    if L.recompute not in RECOMPUTE or L.schedule not in SCHEDULES:
        raise ValueError(f"--recompute {L.recompute} --schedule {L.schedule}: the planner "
                         f"models {RECOMPUTE} and {SCHEDULES}")
    if L.ep > 1 and not shape.experts:
        raise ValueError(f"--ep {L.ep}: expert parallelism needs --experts")
    try:  # the rank grid's own rules: the GPUs tile into tp x cp x dp x pp, ep divides dp·cp
        RankGrid(cluster.gpus, tp=L.tp, pp=L.pp, cp=L.cp, ep=L.ep)
    except ValueError as err:
        raise LayoutError("divisibility", str(err)) from None
    if L.gpus != cluster.gpus:
        raise LayoutError("divisibility", f"tp·cp·dp·pp = {L.tp}·{L.cp}·{L.dp}·{L.pp} = "
                                          f"{L.gpus} is not the {cluster.gpus} GPUs")
    if cluster.gpus_per_node % L.tp:
        raise LayoutError("tp beyond a node", f"tp={L.tp} does not fit in (divide) a node of "
                                              f"{cluster.gpus_per_node} GPUs")
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
    for broken, why in rules:
        if broken:
            raise LayoutError("divisibility", why)
    # --profile here times minipar's own blocks; its tensor-parallel experts are not timed
    if cluster.profile.engine is not None and shape.experts and L.tp > 1:
        raise LayoutError("not priced here", f"tp={L.tp} with {shape.experts} experts: "
                                             f"--profile here prices MoE layers at tp = 1 only")
    try:
        check_arguments(L.schedule, L.pp, global_batch // (L.dp * L.micro_batch), L.chunks)
    except (ArgumentError, ValueError) as err:
        raise LayoutError("divisibility", f"--schedule {L.schedule}: {err}") from None


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cluster, fixed, experts=0):
    """Every Layout whose tp, pp, cp, dp, ep, zero are ``fixed``'s where given (not None), the
    others each value that divides the GPUs (zero 0-3; ep: each divisor of dp·cp and of the
    ``experts``, 1 without); dp is what the GPUs leave."""
    n = cluster.gpus
    options = {k: [fixed[k]] if fixed.get(k) is not None else divisors(n)
               for k in ("tp", "pp", "cp")}
    zeros = [fixed["zero"]] if fixed.get("zero") is not None else [0, 1, 2, 3]
    rest = {k: v for k, v in fixed.items()
            if k not in ("tp", "pp", "cp", "dp", "ep", "zero") and v is not None}
    for tp in options["tp"]:
        for pp in options["pp"]:
            for cp in options["cp"]:
                dp = fixed.get("dp") or n // (tp * pp * cp)
                if tp * pp * cp * dp != n:
                    continue  # not a layout of this cluster
                eps = ([fixed["ep"]] if fixed.get("ep") is not None else
                       [e for e in divisors(dp * cp) if experts % e == 0] if experts else [1])
                for ep in eps:
                    for zero in zeros:
                        yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero, **rest)


def search(shape, cluster, global_batch, fixed=None):
    """(predictions of the layouts that fit, fastest first; [(layout, reason, why)] of the
    others)."""
    ranked, rejected = [], []
    for layout in layouts(cluster, fixed or {}, shape.experts):
        try:
            check(shape, layout, cluster, global_batch)
        except LayoutError as err:
            rejected.append((layout, err.reason, str(err)))
            continue
        p = predict(shape, layout, cluster, global_batch)
        if p["fits"]:
            ranked.append(p)
        else:
            rejected.append((layout, "memory", f"needs {p['memory_bytes']['total'] / 1e9:.1f} "
                                               f"GB of {cluster.memory / 1e9:.1f}"))
    # equal times (ZeRO 0 and 1 when the exchange hides behind the backward): less memory first
    ranked.sort(key=lambda p: (p["time_s"]["total"], p["memory_bytes"]["total"]))
    return ranked, rejected


def reasons(rejected):
    """{reason: count} of the rejected layouts, in REASONS' order."""
    counts = collections.Counter(reason for _, reason, _ in rejected)
    return {r: counts[r] for r in REASONS if counts[r]}

