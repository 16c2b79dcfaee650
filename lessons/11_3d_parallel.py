"""Lesson 11: 3D parallelism, a tiny GPT trained data × tensor × pipeline parallel, equal to serial.

    mpiexec -n 8 python lessons/11_3d_parallel.py          (2 × 2 × 2; also -n 4, --tp/--pp)

Part 1 prints the rank grid of Megatron-LM (Narayanan et al. 2021): rank = tp + T·(dp + D·pp),
tensor coordinate fastest so the chattiest group sits on neighbouring ranks (one node). Part 2
trains the character-level GPT on the Python documentation bundled with Python, each rank holding
1/T of every layer's weights, 1/P of the layers and seeing 1/D of the batch, and checks the first
steps' losses against the serial model trained on the same batches (float32: equal to a few 1e-6,
the rounding of a different order of sums). Part 3 shows one pipeline's timeline and the bytes
each kind of group moved per step, from the communicators' own counters.

The vocabulary is padded up to a multiple of 8 and of T (Megatron's make-vocab-size-divisible-by):
the extra logits belong to no character and their probability is learnt to be ~0; the same padding
for every T <= 8 lets a checkpoint move between layouts.

Checkpoints. ``--save DIR`` writes the trained state after the last step (every rank its shard,
rank 0 the manifest: minipar.distributed.checkpoint); ``--resume DIR`` loads it before training
and goes on counting from its step, with the next batches. A resumed run is checked against the
serial GPT loaded from the very same checkpoint: the (T, P) slices go back into whole matrices.

    mpiexec -n 8 python lessons/11_3d_parallel.py --steps 200 --save ckpt
    mpiexec -n 4 python lessons/11_3d_parallel.py --tp 1 --pp 4 --steps 200 --resume ckpt

Read next: minipar/parallel/groups.py, hybrid.py, then minipar/distributed/checkpoint.py; proved
by tests/test_groups.py and tests/test_hybrid.py.
"""
import math
import time

import minipar
from minipar import backend, nn, optim
from minipar.console import terminal_width
from minipar.data import CharTokenizer, get_batch, load_text
from minipar.distributed import AppState, checkpoint as dcp
from minipar.parallel.groups import ParallelGroups, RankGrid
from minipar.parallel.hybrid import Trainer3D
from minipar.parallel.pipeline import bubble_theory, build, timeline
from minipar.testing import serial_losses, train_serial

from _kit import arguments, check, figure, finish, mpi_world, progress, say


def main():
    args = arguments(__doc__,
                     ("--tp", 2, "tensor-parallel size T"),
                     ("--pp", 2, "pipeline-parallel size P (D = W / (T·P))"),
                     ("--schedule", "1f1b", "pipeline schedule (minipar schedule --help)"),
                     ("--microbatches", 4), ("--steps", 400),
                     ("--lr", 3e-3, "AdamW learning rate"),
                     ("--check-steps", 5, "steps compared with serial"),
                     ("--batch", 16, "global batch (sequences)"),
                     ("--trace", None, "write every rank's last step as Chrome-trace JSON to this "
                                       "file (open it in Perfetto)"),
                     ("--save", None, "save the trainer to this folder after training"),
                     ("--resume", None, "load the trainer from this folder before training and "
                                        "continue its step count"),
                     quick="a few steps of a smaller model", plot=True)
    if args.quick:
        args.steps, args.check_steps, args.batch = 4, 2, 8
    world = mpi_world(__doc__, ranks=[args.tp * args.pp * d for d in range(1, args.batch + 1)
                                      if args.batch % (d * args.microbatches) == 0])
    groups = ParallelGroups(world, tp=args.tp, pp=args.pp)
    grid = groups.grid

    say(f"Part 1. The rank grid of {world.size} ranks\n", grid.describe(),
        "\nMegatron's documented example, 16 GPUs with T = 2, P = 4:")
    example = RankGrid(16, tp=2, pp=4)
    say(f"  tensor {example.groups('tp')}", f"  pipeline {example.groups('pp')}",
        f"  data {example.groups('dp')}")
    four = RankGrid(16, tp=2, pp=2, ep=2)  # 4D: experts (lesson 12) on the same ranks
    say(f"4D, 16 GPUs with T = 2, P = 2, ep = 2: data group {four.group_of(0, 'dp')} = expert "
        f"groups {four.group_of(0, 'ep')} {four.group_of(4, 'ep')} (tokens' all-to-all)",
        f"  × expert-data groups {four.group_of(0, 'edp')} {four.group_of(2, 'edp')} (expert "
        f"gradients): minipar groups --ep, minipar.parallel.hybrid4d.Trainer4D")

    text = load_text("pydoc")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    multiple = math.lcm(8, grid.tp)
    vocab = -(-tok.vocab_size // multiple) * multiple  # padded to a multiple of 8 and of T
    config = nn.GPTConfig(vocab_size=vocab, block_size=32 if not args.quick else 16,
                          n_layer=2, n_head=4, n_embd=64 if not args.quick else 32)
    rng = backend.get_array_module().random.default_rng(0)  # the same batches on every rank

    say(f"\nPart 2. Training: {tok.vocab_size} characters (vocabulary padded to {vocab}), "
        f"GPT {config.n_layer} blocks × {config.n_embd} channels, global batch "
        f"{args.batch} × {config.block_size}, {args.schedule} with {args.microbatches} "
        f"micro-batches, AdamW lr {args.lr}")

    def make_optimizer(params):
        return optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    trainer = Trainer3D(config, groups, schedule=args.schedule, microbatches=args.microbatches,
                        make_optimizer=make_optimizer, trace=True)
    state = {"trainer": trainer, "step": 0, "rng": minipar.get_rng_state()}
    if args.resume:
        dcp.load(state, checkpoint_id=args.resume)  # this layout's slices of the saved model
        minipar.set_rng_state(state["rng"])
        say(f"  resumed from {args.resume} at step {state['step']}")
    first = state["step"]  # the batches go on where the saved run stopped
    batches = [get_batch(data, args.batch, config.block_size, rng)
               for _ in range(first + args.steps)][first:]
    for c in (groups.tensor, groups.pipeline, groups.data):
        c.counters.reset()
    losses, start = [], time.perf_counter()
    for i, (ids, targets) in enumerate(batches, first):
        losses.append(float(trainer.step(ids, targets)))  # a device scalar until printed
        if (i - first) % max(1, args.steps // 10) == 0 or i == first + args.steps - 1:
            recent = losses[-10:]
            say(f"  step {i:4d}  loss {losses[-1]:.4f}  mean of last {len(recent):2d} "
                f"{sum(recent) / len(recent):.4f}  ({time.perf_counter() - start:.1f} s)")
    seconds = (time.perf_counter() - start) / args.steps
    state.update(step=first + args.steps, rng=minipar.get_rng_state())
    if args.save:
        dcp.save(state, checkpoint_id=args.save)
        say(f"  saved step {state['step']} to {args.save}")
    moved = {name: c.counters.snapshot() for name, c in
             (("tensor", groups.tensor), ("pipeline", groups.pipeline), ("data", groups.data))}
    events = world.gather_object(trainer.pipe.events)

    if world.rank == 0:
        # With --plot the serial model trains through every step: the figure's reference curve.
        compared = batches if args.plot else batches[:args.check_steps]
        if len(compared) > args.check_steps:
            compared = progress(compared, "serial reference")
        reference = (serial_losses(config, compared, make_optimizer) if not args.resume else
                     resumed_serial_losses(config, compared, make_optimizer, args.resume))
        curves = {"serial": reference, f"3D ({grid.dp}×{grid.tp}×{grid.pp})": losses}
        reference = reference[:args.check_steps]
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        serial = f"serial model{' (loaded)' if args.resume else ''}, same batches:"
        print(f"\n  {serial} " + " ".join(f"{x:.5f}" for x in reference))
        print(f"  {f'3D ({grid.dp}×{grid.tp}×{grid.pp}):':{len(serial)}s} " +
              " ".join(f"{x:.5f}" for x in losses[:args.check_steps]))
        print(f"  largest difference {worst:.1e} (float32 rounding: tolerance 1e-4)")
        check(f"the first {args.check_steps} losses equal serial training's (float32, "
              f"|diff| < 1e-4)", worst < 1e-4, "< 1e-4", f"{worst:.1e}")
        k = max(1, min(10, args.steps // 2))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        if not args.resume:  # a resumed run starts low: it need not fall further in a few steps
            check(f"the mean loss of the last {k} steps is below the first {k}'s", last < first,
                  f"< {first:.4f}", f"{last:.4f}")
        print(f"  mean loss of the first and last {k} steps: {first:.3f} -> {last:.3f} "
              f"(ln {tok.vocab_size} = {math.log(tok.vocab_size):.3f} is a uniform guess), "
              f"{seconds * 1e3:.0f} ms per step")

    say(f"\nPart 3. The last step of the pipeline of rank 0 "
        f"(ranks {grid.group_of(0, 'pp')}, one row per stage)")
    if world.rank == 0:
        stages = grid.group_of(0, "pp")
        mine = [timeline.Event(stages.index(r), e.start, e.end, e.kind, e.mb, e.chunk)
                for r, evs in enumerate(events) if r in stages for e in evs]
        shortest = min(e.duration for e in mine if e.kind in ("F", "B"))
        # a cell: the shortest F or B; a row: the world rank holding that stage
        print(timeline.text_gantt(mine, unit=shortest, width=terminal_width(), legend=True,
                                  labels=[f"rank {r}" for r in stages]))
        print(f"  bubble measured {timeline.bubble_fraction(mine):.2f}")
        draw_figures(args, curves, mine, grid, state["step"] - args.steps)
        if args.trace:
            every = [timeline.Event(r, e.start, e.end, e.kind, e.mb, e.chunk)
                     for r, evs in enumerate(events) for e in evs]
            timeline.write_chrome_trace(every, args.trace, n_ranks=world.size)
            print(f"  all {world.size} ranks' timelines written to {args.trace} (ui.perfetto.dev)")
    totals = world.gather_object(moved)
    if world.rank == 0:
        print(f"\n  bytes sent per step, summed over all {world.size} ranks "
              f"(each rank's own groups):")
        print(f"  {'group':10s} {'messages':>10s} {'MB':>10s}")
        sent = {}
        for name in ("tensor", "pipeline", "data"):
            sent[name] = sum(t[name]["messages_sent"] for t in totals) / args.steps
            mb = sum(t[name]["bytes_sent"] for t in totals) / args.steps / 1e6
            print(f"  {name:10s} {sent[name]:10.0f} {mb:10.3f}")
        # DDP's "auto" averages a data group that shares a node in shared memory (comm/shm.py):
        # the gradients move once per step all the same, through memory, not as messages
        data = ("data groups carry the gradients once per step." if sent["data"] else
                "data groups average the gradients once per step in the node's shared memory\n"
                "  (the all-reduce 'auto' picks on one node: comm/shm.py), so they send no message.")
        print("\n  Tensor groups carry the most messages (two all-reduces per layer each way);"
              "\n  pipeline groups carry activations once per micro-batch and stage boundary;"
              f"\n  {data}")
    return finish(f"the first {args.check_steps} losses of the 3D run equal serial training's"
                  + ("" if args.resume else " and the loss falls"))


def draw_figures(args, curves, events, grid, first):
    """The loss curves, serial beneath 3D, and the last step of rank 0's pipeline, measured."""
    steps = {label: [(first + i, loss) for i, loss in enumerate(curve)]
             for label, curve in curves.items()}
    figure(args.plot, "11_loss", lambda figures: figures.loss_chart(
        steps, title=f"GPT trained {grid.dp}×{grid.tp}×{grid.pp} (data × tensor × pipeline) "
                     f"beside the serial model on the same batches"))
    schedule = build(args.schedule, grid.pp, args.microbatches)
    formula, num, den = bubble_theory(schedule)
    figure(args.plot, "11_schedule", lambda figures: figures.schedule_chart(
        events, grid.pp, title=f"The last step of rank 0's pipeline ({args.schedule}, "
                               f"m = {args.microbatches}), measured",
        theory=(f"{formula.split(' if')[0]} = {num}/{den}", num / den), time_unit="ms"))


def resumed_serial_losses(config, batches, make_optimizer, folder):
    """The serial GPT and its optimizer loaded from the 3D run's checkpoint, then trained on the
    same batches: the whole matrices are the (T, P) slices put back together."""
    model = nn.GPT(config)
    optimizer = make_optimizer(model.parameters())
    dcp.load({"trainer": AppState(model, optimizer)}, checkpoint_id=folder)
    return train_serial(model, optimizer, batches)


if __name__ == "__main__":
    raise SystemExit(main())
