"""Lesson 7: model parallelism: a ResNet split over two ranks, naive and then pipelined.

    mpiexec -n 2 python lessons/07_model_parallel.py        (add --quick for a smoke run)

When a model does not fit one device, cut it: rank 0 runs the first layers, sends the
activations to rank 1, which runs the rest and the loss, and the gradients travel back. Done
naively, the whole batch goes through rank 0, then rank 1, then back: one rank works at a time,
so two ranks are no faster than one (utilisation 1/p), only bigger.

Pipelining cuts the batch into m micro-batches of ``split`` samples: rank 1 works on micro-batch
k while rank 0 already runs k+1. If the slowest stage does a fraction f of the work (1/p when
balanced), the first micro-batch crosses all stages in T/m (T: one device's step) and each
later one leaves a slot of f T/m behind it, so

    speed-up over one device ~ m / (1 + (m - 1) f)    (= p m / (m + p - 1) when f = 1/p)

less the fixed cost of every extra message and call,
and it grows with m until the micro-batches are too small for the layers to run efficiently and
the fixed costs per message and per call win: the U-shaped curve of the PyTorch model-parallel
tutorial (ResNet-50 on two GPUs, time against split size). Here: the bundled UCI digits (1797
real 8x8 images), a small ResNet, the cut chosen by the partitioner from measured layer times,
and the GPipe schedule run by minipar's pipeline runtime. BatchNorm normalises each
micro-batch by its own statistics, as in the tutorial.

Read next: minipar/parallel/pipeline/partition.py, then runtime.py; proved by
tests/test_pipeline_runtime.py.
"""
import os
import statistics
import time

os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")  # a waiting rank sleeps, not spins

import numpy as np  # noqa: E402

import minipar  # noqa: E402
from minipar import Tensor, nn, optim  # noqa: E402
from minipar import functional as F  # noqa: E402
from minipar.comm import fit  # noqa: E402
from minipar.data import load_digits  # noqa: E402
from minipar.parallel.pipeline import Pipeline, balanced_split, build, stage_costs  # noqa: E402
from minipar.parallel.pipeline.partition import measure_costs  # noqa: E402

from _kit import arguments, check, finish, mpi_world, note_load, progress, say  # noqa: E402

args = arguments(__doc__, ("--batch", 256), ("--steps", 4, "timed steps per setting (median)"),
                 quick="a smaller model, fewer steps")
world = mpi_world(__doc__, at_least=2)
rank, p = world.rank, world.size
note_load()


def resnet(widths):
    minipar.manual_seed(0)  # the same weights on every rank: each keeps its own stage
    return nn.ResNet(blocks=(1, 1, 1, 1), widths=widths, num_classes=10)


def number(loss):
    """The last rank's loss (a device scalar) as a Python float, None on the other ranks."""
    return None if loss is None else float(loss)


def step_seconds(pipe, x, y, steps):
    """Median wall time of a training step, the slowest rank's (all ranks start together)."""
    losses = []
    seconds = fit.timed(world, lambda: losses.append(number(pipe.step(x, y))), steps, warmup=0)
    return seconds, world.broadcast_object(losses, root=p - 1)


def main():
    widths = (8, 16, 32, 64) if args.quick else (16, 32, 64, 128)
    batch, steps = (64, 2) if args.quick else (args.batch, args.steps)
    images, labels = load_digits()
    x, y = images[:batch], labels[:batch]
    layers = list(resnet(widths))
    say(f"UCI digits: {len(images)} real 8x8 images; batch {batch}; ResNet widths {widths}, "
        f"{len(layers)} layers; {p} ranks")

    # 1. Where to cut: time each layer on rank 0, let the partitioner balance the stages.
    costs = world.broadcast_object(measure_costs(layers, Tensor(x)) if rank == 0 else None)
    bounds = balanced_split(costs, p)
    names = [type(layer).__name__ for layer in layers]
    for s, ((a, b), cost) in enumerate(zip(bounds, stage_costs(costs, bounds))):
        say(f"  stage {s} (rank {s}): layers {a}..{b - 1} {names[a:b]}  "
            f"forward {cost * 1e3:.1f} ms")

    # 2. One device: the whole model on rank 0 (the others wait), the time to beat.
    model = resnet(widths)
    sgd = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times, serial_losses = [], []
    for _ in progress(range(steps if rank == 0 else 0), "one device"):
        start = time.perf_counter()
        model.zero_grad()
        loss = F.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        sgd.step()
        times.append(time.perf_counter() - start)
        serial_losses.append(loss.item())
    serial, serial_losses = world.broadcast_object((statistics.median(times), serial_losses)
                                                   if rank == 0 else None)
    say(f"\none device, whole batch: {serial * 1e3:.1f} ms per step (speed-up 1)")

    # 3. Naive model parallelism (one micro-batch), then GPipe over a sweep of split sizes.
    slowest = max(stage_costs(costs, bounds)) / sum(costs)
    say(f"\n{'schedule':<10}{'split':>7}{'m':>5}{'ms/step':>10}{'speed-up':>10}"
        f"{'model m/(1+(m-1)f), f=' + format(slowest, '.2f'):>30}")
    splits = [batch] + [s for s in (128, 64, 32, 16, 8, 4) if s < batch][: 3 if args.quick else 6]
    best, table = None, []
    for split in progress(splits, "splits"):  # the table comes after: a bar and lines do not mix
        m = batch // split
        name = "naive" if m == 1 else "gpipe"
        pipe = Pipeline(resnet(widths), build(name, p, m), world, F.cross_entropy, bounds=bounds,
                        optimizer=lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9))
        seconds, losses = step_seconds(pipe, x, y, steps)
        if m == 1:  # the same arithmetic as one device, cut in two: the same losses
            gap = max(abs(a - b) for a, b in zip(losses, serial_losses))
            check(f"naive model parallel: the one-device model's {steps} losses (float32, "
                  f"|diff| < 1e-5)", gap < 1e-5, "< 1e-5", f"{gap:.1e}")
        best = min(best or (seconds, split), (seconds, split))
        table.append(f"{name:<10}{split:>7}{m:>5}{seconds * 1e3:>10.1f}"
                     f"{serial / seconds:>9.2f}x{m / (1 + (m - 1) * slowest):>29.2f}x")
    say(*table)
    say(f"\nfastest split: {best[1]} samples per micro-batch. Naive model parallelism is no "
        f"faster than one device:\nrank {p - 1} waits for rank 0, then rank 0 for rank {p - 1}. "
        f"Micro-batches let the ranks overlap, until they get\nso small that per-call overheads "
        f"dominate. (The model column ignores those overheads.)")

    # 4. And it trains: a few epochs' worth of pipelined steps on the digits, best split.
    m = batch // best[1]
    pipe = Pipeline(resnet(widths), build("gpipe" if m > 1 else "naive", p, m), world,
                    F.cross_entropy, bounds=bounds,
                    optimizer=lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9))
    order = np.random.default_rng(0).permutation(len(images))
    losses = []
    for i in progress(range(4 if args.quick else 30), "training"):
        idx = order[(i * batch) % (len(images) - batch):][:batch]
        losses.append(world.broadcast_object(number(pipe.step(images[idx], labels[idx])),
                                             root=p - 1))
    say(f"\ntraining with GPipe, split {best[1]}: loss {losses[0]:.3f} at step 1, "
        f"{losses[-1]:.3f} at step {len(losses)}")
    check(f"GPipe training: the loss falls over {len(losses)} steps", losses[-1] < losses[0],
          f"< {losses[0]:.3f}", f"{losses[-1]:.3f}")
    return finish("the ResNet cut over ranks computes the one-device losses and trains "
                  "pipelined (timings: measured, not asserted)")


if __name__ == "__main__":
    raise SystemExit(main())
