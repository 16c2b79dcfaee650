"""ZeRO-3 (fully sharded data parallel):

- on 2, 3 and 4 ranks, after 3 steps the parameters equal serial training on the global batch
  (float64, 1e-10): MLP and tiny GPT, SGD with momentum and AdamW, layer units and coarser
  units (GPT blocks), prefetch on and off, ring and halving/doubling collectives;
- on 2 and 4 ranks, a rank holds 1/N of parameters, gradients and optimizer state (exactly:
  each unit's padded vector / N) and no gathered copy after backward, two units' copies at most
  during it; it sends exactly 3 (N-1)/N of the padded parameters per step (all-gather for
  forward, again for backward, reduce-scatter), 1.5x what plain data parallelism's ring
  all-reduce sends, both measured by the comm counters; the next unit's gather starts before
  this unit's forward ends, and in backward before this unit's gradient goes out (prefetch);
- a checkpoint (``distributed.checkpoint``, ZeRO's format with the parameters in pieces) resumes
  bit for bit, and loads into ZeRO-2 and into a serial model and its optimizer (2 ranks);
- bad input is the same clear error on every rank; a layer inside a layer, and a no_grad
  forward between backward and step, train as the serial model does (2 ranks);
- a forward that uses a subset of the units (two heads, one per step; a layer skipped every
  other step) trains as serial AdamW does, torch's and minipar's: a unit without a gradient is
  left alone (2, 3 and 4 ranks, prefetch on and off).
One mpiexec launch per test and rank count runs all its cases.
"""
import numpy as np
import pytest

import minipar
import minipar.nn as nn
from minipar import optim
from minipar.testing import run_on_ranks

TOL = 1e-10
CASES = [("mlp", "sgd", {}), ("mlp", "adamw", dict(prefetch=False)), ("gpt", "adamw", {}),
         ("gpt", "sgd", dict(units="blocks")),
         ("gpt", "adamw", dict(algorithm="recursive_halving"))]


def train_zero3(kind, opt, comm, steps, **options):
    """Parameters (host arrays) after ``steps`` ZeRO-3 steps on this rank's share of the data."""
    import minipar
    from minipar.parallel.data import DistributedSampler, ZeRO3
    from test_dp_helpers import GLOBAL_BATCH, OPTIMIZERS, loss_of, make_data, make_model

    model = make_model(kind, "float64")
    x, y = make_data(kind, "float64")
    if options.get("units") == "blocks":  # each Block one unit; the rest one layer each
        blocks = list(model.blocks)
        options["units"] = blocks + [model.embed.wte, model.embed.wpe, model.ln_f, model.lm_head]
    zero = ZeRO3(model, OPTIMIZERS[opt], comm, **options)
    batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    for idx in batches[:steps]:
        zero.zero_grad()
        loss_of(kind, model, x[idx], y[idx]).backward()
        zero.step()
    with zero.summon_full_params():
        return [minipar.to_numpy(p.data).copy() for p in model.parameters()]


def equivalence_body():
    from minipar import comm
    from test_dp_helpers import STEPS, max_difference, train

    world = comm.world()
    report, serial = [], {}
    for kind, opt, options in CASES:
        if (kind, opt) not in serial:
            serial[kind, opt] = train(kind, "float64", opt)
        got = train_zero3(kind, opt, world, STEPS, **dict(options))
        report.append((f"{kind} {opt} {options}", max_difference(serial[kind, opt], got)))
    return report


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_zero3_equals_serial(nprocs):
    per_rank = run_on_ranks(equivalence_body, nprocs, timeout=240)
    failures = [f"rank {r}: {name}: max |difference| {diff:.3g} > {TOL:g}"
                for r, report in enumerate(per_rank) for name, diff in report if diff > TOL]
    assert not failures, "\n".join(failures)
    assert all(len(report) == len(CASES) for report in per_rank)


def measure_body():
    """Memory, traffic and the order of gathers, on one tiny GPT (float64, Adam)."""
    from minipar import comm
    from minipar.parallel.data import DistributedDataParallel, ZeRO3
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    world = comm.world()
    x, y = make_data("gpt", "float64")
    mine = slice(world.rank * 2, world.rank * 2 + 2)
    model = make_model("gpt", "float64")
    zero = ZeRO3(model, OPTIMIZERS["adam"], world)
    events = []
    for name in ("_gather", "_use", "_after_forward", "_reduce_scatter"):
        def spy(u, *rest, name=name, real=getattr(zero, name)):
            events.append((name, u.name))
            return real(u, *rest)
        setattr(zero, name, spy)
    sent = []
    for _ in range(2):
        events.clear()
        zero.zero_grad()
        before = world.counters.bytes_sent
        loss_of("gpt", model, x[mine], y[mine]).backward()
        held = zero.memory_bytes()
        zero.step()
        sent.append(world.counters.bytes_sent - before)
    padded = sum(u.numel for u in zero.units)
    order = [u.name for u in zero.order]
    plain = make_model("gpt", "float64")
    ddp = DistributedDataParallel(plain, world, bucket_cap_mb=25.0, algorithm="ring")
    before = world.counters.bytes_sent
    loss_of("gpt", ddp, x[mine], y[mine]).backward()
    dp_sent = world.counters.bytes_sent - before
    psi = sum(p.size for p in plain.parameters())
    return dict(held=held, peak=zero.peak_gathered_bytes, sent=sent, dp_sent=dp_sent, psi=psi,
                padded=padded, largest=max(u.numel for u in zero.units), events=events,
                order=order, units=len(zero.units))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_zero3_memory_traffic_and_prefetch(nprocs):
    N, item = nprocs, 8
    for r, m in enumerate(run_on_ranks(measure_body, nprocs, timeout=120)):
        shard = m["padded"] // N * item  # each unit's padded vector / N, summed
        assert m["held"] == {"parameters": shard, "gradients": shard,
                             "master": 0, "moments": 2 * shard,  # float64: no master copies
                             "gathered": 0}, (r, m["held"], shard)  # after backward: slots dropped
        assert shard <= (m["psi"] / N + m["units"]) * item  # ~1/N: at most 1 padding element/unit
        assert 0 < m["peak"] <= 2 * m["largest"] * item  # two units whole at most
        # traffic: all-gather twice + reduce-scatter, exactly; 1.5x DP's ring all-reduce
        assert m["sent"] == [3 * (N - 1) * m["padded"] // N * item] * 2, (r, m["sent"])
        assert m["sent"][1] / m["dp_sent"] == pytest.approx(1.5, rel=0.01), (r, m)
        # prefetch (second step): unit k+1's gather starts before unit k's forward ends, and in
        # backward unit k-1's before unit k's reduce-scatter
        ev, order = [tuple(e) for e in m["events"]], m["order"]
        fwd = ev[:ev.index(("_after_forward", order[-1])) + 1]
        bwd = ev[len(fwd):]
        for a, b in zip(order, order[1:]):
            assert fwd.index(("_gather", b)) < fwd.index(("_after_forward", a)), (a, b, fwd)
        gathered = [name for what, name in bwd if what == "_gather"]
        assert sorted(gathered) == sorted(order), bwd  # each unit gathered again for backward
        for a, b in zip(order, order[1:]):
            assert bwd.index(("_gather", a)) < bwd.index(("_reduce_scatter", b)), (a, b, bwd)


def bad_input_body():
    """Each misuse, caught: (case, exception type, message) on this rank."""
    import minipar
    import minipar.nn as nn
    from minipar import comm
    from minipar.parallel.data import ZeRO, ZeRO3
    from test_dp_helpers import OPTIMIZERS, make_model

    world = comm.world()
    sgd = OPTIMIZERS["sgd"]

    def tied():
        minipar.manual_seed(0)
        ZeRO3(nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8,
                                  tie_weights=True)), sgd, world)

    def missing():
        model = make_model("gpt", "float64")
        ZeRO3(model, sgd, world, units=list(model.blocks))

    def foreign():
        ZeRO3(make_model("mlp", "float64"), sgd, world, units=[nn.Linear(2, 2)])

    def twice():
        minipar.manual_seed(0)
        layer = nn.Linear(4, 4).astype("float64")
        model = nn.Sequential(layer, nn.ReLU(), layer)
        ZeRO3(model, sgd, world)
        model(minipar.tensor([[1.0, 2.0, 3.0, 4.0]], dtype="float64"))

    def no_step():
        model = make_model("mlp", "float64")
        ZeRO3(model, sgd, world)
        x = minipar.tensor([[1.0] * 6], dtype="float64")
        model(x).sum().backward()
        model(x).sum().backward()

    class Scaled(nn.Module):  # y = inner(x * s) * s: s is used before and after the inner unit
        def __init__(self, inner):
            super().__init__()
            self.s = nn.Parameter(minipar.tensor([1.5], dtype="float64"))
            self.inner = inner

        def forward(self, x):
            return self.inner(x * self.s) * self.s

    def dropped():  # zero_grad() drops a backward's gradients: the next forward may come
        model = make_model("mlp", "float64")
        zero = ZeRO3(model, sgd, world)
        x = minipar.tensor([[1.0] * 6], dtype="float64")
        model(x).sum().backward()
        zero.zero_grad()
        model(x).sum().backward()
        zero.step()

    def nested():  # slots: outer 0, middle 1, innermost 0, still needed by the outer one
        minipar.manual_seed(0)
        model = Scaled(Scaled(nn.Linear(3, 3).astype("float64")))
        ZeRO3(model, sgd, world)
        model(minipar.tensor([[1.0, 2.0, 3.0]], dtype="float64")).sum().backward()

    def two_deep():  # a unit inside a unit is fine: no error, the serial model's outputs
        def build():
            minipar.manual_seed(0)
            return nn.Sequential(Scaled(nn.Linear(3, 3)), nn.Linear(3, 2)).astype("float64")
        twin, model = build(), build()
        opt, zero = sgd(twin.parameters()), ZeRO3(model, sgd, world)
        x = minipar.tensor([[1.0, 2.0, 3.0]], dtype="float64")  # every rank: the average is it
        for _ in range(3):  # the later steps prefetch
            want, got = twin(x), model(x)
            assert abs(got.numpy() - want.numpy()).max() < 1e-12
            for y, net, clear, update in ((want, twin, opt.zero_grad, opt.step),
                                          (got, model, zero.zero_grad, zero.step)):
                clear()
                (y * y).sum().backward()
                with minipar.no_grad():  # a look between backward and step changes nothing
                    net(x)
                update()
        assert len(zero.units) == 3 and zero.memory_bytes()["gathered"] == 0

    def stale():  # backward through an older forward's graph
        model = make_model("mlp", "float64")
        ZeRO3(model, sgd, world)
        x = minipar.tensor([[1.0] * 6], dtype="float64")
        first = model(x).sum()
        model(x)
        first.backward()

    def stage3():
        ZeRO(make_model("mlp", "float64"), sgd, world, stage=3)

    caught = []
    for case in (tied, missing, foreign, twice, no_step, dropped, nested, two_deep, stale,
                 stage3):
        try:
            case()
            caught.append((case.__name__, None, "no error"))
        except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
            caught.append((case.__name__, type(error).__name__, str(error)))
    return caught


def test_zero3_bad_input_is_the_same_clear_error_on_every_rank():
    per_rank = run_on_ranks(bad_input_body, 2, timeout=60)
    assert per_rank[0] == per_rank[1]
    got = {case: (kind, message) for case, kind, message in per_rank[0]}
    expected = {"tied": ("ValueError", "'lm_head' also belongs to 'embed.wte'"),
                "missing": ("ValueError", "parameters in no unit: embed.wte.weight"),
                "foreign": ("ValueError", "unit Linear is not a module of the model"),
                "twice": ("RuntimeError", "was called twice in one forward"),
                "no_step": ("RuntimeError", "a second forward before step()"),
                "nested": ("RuntimeError",
                           "'inner.inner' needs slot 0, held by 'Scaled', which is still"),
                "two_deep": (None, "no error"), "dropped": (None, "no error"),
                "stale": ("RuntimeError", "backward through forward 1 after forward 2 began"),
                "stage3": ("ValueError", "minipar.parallel.data.ZeRO3")}
    for case, (kind, words) in expected.items():
        assert got[case][0] == kind and words in got[case][1], (case, got[case])


def checkpoint_body(folder):
    """Losses and parameters: ZeRO-3 for 2 steps, saved, 2 more; then, from the checkpoint,
    ZeRO-3 (another seed: everything must come from disk) and ZeRO-2 for the same 2 steps."""
    import contextlib

    import minipar
    from minipar import comm
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.data import ZeRO, ZeRO3
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    world = comm.world()
    x, y = make_data("gpt", "float64")

    def run(kind, seed, steps, start=0, save_at=None, load=False):
        model = make_model("gpt", "float64", seed=seed)
        app = (ZeRO3(model, OPTIMIZERS["adamw"], world) if kind == 3 else
               ZeRO(model, OPTIMIZERS["adamw"], world, stage=2))
        if load:
            dcp.load({"app": app}, checkpoint_id=folder)
        losses, saved = [], None
        for s in range(start, start + steps):
            rows = slice(s * 4 + world.rank * 2, s * 4 + world.rank * 2 + 2)
            app.zero_grad()
            loss = loss_of("gpt", model, x[rows], y[rows])
            loss.backward()
            app.step()
            losses.append(loss.item())
            if s + 1 == save_at:
                dcp.save({"app": app}, checkpoint_id=folder)
                saved = whole(app, model)
        return losses, whole(app, model), saved

    def whole(app, model):
        with app.summon_full_params() if isinstance(app, ZeRO3) else contextlib.nullcontext():
            return [minipar.to_numpy(p.data).tolist() for p in model.parameters()]

    reference, final, saved = run(3, 0, 4, save_at=2)
    return {"reference": (reference[2:], final), "saved": saved,
            "zero3": run(3, 99, 2, start=2, load=True)[:2],
            "zero2": run(2, 99, 2, start=2, load=True)[:2]}


def test_zero3_checkpoint_resumes_and_reshards(tmp_path):
    import numpy as np

    import minipar
    from minipar import optim
    from minipar.distributed import AppState, checkpoint as dcp
    from test_dp_helpers import make_model

    folder = str(tmp_path / "zero3")
    out = run_on_ranks(checkpoint_body, 2, args=(folder,), timeout=120)[0]
    assert out["zero3"] == list(out["reference"])  # bit for bit
    for got, want in zip(out["zero2"][1], out["reference"][1]):
        assert np.max(np.abs(np.array(got) - np.array(want))) < TOL
    serial = make_model("gpt", "float64", seed=99)  # a plain process reads the whole checkpoint
    app = AppState(serial, optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1))
    dcp.load({"app": app}, checkpoint_id=folder)
    assert [minipar.to_numpy(p.data).tolist() for p in serial.parameters()] == out["saved"]
    assert len(app.optimizer.state) == len(out["saved"])  # every parameter's moments came back


@pytest.mark.mpi
def test_bench_zero3_smoke_run_prints_its_ratios():
    """The benchmark's quick run: its table, and the bytes ratio the formula gives (1.5)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_zero3.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ZeRO-3 / DDP: time " in done.stdout and "bytes 1.500 (formula 1.5)" in done.stdout, \
        done.stdout
    assert "ZeRO-3 without / with prefetch: time " in done.stdout, done.stdout


class Forked(nn.Module):
    """inp -> mid -> out -> heads[head]; ``skip`` leaves mid out: each step leaves units out.
    ``both``: the other head runs too, outside the loss (a forward with no backward)."""

    def __init__(self):
        super().__init__()
        minipar.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])
        self.astype("float64")

    def forward(self, x, head, skip, both=False):
        h = self.inp(x).tanh()
        if not skip:
            h = self.mid(h).tanh()
        h = self.out(h).tanh()
        if both:
            self.heads[1 - head](h)
        return self.heads[head](h)


FORKED_STEPS, FORKED_BATCH = 4, 12
PHASES = (0, 1, 2)
FORKED_CASES = [(prefetch, phase) for prefetch in (True, False) for phase in PHASES]


def forked_plan(step, phase):
    """(head, skip, both) of a step: heads alternate, mid is skipped every other step (phase 1:
    from the first, so the first forward does not see it; phase 2: as 0, both heads run)."""
    return step % 2, (step + phase) % 2 == 1, phase == 2


def forked_data():
    rng = np.random.default_rng(2)
    n = FORKED_STEPS * FORKED_BATCH
    return rng.standard_normal((n, 5)), rng.standard_normal((n, 3))


def adamw(params):
    return optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_forked(phase, rows, comm=None, **options):
    """(losses, parameters) after the steps; ``rows(step)`` picks the batch; ZeRO-3 over
    ``comm`` (with ``options``), serial without."""
    from minipar.parallel.data import ZeRO3

    x, y = forked_data()
    model = Forked()
    runner = adamw(model.parameters()) if comm is None else ZeRO3(model, adamw, comm, **options)
    losses = []
    for s in range(FORKED_STEPS):
        head, skip, both = forked_plan(s, phase)
        runner.zero_grad()
        out = model(minipar.tensor(x[rows(s)]), head, skip, both)
        loss = ((out - minipar.tensor(y[rows(s)])) ** 2).mean()
        loss.backward()
        runner.step()
        losses.append(loss.item())
    if comm is None:
        return losses, [minipar.to_numpy(p.data).copy() for p in model.parameters()]
    with runner.summon_full_params():
        return losses, [minipar.to_numpy(p.data).tolist() for p in model.parameters()]


def whole_batch(s):
    return slice(s * FORKED_BATCH, (s + 1) * FORKED_BATCH)


def forked_body():
    from minipar import comm

    world = comm.world()
    share = FORKED_BATCH // world.size

    def mine(s):
        start = s * FORKED_BATCH + world.rank * share
        return slice(start, start + share)

    return [train_forked(phase, mine, world, prefetch=prefetch) for prefetch, phase in FORKED_CASES]


def torch_forked(phase):
    """(losses, parameters) of the same training in PyTorch: its AdamW skips a parameter whose
    grad is None (no momentum, no weight decay, no step)."""
    import torch

    x, y = (torch.tensor(a) for a in forked_data())
    P = {n: torch.tensor(minipar.to_numpy(p.data), requires_grad=True)
         for n, p in Forked().named_parameters()}  # in the model's order
    opt = torch.optim.AdamW(list(P.values()), lr=1e-2, weight_decay=0.1)

    def linear(name, h):
        return h @ P[name + ".weight"].T + P[name + ".bias"]

    losses = []
    for s in range(FORKED_STEPS):
        head, skip, _ = forked_plan(s, phase)  # torch: the unused head changes nothing
        rows = whole_batch(s)
        opt.zero_grad()
        h = torch.tanh(linear("inp", x[rows]))
        if not skip:
            h = torch.tanh(linear("mid", h))
        loss = ((linear(f"heads.{head}", torch.tanh(linear("out", h))) - y[rows]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().numpy().copy() for p in P.values()]


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_zero3_forward_using_a_subset_of_units_equals_serial_adamw(nprocs):
    per_rank = run_on_ranks(forked_body, nprocs, timeout=240)
    references = {"minipar": {phase: train_forked(phase, whole_batch) for phase in PHASES}}
    try:  # minipar's serial AdamW is checked without torch; torch's where it is installed
        references["torch"] = {phase: torch_forked(phase) for phase in PHASES}
    except ImportError:
        pass
    failures = []
    for case, (prefetch, phase) in enumerate(FORKED_CASES):
        # each rank's loss is its share's mean: their average is the global batch's
        losses = np.mean([per_rank[r][case][0] for r in range(nprocs)], axis=0)
        for name, reference in references.items():
            serial_losses, serial_params = reference[phase]
            loss_diff = np.max(np.abs(losses - serial_losses))
            for r in range(nprocs):
                diff = max(np.max(np.abs(np.array(p) - q))
                           for p, q in zip(per_rank[r][case][1], serial_params))
                if max(diff, loss_diff) > TOL:
                    failures.append(f"rank {r}, prefetch={prefetch}, phase {phase}, against "
                                    f"{name}: parameters {diff:.3g}, losses {loss_diff:.3g}")
    assert not failures, "\n".join(failures)
