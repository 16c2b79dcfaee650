"""Lesson 05: data parallelism: N ranks train one model on real data and equal the serial run.

    mpiexec -n 2 python lessons/05_data_parallel.py
    mpiexec -n 4 python lessons/05_data_parallel.py --quick   (a few seconds: the smoke run)

Every rank holds the whole model and sees 1/N of each batch (``DistributedSampler``). After
backward the ranks average their gradients (``DistributedDataParallel``: buckets all-reduced
while backward is still running), so every rank takes the step serial training would take on the
global batch. Part 1 trains an MLP on the bundled handwritten digits (1797 8x8 images) in
float64 with a serial twin beside it on rank 0, and prints the largest parameter difference: a
few ulps. Part 2 times a step and counts the bytes each rank sends with every all-reduce
algorithm of ``minipar.comm``, and with the parameter server (Li et al. 2014), one server and
sharded: one server's link carries 2(N-1)·n bytes a step, a ring rank's about 4(N-1)/N·n.
Part 3 times the same step with each bucket reduced on a background thread while backward goes
on (overlap on) and with backward waiting for each (off), taking turns, and prints what ``DistributedDataParallel``'s default chooses here and why:
overlap hides communication only on a core that backward leaves idle.

Read next: minipar/parallel/data/ddp.py, averaging.py, buckets.py, sampler.py, then
param_server.py; proved by tests/test_dp_equivalence.py.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import optim
from minipar import functional as F
from minipar.comm import ALGORITHMS, fit
from minipar.data import load_digits
from minipar.parallel.data import (DistributedDataParallel, DistributedSampler, ParameterServer,
                                   busiest_link, local_batch_size)
from minipar.comm.node import overlap_default


from _kit import arguments, check, figure, finish, mpi_world, note_load, say

GLOBAL_BATCH, TRAIN = 96, 1500  # 96 divides among 1, 2, 3, 4, 6 or 8 ranks


def build(dtype):
    minipar.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10)).astype(dtype)


def step_loss(model, x, y):
    return F.cross_entropy(model(minipar.tensor(x)), y)


def part1_equal_to_serial(world, x, y, epochs):
    N = world.size
    say(f"Part 1: {N} ranks vs one serial model, MLP 64-256-256-10, float64, AdamW, "
        f"global batch {GLOBAL_BATCH} = {N} x {local_batch_size(GLOBAL_BATCH, N)}")
    model = build("float64")
    ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.25)
    opt = optim.AdamW(model.parameters(), lr=2e-3)
    twin = build("float64") if world.rank == 0 else None
    twin_opt = optim.AdamW(twin.parameters(), lr=2e-3) if twin else None
    sampler = DistributedSampler(TRAIN, N, world.rank, seed=0)
    say(f"  {len(ddp.buckets)} gradient buckets; epoch  mean loss over the global batch")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order, losses = sampler.permutation(), []
        for k, idx in enumerate(sampler.batches(GLOBAL_BATCH)):
            opt.zero_grad()
            loss = step_loss(ddp, x[idx], y[idx])
            loss.backward()  # gradients averaged across ranks when this returns
            opt.step()
            losses.append(world.all_reduce(np.array([loss.item()]), op="avg")[0])
            if twin:  # serial: the same global batch, consecutive entries of the permutation
                glob = order[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH]
                twin_opt.zero_grad()
                step_loss(twin, x[glob], y[glob]).backward()
                twin_opt.step()
        say(f"  {epoch:5d}  {np.mean(losses):.4f}")
    diff = None
    if twin:
        diff = max(float(abs(p.data - q.data).max())  # abs(), not np.abs: arrays on any device
                   for p, q in zip(model.parameters(), twin.parameters()))
        print(f"  max |parameter difference| data-parallel vs serial after {epochs} epochs: "
              f"{diff:.2e} (float64 rounding; 0 would need the same summation order)")
    return model, world.broadcast_object(diff)


def time_steps(world, run_step, steps):
    """(seconds per step, the median of the slowest rank's; bytes this rank sent a step; busiest
    link's)."""
    run_step()  # warm-up
    before = world.counters.snapshot()
    seconds = fit.timed(world, run_step, steps, warmup=0)  # measured, not asserted
    sent = world.counters.snapshot()["bytes_sent"] - before["bytes_sent"]
    return seconds, sent / steps, busiest_link(world, before)[0] / steps


def part2_algorithms(world, x, y, steps):
    N = world.size
    b = local_batch_size(GLOBAL_BATCH, N)
    mine = slice(world.rank * b, (world.rank + 1) * b)
    xs, ys = x[:GLOBAL_BATCH][mine], y[:GLOBAL_BATCH][mine]
    n = sum(p.data.nbytes for p in build("float32").parameters())
    say(f"\nPart 2: one training step on {N} ranks, float32, gradient n = {n / 1e3:.0f} kB; "
        f"bytes rank 0 sends per step, and through the busiest rank's link (in + out)")
    say(f"  {'method':24s} {'ms/step':>8s} {'rank 0 sent':>10s} {'busiest':>10s}  "
        f"(ring theory: sent {2 * (N - 1) / N * n / 1e3:.0f} kB)")
    methods = [(f"DDP {a}", dict(algorithm=a)) for a in ALGORITHMS["all_reduce"]]
    sent_by = {}
    methods += [("parameter server, one", dict(sharded=False)),
                ("parameter server, sharded", dict(sharded=True))]
    curves = {}  # method -> the loss of each step (mean over ranks): the figure's curves
    for name, options in methods:
        model = build("float32")
        if name.startswith("DDP"):
            net = DistributedDataParallel(model, world, bucket_cap_mb=0.25, **options)
            opt = optim.AdamW(model.parameters(), lr=1e-3)
            update, clear = opt.step, opt.zero_grad
        else:
            ps = ParameterServer(model, lambda ps: optim.AdamW(ps, lr=1e-3), world, **options)
            net, update, clear = model, ps.step, ps.zero_grad

        losses = []

        def run_step():
            clear()
            loss = step_loss(net, xs, ys)
            loss.backward()
            update()
            losses.append(loss.item())
        seconds, sent, busiest = time_steps(world, run_step, steps)
        curves[name] = world.all_reduce(np.array(losses), op="avg").tolist()
        counted = (f"{sent / 1e3:8.0f}kB {busiest / 1e3:8.0f}kB" if not name.endswith("mpi")
                   else f"{'MPI_Allreduce: not in the counters':>21s}")
        say(f"  {name:24s} {seconds * 1e3:8.2f} {counted}")
        sent_by[name] = sent
    return n, sent_by, curves


def part3_overlap(world, x, y, steps, rounds=3):
    """ms per step of DDP ring with overlap on and off (the two take turns, ``rounds`` rounds;
    each the fastest round), and DDP's default in this configuration."""
    b = local_batch_size(GLOBAL_BATCH, world.size)
    mine = slice(world.rank * b, (world.rank + 1) * b)
    xs, ys = x[:GLOBAL_BATCH][mine], y[:GLOBAL_BATCH][mine]
    steps_of, best = {}, {}
    for name, overlap in (("overlap on", True), ("overlap off", False)):
        model = build("float32")
        net = DistributedDataParallel(model, world, bucket_cap_mb=0.25, overlap=overlap,
                                      algorithm="ring")
        opt = optim.SGD(model.parameters(), lr=1e-3)

        def run_step(net=net, opt=opt):
            opt.zero_grad()
            step_loss(net, xs, ys).backward()
            opt.step()
        steps_of[name] = run_step
    for _ in range(rounds):
        for name, run_step in steps_of.items():
            seconds = time_steps(world, run_step, steps)[0]
            best[name] = min(best.get(name, seconds), seconds)
    default, reason = overlap_default(world)  # what DistributedDataParallel's "auto" picks
    on, off = best["overlap on"] * 1e3, best["overlap off"] * 1e3
    say(f"\nPart 3: overlap on {world.size} ranks, DDP ring, float32 (fastest of {rounds} "
        f"rounds of {steps} steps, taking turns)")
    say(f"  overlap on  (backward goes on meanwhile)      {on:8.2f} ms/step")
    say(f"  overlap off (backward waits for each bucket)  {off:8.2f} ms/step")
    say(f"  gain from overlap (off / on): {off / on:.2f}x; DDP's default here: "
        f"{reason}")
    return off / on, default


def serial_curve(x, y, steps):
    """The serial model's losses on the whole global batch, step after step: the reference."""
    model = build("float32")
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step_loss(model, x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    args = arguments(__doc__, plot=True)
    world = mpi_world(__doc__, ranks=(1, 2, 3, 4, 6, 8))
    note_load()
    images, labels = load_digits()
    x, y = images.reshape(len(images), -1), labels
    model, diff = part1_equal_to_serial(world, x[:TRAIN].astype("float64"), y[:TRAIN],
                                        epochs=1 if args.quick else 6)
    with minipar.no_grad():
        logits = model(minipar.tensor(x[TRAIN:].astype("float64")))
    accuracy = float((logits.numpy().argmax(1) == y[TRAIN:]).mean())
    say(f"  held-out accuracy on the last {len(x) - TRAIN} digits: {accuracy:.1%}")
    steps = 3 if args.quick else 20
    n, sent, curves = part2_algorithms(world, x.astype("float32"), y, steps)
    part3_overlap(world, x.astype("float32"), y, steps)
    N = world.size
    if world.rank == 0 and args.plot:  # the timed steps trained on one batch: their loss curves
        serial = serial_curve(x.astype("float32"), y, steps + 1)
        gap = max(abs(a - b) for curve in curves.values() for a, b in zip(curve, serial))
        figure(args.plot, "05_loss", lambda figures: figures.loss_chart(
            {"serial (one model, the global batch)": serial, **curves},
            title=f"Data parallel on {N} ranks, each all-reduce and parameter server: the "
                  f"serial loss curve (part 2's steps, float32, largest gap {gap:.0e})"))
    check("data parallel equals serial training (float64, max |parameter diff| < 1e-10)",
          diff < 1e-10, "< 1e-10", f"{diff:.1e}")
    ring = 2 * (N - 1) / N * n  # every bucket's ring: 2(N-1)/N of its bytes
    check(f"DDP ring: rank 0 sent 2(N-1)/N·n = {ring:,.0f} B a step (counters, within 1 %)",
          abs(sent["DDP ring"] - ring) <= 0.01 * ring, f"{ring:,.0f} B",
          f"{sent['DDP ring']:,.0f} B")
    one = sent["parameter server, one"]
    if world.rank == 0 and N > 1:  # the server: N-1 gradients in, N-1 parameter copies out
        check(f"one parameter server sent (N-1)·n = {(N - 1) * n:,} B a step (within 1 %)",
              abs(one - (N - 1) * n) <= 0.01 * (N - 1) * n, f"{(N - 1) * n:,} B", f"{one:,.0f} B")
    return finish("data parallel equals serial and moves the bytes the formulas say")


if __name__ == "__main__":
    raise SystemExit(main())
