"""Lesson 16: planning a run: the planner's prediction beside a real run, then GPT-3 on 1,024 GPUs.

    mpiexec -n 4 python lessons/16_planning.py        (works with -n 2 and -n 8; add --quick)

``minipar plan`` (docs/plan.md) prices a layout with the library's own formulas. Part 1 fits this
machine's α-β-γ and engine (``--profile here``), predicts four layouts of a small GPT (DP,
ZeRO-3, TP 2 x DP, PP 2 x DP), runs each, and prints predicted beside measured: each rank's
model-state bytes by kind (to the byte), the activations (ActivationMemory), the step time by
kind. Part 2 ranks every layout of GPT-3 175B on 1,024 H100s (``minipar plan --model gpt3-175b
--gpus 1024``) and works out why the top one wins. ``--plot DIR`` draws memory and time by kind.

Read next: minipar/plan/layout_bytes.py, activations.py, time.py, gemm.py, kernels.py,
search.py, hardware.py, then docs/plan.md; proved by tests/test_plan_measured.py,
tests/test_plan_activations.py, tests/test_plan_cli.py and tests/test_plan_narayanan.py.
"""
import dataclasses
import time

import numpy as np

import minipar
from minipar import backend, nn, optim
from minipar.cli import build_parser
from minipar.cli.plan import describe, plan, short, stacked_bars
from minipar.comm.fit import fit
from minipar.memory import ActivationMemory
from minipar.parallel.data import DistributedDataParallel, ZeRO3
from minipar.parallel.groups import ParallelGroups
from minipar.parallel.hybrid import Trainer3D
from minipar.plan.hardware import here
from minipar.plan.layout_bytes import rank_modules, rank_state_bytes
from minipar.plan.models import GPTShape
from minipar.plan.time import Cluster, Layout, predict

from _kit import arguments, check, figure, finish, mpi_world, note_load, progress, say

# a GPT small enough for 4-8 ranks on a laptop, large enough that its matmuls, not Python,
# take most of a step (at h = 128 Python's cost per op is 3x the matmuls' on one core);
# float32 and no recompute, as the lessons train
SHAPE = GPTShape(layers=4, hidden=256, heads=4, seq=64, vocab=64)
CONFIG = nn.GPTConfig(vocab_size=SHAPE.vocab, block_size=SHAPE.seq, n_layer=SHAPE.layers,
                      n_head=SHAPE.heads, n_embd=SHAPE.hidden, dropout=0.0)
BATCH = 16  # sequences per step: divides among 8 data-parallel ranks
MICRO_BATCHES = 4  # of the pipeline's layout
COMMON = dict(recompute="none", precision="fp32", schedule="1f1b")
SCALE = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpus-per-node", "8",
         "--profile", "h100"]
TOP = 5
ACTIVATION_TOLERANCE = 0.05
# measured / predicted step time of each layout. Every term of a step is priced from what
# --profile here measures now, on these ranks: the engine's CPU costs at this model's shapes x
# the ranks' contention, the α-β fit up to 4 MiB, ZeRO-3's own work per unit. What is left is
# the machine's pace drifting between the timing and the run, and the pipeline runtime's and
# the collectives' Python: measured 0.87-1.16x for all four layouts on 2 and 4 ranks of the
# 2-core machine when quiet. Beside other jobs (load average 3.7 on 2 cores) ZeRO-3's 84 small
# collectives a step each waited for a rank off its core: 1.8-2.4x, and DP 0.63x (its timing
# and its run under different loads). Checked for every layout on 2 and 4 ranks of a quiet
# machine; on 8 (four ranks a core) or beside other jobs (the load average above the cores)
# printed, with the reason: a busy machine's timings are noise, not the model's error.
RATIO_BAND = (0.67, 1.5)
RATIO_REASON = ("each term of the step measured now on these ranks (the engine, the ranks' "
                "contention, the α-β fit): what is left is the machine's drift between timing "
                "and run")


def layouts(n):
    """(name, Layout) of the four layouts run on n ranks: the global batch of BATCH sequences
    split over the data-parallel ranks, then (pipeline) into MICRO_BATCHES micro-batches."""
    return [("DP", Layout(dp=n, micro_batch=BATCH // n, **COMMON)),
            ("ZeRO-3", Layout(dp=n, zero=3, micro_batch=BATCH // n, **COMMON)),
            ("TP 2 x DP", Layout(tp=2, dp=n // 2, micro_batch=2 * BATCH // n, **COMMON)),
            ("PP 2 x DP", Layout(pp=2, dp=n // 2, micro_batch=2 * BATCH // n // MICRO_BATCHES,
                                 **COMMON))]


def batch(step):
    """The step's global batch of token ids, the same on every rank."""
    x = np.random.default_rng(step).integers(0, SHAPE.vocab, (BATCH, SHAPE.seq + 1))
    return x[:, :-1], x[:, 1:]


def adamw(params):
    return optim.AdamW(params, lr=1e-3, weight_decay=0.0)


class DataParallelRun:
    """DDP (zero 0) or ZeRO-3 over the world: each rank the whole model and its 1/dp of the
    batch. ``states`` are the wrapper's bytes by kind after the last backward (before the step
    frees or shards the gradients), as tests/test_plan_measured.py measures them."""

    def __init__(self, world, layout):
        minipar.manual_seed(0)
        self.model = nn.GPT(CONFIG)
        b = layout.micro_batch
        self.rows = slice(world.rank * b, (world.rank + 1) * b)
        if layout.zero == 3:
            self.opt = ZeRO3(self.model, adamw, world)
        else:
            # the ring all-reduce the planner prices, on this thread (overlap off): its time is
            # then all in the communicator's clock, none of it hidden behind compute
            self.ddp = DistributedDataParallel(self.model, world, algorithm="ring",
                                               overlap=False)
            self.opt = adamw(self.model.parameters())
        self.comms = {"dp": world}  # whose clocks hold the communication time of each kind
        self.states = None

    def step(self, s):
        x, y = batch(s)
        self.opt.zero_grad()
        self.model(x[self.rows], y[self.rows])[1].backward()
        self.states = self.measure_states()
        self.opt.step()

    def measure_states(self):
        if isinstance(self.opt, ZeRO3):
            m = self.opt.memory_bytes()
            return {"params": m["parameters"], "grads": m["gradients"], "master": m["master"],
                    "moments": m["moments"]}
        return self.opt.memory_bytes() | {"grads": self.ddp.gradient_bytes()}

    def activations(self, s):
        """The peak bytes held for backward during step ``s`` (ActivationMemory)."""
        with ActivationMemory() as memory:
            self.step(s)
        return memory.peak_bytes


class TrainerRun:
    """Trainer3D on the grid of ``layout``: tensor parallel with sequence parallelism (as the
    planner assumes whenever tp > 1), the pipeline's 1F1B, data parallel over the rest."""

    def __init__(self, world, layout):
        groups = ParallelGroups(world, tp=layout.tp, pp=layout.pp)
        m = BATCH // (layout.dp * layout.micro_batch)
        self.trainer = Trainer3D(CONFIG, groups, schedule=layout.schedule, microbatches=m,
                                 make_optimizer=adamw, sequence_parallel=layout.tp > 1,
                                 algorithm="ring")
        self.pp_rank = groups.coords["pp"]
        self.comms = {"tp": groups.tensor, "pp": groups.pipeline, "dp": groups.data}

    def step(self, s):
        self.trainer.step(*batch(s))

    @property
    def states(self):
        """This rank's AdamW's bytes by kind (its slices of its stages), after a step."""
        return self.trainer.pipe.optimizer.optimizer.memory_bytes()

    def activations(self, s):
        pipe = self.trainer.pipe
        pipe.memory = True  # the pipeline's own ActivationMemory around its actions
        self.step(s)
        pipe.memory = False
        return pipe.stats["peak_bytes"]


def run_layout(world, layout, steps):
    """This rank's measured model states and peak activations, its pipeline rank, and per
    timed step (total seconds, {kind: seconds inside that kind's communication calls})."""
    run = (DataParallelRun if layout.tp == layout.pp == 1 else TrainerRun)(world, layout)
    peak = run.activations(0)  # the first step also makes the optimizer state
    run.step(1)  # the states after a second backward, as the planner's table counts them
    states = dict(run.states)
    times = [timed(world, run, s) for s in range(2, 2 + steps)]
    return states, peak, getattr(run, "pp_rank", 0), times


def timed(world, run, s):
    """Seconds of step ``s`` on this rank, all ranks starting together, and the seconds spent
    inside each kind's communication calls: the communicators' own clocks (comm counters)."""
    world.barrier()
    clocks = {kind: comm.counters.comm_time_s for kind, comm in run.comms.items()}
    start = time.perf_counter()
    run.step(s)
    backend.synchronize()
    total = time.perf_counter() - start
    return total, {kind: comm.counters.comm_time_s - clocks[kind]
                   for kind, comm in run.comms.items()}


def fastest_step(every_rank):
    """{kind: seconds} by kind of the fastest step: each step is its slowest rank's (the step
    ends when that rank does), compute what its communication calls leave. The fastest, as
    timeit keeps it: other jobs on the machine only ever delay a step, and the planner prices
    an undisturbed one."""
    rows = []
    for ranks in zip(*every_rank):
        total, comm = max(ranks, key=lambda r: r[0])
        rows.append({"compute": total - sum(comm.values()), "tp": comm.get("tp", 0.0),
                     "pp": comm.get("pp", 0.0), "dp": comm.get("dp", 0.0), "total": total})
    return min(rows, key=lambda row: row["total"])


def predicted_step(p):
    """The planner's step time in the kinds measured here: the pipeline's waits for its
    neighbour are its messages and its bubble both (no cp or ep in these layouts)."""
    t = p["time_s"]
    return {"compute": t["compute"], "tp": t["tp"], "pp": t["pp"] + t["bubble"], "dp": t["dp"],
            "total": t["total"]}


def part1_here(world, quick):
    """This machine's profile: the α-β-γ fitted now, on these ranks, and the GEMM rate."""
    # up to 4 MiB either way: DP's one all-reduce moves the 12.8 MB of gradients, and a β
    # extrapolated from 1 MiB priced it at 3-5x what it measured
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 22) if quick else (1 << 12, 1 << 14, 1 << 16,
                                                                  1 << 18, 1 << 20, 1 << 22)
    model = fit(world, sizes=sizes, rounds=1 if quick else 2, retries=0 if quick else 1)
    # takes the fit just made (cost.default_model), times a GEMM and minipar's engine, and on
    # these ranks how much they slow each other and what a collective waits for them
    profile = here(world)
    cores = profile.engine.cores  # the cores the profile found the ranks share
    say("Part 1: the planner on this machine (--profile here), beside a real run",
        f"  fitted now on {world.size} ranks: α = {model.alpha * 1e6:.1f} µs a step, β = "
        f"{1 / model.beta(1 << 20) / 1e9:.2f} GB/s at 1 MiB;",
        f"  NumPy's 256 x 256 GEMM {profile.peak('fp32') / 1e9:.1f} GFLOP/s on one rank. A GPT "
        f"of {SHAPE.layers} layers, h = {SHAPE.hidden}, {SHAPE.heads} heads,",
        f"  s = {SHAPE.seq}, V = {SHAPE.vocab} (Ψ = {SHAPE.parameters():,}), {BATCH} sequences "
        f"a step, float32, AdamW; {world.size} ranks on {cores} core(s), which compute "
        f"{profile.engine.contention:.2f}x",
        "  as long side by side as one alone (contention: turns, and the caches each turn "
        "evicts)")
    return Cluster(world.size, world.size, profile), cores


def part1_measure(world, cluster, steps):
    """Each layout predicted and run: [(name, layout, prediction, [per rank (predicted states,
    measured states, peak activations, pipeline rank)], [per rank timed steps])] on rank 0."""
    found = []
    for name, layout in progress(layouts(world.size), "layouts run"):
        states, peak, pp_rank, times = run_layout(world, layout, steps)
        exact = rank_state_bytes(SHAPE, layout.precision, zero=layout.zero, dp=layout.dp,
                                 tp=layout.tp, pp=layout.pp, pp_rank=pp_rank,
                                 schedule=layout.schedule)
        check(f"{name}: each rank's model-state bytes by kind are the planner's, to the byte",
              exact == states, exact, states)
        found.append((name, layout, predict(SHAPE, layout, cluster, BATCH),
                      world.gather_object((exact, states, peak, pp_rank)),
                      world.gather_object(times)))
    return found if world.rank == 0 else None


def part1_memory(found):
    say("  model-state bytes of one rank, predicted (plan.layout_bytes) beside measured (the "
        "wrappers'",
        "  memory_bytes), and the search's estimate (Ψ/N: model_state_bytes)",
        f"  {'layout':10s} {'rank':>4s} {'params':>11s} {'grads':>11s} {'optimizer':>11s} "
        f"{'predicted':>11s} {'measured':>11s} {'Ψ/N':>11s}")
    for name, layout, p, ranks, _ in found:
        shown = set()
        for rank, (exact, states, _, pp_rank) in enumerate(ranks):
            if pp_rank in shown:  # the ranks of one pipeline stage hold alike: show one
                continue
            shown.add(pp_rank)
            even = sum(p["memory_bytes"][k] for k in ("params", "grads", "optimizer"))
            say(f"  {name:10s} {rank:4d} {exact['params']:>11,} {exact['grads']:>11,} "
                f"{exact['master'] + exact['moments']:>11,} {sum(exact.values()):>11,} "
                f"{sum(states.values()):>11,} {even:>11,.0f}")
    say("  The search divides Ψ evenly, fast enough for a 175B model; a real rank holds whole "
        "tensors:",
        "  tensor parallelism replicates the LayerNorms, positions and row biases, the pipeline "
        "cuts at whole",
        "  layers, ZeRO pads each flat vector to a multiple of N: rank_state_bytes counts it "
        "all, to the byte.")


def check_activations(name, predicted, measured):
    """The planner's activation bytes within ACTIVATION_TOLERANCE of the largest rank's
    ActivationMemory peak."""
    error = predicted / measured - 1
    return check(f"{name}: predicted activations within {ACTIVATION_TOLERANCE:.0%} of the "
                 f"measured peak", abs(error) <= ACTIVATION_TOLERANCE,
                 f"± {ACTIVATION_TOLERANCE:.0%}", f"{error:+.1%}")


def part1_activations(found):
    say("\n  activations: bytes held for backward, the planner's beside the peak of a step "
        "on the largest rank",
        "  (minipar.memory.ActivationMemory: what backward's closures keep)",
        f"  {'layout':10s} {'predicted':>11s} {'measured':>11s} {'ratio':>6s}")
    for name, _, p, ranks, _ in found:
        predicted, measured = p["memory_bytes"]["activations"], max(r[2] for r in ranks)
        say(f"  {name:10s} {predicted:>11,.0f} {measured:>11,} {predicted / measured:6.2f}")
        check_activations(name, predicted, measured)


def part1_time(found, cluster, cores, steps, quiet=True):
    say(f"\n  step time in ms: predicted (--profile here) beside measured (fastest of {steps} "
        f"steps, each the",
        "  slowest rank's; communication from the communicators' clocks, compute the rest)",
        f"  {'layout':10s} {'':9s} " + " ".join(f"{k:>9s}" for k in
                                               ("compute", "tp", "pp+bubble", "dp", "total"))
        + "  measured/predicted")
    ratios = {}
    for name, _, p, _, times in found:
        predicted, measured = predicted_step(p), fastest_step(times)
        ratios[name] = measured["total"] / predicted["total"]
        for what, row in (("predicted", predicted), ("measured", measured)):
            say(f"  {name if what == 'predicted' else '':10s} {what:9s} "
                + " ".join(f"{row[k] * 1e3:9.2f}" for k in ("compute", "tp", "pp", "dp",
                                                           "total"))
                + (f"  {ratios[name]:.2f}x" if what == "measured" else ""))
    share = cluster.profile.engine.share(cluster.gpus)
    units = len(rank_modules(SHAPE))
    # where the ranks fill the cores no core is free for the background all-reduce (the
    # planner's rule and DDP's overlap_default alike)
    overlap = ("Nothing hides the dp exchange (no core is free); each clock counts the wait for"
               if cluster.gpus >= cores else
               "The planner hides the dp exchange (a core is free); each clock counts the wait for")
    say(f"  The profile timed minipar's engine at this model's shapes (each GEMM, the per-op "
        "cost of a layer, its",
        "  element-wise passes, the ends and AdamW); here "
        f"{cluster.gpus} ranks share {cores} core(s), {share:.2f} of a core each, and the",
        f"  prediction takes the {cluster.profile.engine.contention:.2f}x they measured "
        "computing side by side.",
        f"  {overlap} the slowest rank.",
        f"  ZeRO-3 gathers its {units} units (modules) one by one: 3 ring collectives each, "
        "each paying its own",
        "  α steps, and its own work per unit: both priced unit by unit. Not priced: the "
        "pipeline runtime's",
        "  Python per action, and the wait of ZeRO-3's, tp's and pp's many small messages "
        "for a rank off its",
        "  core (other jobs, or more ranks than cores).",
        f"  measured / predicted is checked in {RATIO_BAND[0]:g}-{RATIO_BAND[1]:g}x: "
        "each term of a step is measured",
        "  now on these ranks (the engine, the ranks' contention, the α-β fit), so what is "
        "left is the machine's",
        "  drift between the timing and the run. Checked on 2 and 4 ranks of a quiet "
        "machine; beside other",
        "  jobs, or four ranks a core, ZeRO-3's many collectives wait for ranks off their "
        "core and a timing",
        "  taken under one load meets a run under another"
        + ("." if quiet else ": not checked now, the load average is above the cores."),
        "  On a quiet machine scripts/bench_plan.py compares 16 layouts, one by one.")
    band = f"{RATIO_BAND[0]:g}-{RATIO_BAND[1]:g}x"
    for name, ratio in ratios.items():
        if cluster.gpus <= 4 and quiet:
            check(f"{name}: measured step time {band} the predicted (--profile here; "
                  f"{RATIO_REASON})", RATIO_BAND[0] <= ratio <= RATIO_BAND[1], band,
                  f"{ratio:.2f}x")


def part2_scale():
    """``minipar plan`` on GPT-3 175B: every layout ranked; rank 0 only (it is pure Python)."""
    args = build_parser().parse_args(SCALE + ["--top", str(10**6)])  # every layout that fits
    start = time.perf_counter()
    result = plan(args)
    seconds = time.perf_counter() - start
    ranked = result["ranked"]
    shown = result | {"ranked": ranked[:TOP]}
    say(f"\nPart 2: minipar {' '.join(SCALE)} --top {TOP}",
        f"  (every layout predicted and ranked in {seconds:.1f} s)", describe(shown))
    why_first(result, ranked)
    return result, shown


def why_first(result, ranked):
    """Why the first layout wins, from the numbers: what each kind costs it, and what the best
    layout with another tp, pp, cp or ZeRO stage gains and loses against it."""
    first = ranked[0]
    L, t, memory = first["layout"], first["time_s"], first["memory_bytes"]
    say(f"\n  Why {short(L)} is first: {t['total']:.3f} s a step, of which compute "
        f"{t['compute']:.3f} s ({t['compute'] / t['total']:.1%}),",
        f"  communication {t['comm']:.3f} s (tp {t['tp']:.3f}, cp {t['cp']:.3f}, pp "
        f"{t['pp']:.3f}, dp {t['dp']:.3f}), bubble {t['bubble']:.3f} s.")
    slowest = max(ranked, key=lambda p: p["time_s"]["compute"])
    say(f"  Every layout computes the same FLOPs ({first['flops_per_step']:.3e} a step), but "
        f"not in the same time: {t['compute']:.3f} s here,",
        f"  {slowest['time_s']['compute']:.3f} s for {short(slowest['layout'])} "
        f"({result['seq'] // slowest['layout']['cp']} tokens a GPU: every GEMM streams "
        "its weights for a few rows),",
        "  each GEMM priced by its own shape (a rank's share under tp and cp: narrower "
        "products fill fewer",
        "  waves of the H100's 132 SMs), each element-wise kernel by its bytes. For each "
        "size, the best layout",
        "  where it differs (the other sizes follow), its rank, and what moves against the "
        "first",
        "  (seconds by kind, memory):")
    for axis in ("tp", "pp", "cp", "zero"):
        rank, other = next(((i, p) for i, p in enumerate(ranked, 1)
                            if p["layout"][axis] != L[axis]), (None, None))
        if other is None:
            say(f"  {axis}: no layout that fits has {axis} other than {L[axis]}")
            continue
        moves = {k: other["time_s"][k] - t[k] for k in ("compute", "tp", "cp", "pp", "dp", "ep",
                                                        "bubble")}
        big = sorted((k for k in moves if abs(moves[k]) >= 5e-4), key=lambda k: -abs(moves[k]))
        said = ", ".join(f"{k} {moves[k]:+.3f}" for k in big[:3]) or "no kind moves"
        say(f"  {axis} {L[axis]} -> {other['layout'][axis]}: rank {rank}, "
            f"{short(other['layout'])}: {other['time_s']['total'] - t['total']:+.3f} s "
            f"({said}), {(other['memory_bytes']['total'] - memory['total']) / 1e9:+.1f} GB")
    nodes = result["gpus_per_node"]
    beyond = result["rejected"].get("tp beyond a node", 0)
    say(f"  tp = {L['tp']} keeps tensor parallelism's all-gathers and reduce-scatters, every "
        f"layer, on a node's NVLink",
        f"  ({nodes} GPUs); the {beyond} layouts with tp beyond a node were not ranked. Memory: "
        f"{memory['total'] / 1e9:.1f} GB",
        f"  of {result['gpu_memory_bytes'] / 1e9:.0f} ({memory['activations'] / 1e9:.1f} GB "
        f"activations, {(memory['params'] + memory['grads'] + memory['optimizer']) / 1e9:.1f} "
        f"GB model states): {1 - memory['total'] / result['gpu_memory_bytes']:.0%} headroom.")


def check_scale(result):
    """The ranking's first layout fits, keeps tp in a node, and its numbers are the planner's."""
    ranked, first = result["ranked"], result["ranked"][0]
    L = first["layout"]
    check("the first layout fits in the GPU's memory", first["fits"] and
          first["memory_bytes"]["total"] <= result["gpu_memory_bytes"],
          f"≤ {result['gpu_memory_bytes']:.3g}", f"{first['memory_bytes']['total']:.3g}")
    check("the first layout's tp divides the GPUs of a node (NVLink)",
          result["gpus_per_node"] % L["tp"] == 0, f"divides {result['gpus_per_node']}", L["tp"])
    totals = [p["time_s"]["total"] for p in ranked]
    check("the layouts are ranked by step time", totals == sorted(totals), "ascending", totals[:5])
    # the table is the planner's: the first layout predicted again, from the library itself
    from minipar.plan import preset
    from minipar.plan.hardware import PROFILES
    fields = {f.name for f in dataclasses.fields(Layout)}
    again = predict(preset("gpt3-175b").shape, Layout(**{k: L[k] for k in fields}),
                    Cluster(1024, 8, PROFILES["h100"]), preset("gpt3-175b").global_batch)
    check("the first row is plan.time.predict's, recomputed", again == first, "equal", "differs")
    t, memory = first["time_s"], first["memory_bytes"]
    check("its step time is compute + comm + bubble, its memory the sum of its kinds",
          abs(t["compute"] + t["comm"] + t["bubble"] - t["total"]) <= 1e-9 * t["total"]
          and abs(sum(v for k, v in memory.items() if k != "total") - memory["total"]) <= 1,
          "sums", (t, memory))


def main():
    args = arguments(__doc__, ("--steps", 5, "timed steps per layout"),
                     quick="3 timed steps, a shorter fit", plot=True)
    world = mpi_world(__doc__, ranks=(2, 4, 8))
    steps = 3 if args.quick else args.steps
    busy = note_load()  # timings follow: a busy machine makes them noise
    cluster, cores = part1_here(world, args.quick)
    found = part1_measure(world, cluster, steps)
    if world.rank == 0:
        part1_memory(found)
        part1_activations(found)
        part1_time(found, cluster, cores, steps, quiet=not busy)
        result, shown = part2_scale()
        check_scale(result)
        figure(args.plot, "16_plan", lambda figures: stacked_bars(shown))
    return finish("the planner's model-state bytes are the ranks' to the byte, and it ranks "
                  "GPT-3's layouts on 1,024 GPUs by predicted step time")


if __name__ == "__main__":
    raise SystemExit(main())
