"""``minipar plan``: predict the memory and step time of a layout, or rank every layout.

    minipar plan --model gpt3-175b --gpus 1024 --tp 8 --pp 8 --zero 1     one layout, by kind
    minipar plan --model gpt3-175b --gpus 1024 --plot plan.png            every layout, ranked
    minipar plan --layers 24 --hidden 1024 --heads 16 --seq 1024 --vocab 50257 \\
        --global-batch 512 --gpus 64 --profile a100 --json

A full layout is --tp, --pp and --zero given (--cp 1 and dp = the rest unless given); with any
of them left out every value is tried. An impossible request (no layout fits, a size that does
not divide, an option the planner does not model) is one line on standard error and exit 2.
The model and its assumptions: docs/plan.md.
"""
import dataclasses
import json
import sys

from minipar.cli.args import positive_int
from minipar.plan import PRESETS, GPTShape, preset
from minipar.plan.hardware import PROFILES, profile
from minipar.plan.notes import notes
from minipar.plan.search import LayoutError, check, reasons, search
from minipar.plan.time import CP_COMMS, SCHEDULES, Cluster, Layout, predict

SHAPE = ("layers", "hidden", "heads", "seq", "vocab")
SIZES = ("tp", "pp", "dp", "cp", "ep")


def add_arguments(parser):
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="PRESET", help=f"one of {', '.join(PRESETS)}")
    for name in SHAPE + ("experts",):
        model.add_argument(f"--{name}", type=positive_int,
                           help="overrides the preset's" if name == "seq" else None)
    model.add_argument("--top-k", type=positive_int, default=1)
    model.add_argument("--global-batch", type=positive_int, help="sequences per step "
                       "(default: the preset's)")
    model.add_argument("--micro-batch", type=positive_int, default=1)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=positive_int, required=True)
    cluster.add_argument("--gpus-per-node", type=positive_int, default=8)
    cluster.add_argument("--gpu-memory", type=float, metavar="GB",
                         help="GPU memory in GB (1e9 bytes; default the profile's)")
    cluster.add_argument("--profile", default="h100", help=f"{', '.join(PROFILES)} or here")
    layout = parser.add_argument_group("layout (a size left out is searched)")
    for name in SIZES:
        layout.add_argument(f"--{name}", type=positive_int)
    layout.add_argument("--zero", type=int, help="ZeRO stage 0, 1, 2, 3")
    layout.add_argument("--recompute", default="selective", help="none, selective, full")
    layout.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    layout.add_argument("--cp-comm", help=f"{', '.join(CP_COMMS)}: cp's ring attention (default) "
                        f"or Ulysses' all-to-alls (a ranking left without it tries both)")
    layout.add_argument("--chunks", type=positive_int, help="chunks per rank (interleaved)")
    layout.add_argument("--precision", default="bf16", help="fp32, bf16, fp16, fp8 (FP8 "
                        "weights, activations and messages with their scales)")
    layout.add_argument("--activations", choices=("minipar", "megatron"),
                        help="activation model: Megatron's (Korthikanti et al.; default on a "
                        "GPU profile) or minipar's own ops (default on --profile here)")
    layout.add_argument("--sequence-parallel", choices=("on", "off"),
                        help="Megatron's sequence parallelism (default on whenever tp > 1)")
    parser.add_argument("--top", type=positive_int, default=10, help="layouts shown (ranking)")
    parser.add_argument("--json", action="store_true", help="print JSON only (docs/plan.md)")
    parser.add_argument("--plot", metavar="FILE", help="memory and step time by kind as stacked "
                        "bars, one per layout shown (needs minipar[plot])")


def model_of(args):
    """(name, GPTShape, global batch) from --model (its --seq and --global-batch overridable:
    a long-context stage changes both) or the shape flags."""
    if args.model:
        given = [f"--{n}" for n in SHAPE + ("experts",) if n != "seq"
                 and getattr(args, n) is not None]
        if given:
            raise ValueError(f"--model {args.model} fixes the shape: drop {' '.join(given)} "
                             f"(--seq and --global-batch may override the preset's)")
        try:
            p = preset(args.model)
        except KeyError as err:
            raise ValueError(f"--model {args.model}: {err.args[0]}") from None
        shape = p.shape if args.seq is None else dataclasses.replace(p.shape, seq=args.seq)
        batch = args.global_batch or p.global_batch
        if batch is None:
            raise ValueError(f"--model {args.model} gives no batch: add --global-batch")
        return args.model, shape, batch
    missing = [f"--{n}" for n in SHAPE if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give --model PRESET or all of {' '.join(missing)}")
    if args.global_batch is None:
        raise ValueError("--global-batch is needed without --model")
    shape = GPTShape(*(getattr(args, n) for n in SHAPE), experts=args.experts or 0,
                     top_k=args.top_k)
    return "custom", shape, args.global_batch


def plan(args):
    """The result as the dict --json prints."""
    name, shape, batch = model_of(args)
    memory = None if args.gpu_memory is None else args.gpu_memory * 1e9
    hw = profile(args.profile)
    cluster = Cluster(args.gpus, args.gpus_per_node, hw, memory)
    common = {"micro_batch": args.micro_batch, "recompute": args.recompute,
              "schedule": args.schedule, "chunks": args.chunks, "precision": args.precision,
              "activations": args.activations,
              "sequence_parallel": {"on": True, "off": False}.get(args.sequence_parallel)}
    head = {"model": name, "parameters": shape.parameters(), "global_batch": batch,
            "seq": shape.seq, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
            "profile": hw.name, "gpu_memory_bytes": cluster.memory,
            "notes": notes(shape, Layout(**common), hw)}
    fixed = ({k: getattr(args, k) for k in SIZES + ("zero",)} | common
             | {"cp_comm": args.cp_comm})
    if args.zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"--zero {args.zero}: ZeRO's stages are 0, 1, 2, 3")
    if None not in (args.tp, args.pp, args.zero):
        dp = args.dp or args.gpus // (args.tp * args.pp * (args.cp or 1))
        layout = Layout(tp=args.tp, pp=args.pp, dp=dp, cp=args.cp or 1, ep=args.ep or 1,
                        zero=args.zero, cp_comm=args.cp_comm or "ring", **common)
        check(shape, layout, cluster, batch)
        return head | predict(shape, layout, cluster, batch)
    ranked, rejected = search(shape, cluster, batch, fixed)
    if not ranked:
        why = ", ".join(f"{n} for {r}" for r, n in reasons(rejected).items()) or "none to try"
        raise ValueError(f"no layout of {name} on {args.gpus} GPUs fits (rejected: {why})")
    return head | {"layouts": len(ranked), "ranked": ranked[:args.top],
                   "rejected": reasons(rejected)}


def run(args):
    try:
        result = plan(args)
    except (LayoutError, ValueError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) else str(err)
        print(f"minipar plan: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else describe(result))
    if args.plot:
        from minipar.figures import FiguresUnavailable, save
        try:
            save(stacked_bars(result), args.plot)
        except FiguresUnavailable as err:  # everything else is out: say what is missing
            print(f"minipar plan: --plot {args.plot} not written: {err}", file=sys.stderr)
            return 1
        except OSError as err:
            print(f"minipar plan: error: --plot: cannot write {args.plot}: {err.strerror}",
                  file=sys.stderr)
            return 2
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def stacked_bars(result):
    """Two panels of stacked bars, a bar per layout (the ranking's, or the one): memory per GPU
    by kind (GB), step time by kind (s), the kinds the table prints."""
    from minipar.figures.style import colour, drawing, new_figure

    @drawing
    def draw():
        shown = result.get("ranked") or [result]
        names = [short(p["layout"]) for p in shown]
        fig, _ = new_figure()
        fig.clear()
        for ax, key, kinds, unit in zip(
                fig.subplots(1, 2), ("memory_bytes", "time_s"),
                (("params", "grads", "optimizer", "activations", "buffers"),
                 ("compute", "tp", "cp", "pp", "dp", "bubble")), (1e9, 1)):
            bottom = [0.0] * len(shown)
            for i, kind in enumerate(kinds):
                values = [p[key][kind] / unit for p in shown]
                ax.bar(names, values, bottom=bottom, color=colour(i), label=kind)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_ylabel("GB per GPU" if key == "memory_bytes" else "seconds per step")
            ax.tick_params(axis="x", labelrotation=30)
            for text in ax.get_xticklabels():
                text.set_horizontalalignment("right")
            ax.legend(fontsize=9)
        fig.suptitle(f"{result['model']} on {result['gpus']} x {result['profile']}")
        return fig
    return draw()


def short(layout):
    """``tp8 pp8 dp16 cp1 zero1`` (``cp2 a2a`` or ``cp2 ring``: how cp attends, and ``ep4``
    before zero when experts are split)."""
    L = layout
    ep = f" ep{L['ep']}" if L["ep"] > 1 else ""
    cp = f" {L['cp_comm']}" if L["cp"] > 1 else ""
    return f"tp{L['tp']} pp{L['pp']} dp{L['dp']} cp{L['cp']}{cp}{ep} zero{L['zero']}"


CP_NAMES = {"ring": "ring attention's k/v blocks", "a2a": "Ulysses' all-to-alls"}


def gb(x):
    return f"{x / 1e9:.1f}"


def describe(r):
    """The readable table of one layout, or of the ranking."""
    lines = [f"{r['model']} ({r['parameters'] / 1e9:.1f}B parameters, batch {r['global_batch']} "
             f"of {r['seq']} tokens) on {r['gpus']} x {r['profile']}, {r['gpus_per_node']} per "
             f"node, {gb(r['gpu_memory_bytes'])} GB each"]
    if "ranked" in r:
        lines.append(f"{r['layouts']} layouts fit; rejected: " + (", ".join(
            f"{n} {why}" for why, n in r["rejected"].items()) or "none"))
        first = r["ranked"][0]
        sp = first["layout"]["sequence_parallel"] if first["layout"]["tp"] > 1 else None
        lines.append(f"{first['layout']['activations']} activations, sequence parallel "
                     + ("whenever tp > 1" if sp is None else "on" if sp else "off")
                     + f", FLOPs/step {first['flops_per_step']:.3e} computed, "
                     f"{first['model_flops_per_step']:.3e} model's (MFU's)")
        lines.append(f"{'rank':>4} {'layout':<28} {'GB/GPU':>7} {'step s':>8} {'bubble':>7} "
                     f"{'comm':>7} {'tokens/s':>10} {'MFU':>6}")
        for i, p in enumerate(r["ranked"], 1):
            L, t = p["layout"], p["time_s"]
            lines.append(f"{i:>4} {short(L):<28} {gb(p['memory_bytes']['total']):>7} "
                         f"{t['total']:>8.3f} {t['bubble']:>7.3f} {t['comm']:>7.3f} "
                         f"{p['tokens_per_s']:>10,.0f} {p['mfu']:>6.1%}")
        return "\n".join(lines + [f"note: {n}" for n in r["notes"]])
    L, mem, t = r["layout"], r["memory_bytes"], r["time_s"]
    lines.append(f"layout {short(L)}, "
                 f"{L['schedule']} (v={L['v']}, m={L['m']} micro-batches of {L['micro_batch']}), "
                 f"{L['recompute']} recompute, {L['precision']}, {L['activations']} activations, "
                 f"sequence parallel {'on' if L['sequence_parallel'] else 'off'}"
                 + (f", cp over {CP_NAMES[L['cp_comm']]} ({r['bytes_sent']['cp']:,} bytes sent "
                    f"a step per GPU)" if L["cp"] > 1 else ""))
    lines.append(f"{'memory per GPU':<16}{'GB':>8}    {'step time':<16}{'s':>9}")
    left = [(k, gb(v)) for k, v in mem.items()]
    right = [(k, f"{v:.4f}") for k, v in t.items()]
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else ("", "")
        b = right[i] if i < len(right) else ("", "")
        lines.append(f"  {a[0]:<14}{a[1]:>8}      {b[0]:<14}{b[1]:>9}")
    lines.append(f"tokens/s {r['tokens_per_s']:,.0f}   MFU {r['mfu']:.1%}   FLOPs/step "
                 f"{r['flops_per_step']:.3e} computed, {r['model_flops_per_step']:.3e} model's "
                 f"(MFU's)   fits: {'yes' if r['fits'] else 'NO'}")
    return "\n".join(lines + [f"note: {n}" for n in r["notes"]])
