"""The pipeline runtime against its serial twin: every synchronous schedule gives the serial
gradients and updated weights (float64, to 1e-10); PipeDream matches its own update rule with the
weight versions of ``weight_versions``; counters give GPipe's m and 1F1B's p - r live
micro-batches; a broken schedule is refused on every rank before anything is sent.

One launch per rank count, each looping over its table of cases and returning the failures.
"""
import math

import pytest

from minipar.testing import run_on_ranks

TOL = 1e-10  # float64: summing m micro-batch gradients reorders additions, nothing more
BATCH = 11   # not a multiple of most m, so micro-batches differ in size (the loss scaling)
SYNC = [("naive", {}), ("gpipe", {}), ("gpipe", {"remat": True}), ("1f1b", {}),
        ("interleaved", {"v": 2}), ("zb-h1", {})]


def mlp(seed, n_linear=8, width=6, scaled=False):
    """Linear + GELU pairs in a Sequential, float64: 2 * n_linear layers to cut into stages.
    ``scaled`` puts a ``Scale`` after each GELU (an op that reads its weight only in backward)."""
    import minipar
    from minipar import nn

    minipar.manual_seed(seed)
    gelu = (lambda: nn.Sequential(nn.GELU(), Scale(width))) if scaled else nn.GELU
    layers = [nn.Linear(5, width)]
    for _ in range(n_linear - 2):
        layers += [gelu(), nn.Linear(width, width)]
    layers += [gelu(), nn.Linear(width, 3), nn.GELU()]
    return nn.Sequential(*layers).double()


def Scale(width):
    """x * w, elementwise: ``mul`` reads w's array when backward runs, not when forward does."""
    from minipar import nn

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(nn.init.uniform((width,), 1.0) + 1.0)

        def forward(self, x):
            return x * self.w

    return Scale()


def mse(out, target):
    return ((out - target) ** 2).mean()


def data(seed=7):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, 5)), rng.standard_normal((BATCH, 3))


def serial_step(model, x, y, loss_fn, lr):
    """The serial twin: full-batch loss, its gradients, and the weights after one SGD step."""
    from minipar import Tensor
    from minipar.optim import SGD

    loss = loss_fn(model(Tensor(x)), Tensor(y))
    loss.backward()
    grads = [q.grad.copy() for q in model.parameters()]
    SGD(model.parameters(), lr=lr).step()
    return loss.item(), grads, [q.data.copy() for q in model.parameters()]


def largest(diffs):
    """The largest of ``diffs``, NaN if one is: ``not largest(...) <= tol`` then fails on a NaN
    too (``max`` drops a NaN found after a number, and ``NaN > tol`` is false)."""
    diffs = [float(d) for d in diffs]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


def loss_problems(name, pipe, loss, ref_loss, tol=TOL):
    """The rank of the last stage returns the serial batch loss; every other rank None."""
    if pipe.n_stages - 1 not in pipe.stages:
        return [] if loss is None else [f"{name}: loss {loss} on a rank without the last stage"]
    return [] if loss is not None and abs(loss - ref_loss) <= tol else \
        [f"{name}: loss {loss} != serial {ref_loss}"]


def compare(name, pipe, serial_model, ref, loss, tol=TOL):
    """Failures (strings) where this rank's stages differ from the serial model's layers."""
    ref_loss, ref_grads, ref_params = ref
    index = {id(q): i for i, q in enumerate(serial_model.parameters())}
    serial_layers = list(serial_model)
    problems = loss_problems(name, pipe, loss, ref_loss, tol)
    for s in pipe.stages:
        a, b = pipe.bounds[s]
        twin = [q for layer in serial_layers[a:b] for q in layer.parameters()]
        for q, t in zip(pipe.stages[s].parameters(), twin):
            i = index[id(t)]
            dg = abs(q.grad - ref_grads[i]).max()
            dp = abs(q.data - ref_params[i]).max()
            if not largest([dg, dp]) <= tol:
                problems.append(f"{name}: stage {s} grad error {dg:.2e}, weight error {dp:.2e}")
    return problems


def run_sync_cases(comm, p, ms, make_model=mlp, batch=None, loss_fn=mse, schedules=SYNC):
    """Every synchronous schedule for each m on ``comm`` against the serial twin."""
    from minipar.optim import SGD
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline

    x, y = batch or data()
    ref = serial_step(make_model(1), x, y, loss_fn, lr=0.1)
    serial_model = make_model(1)
    problems = []
    for m in ms:
        for name, opts in schedules:
            label = f"{name}{opts} p={p} m={m}"
            try:
                schedule = build(name, p, m, **opts)
            except ValueError as err:
                if not (name == "interleaved" and m % p and "multiple of p" in str(err)):
                    problems.append(f"{label}: unexpected error {err}")
                continue
            if name == "interleaved" and m % p:
                problems.append(f"{label}: built although m is not a multiple of p")
            pipe = Pipeline(make_model(1), schedule, comm, loss_fn,
                            optimizer=lambda ps: SGD(ps, lr=0.1), memory=True, trace=True)
            loss = pipe.step(x, y)
            problems += compare(label, pipe, serial_model, ref, loss)
    return problems


def sync_equivalence(p):
    """p ranks: all synchronous schedules, m in {1, p-1, p, 2p+1}; and the peak counters."""
    from minipar import comm

    world = comm.world()
    problems = run_sync_cases(world, p, sorted({1, max(1, p - 1), p, 2 * p + 1}))
    return problems + peak_counters(world, p) + pipedream_cases(world, p)


def peak_counters(comm, p):
    """GPipe holds m micro-batches on every rank, 1F1B and ZB-H1 p - r on rank r, GPipe with
    re-materialisation one; the trace of the same step counts the same."""
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline
    from minipar.parallel.pipeline import peak_inflight

    m, r = 2 * p + 1, comm.rank
    x, y = data()
    want = {"gpipe": m, "gpipe-remat": 1, "1f1b": p - r, "zb-h1": p - r}
    problems, measured = [], {}
    for name, want_live in want.items():
        schedule = build(name.split("-remat")[0], p, m, remat=name.endswith("remat"))
        pipe = Pipeline(mlp(1), schedule, comm, mse, memory=True, trace=True)
        pipe.step(x, y)
        live, traced = pipe.stats["peak_live"], peak_inflight(pipe.events, p)[r]
        measured[name] = pipe.stats["peak_bytes"]
        if live != want_live or traced != want_live:
            problems.append(f"{name} p={p} m={m} rank {r}: peak live {live}, traced {traced}, "
                            f"want {want_live}")
    if not measured["gpipe-remat"] <= measured["1f1b"] < measured["gpipe"]:
        problems.append(f"rank {r}: activation bytes not ordered remat <= 1f1b < gpipe: {measured}")
    return problems


def pipedream_reference(p, m, x, y, lr):
    """PipeDream's rule computed serially: micro-batch k runs every stage s with the weight
    version its forward used there (``weight_versions``), and stage s's weights after its k-th
    backward are W_s[k+1] = W_s[k] - lr * dL_k/dW_s (evaluated at those versions)."""
    import numpy as np

    from minipar import Tensor
    from minipar.parallel.pipeline import balanced_split, build
    from minipar.parallel.pipeline.actions import weight_versions

    versions = weight_versions(build("pipedream", p, m))
    model = mlp(1, scaled=True)
    layers = list(model)
    bounds = balanced_split([1] * len(layers), p)
    stage_params = [[q for layer in layers[a:b] for q in layer.parameters()] for a, b in bounds]
    history = [[[q.data.copy() for q in qs]] for qs in stage_params]  # history[s][version]
    losses = []
    for k, (xk, yk) in enumerate(zip(np.array_split(x, m), np.array_split(y, m))):
        for s, qs in enumerate(stage_params):
            forward_version, backward_version = versions[(s, k)]
            assert forward_version == backward_version, "weight stashing: F and B share a version"
            for q, w in zip(qs, history[s][forward_version]):
                q.data, q.grad = w.copy(), None
        loss = mse(model(Tensor(xk)), Tensor(yk))
        loss.backward()
        losses.append(loss.item())
        for s, qs in enumerate(stage_params):
            history[s].append([w - lr * q.grad for w, q in zip(history[s][k], qs)])
    return [h[-1] for h in history], sum(losses) / m


def pipedream_cases(comm, p):
    from minipar.optim import SGD
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.actions import weight_versions
    from minipar.parallel.pipeline.runtime import Pipeline

    x, y = data()
    problems = []
    for m in sorted({1, p, 2 * p + 1}):
        final, ref_loss = pipedream_reference(p, m, x, y, lr=0.1)
        pipe = Pipeline(mlp(1, scaled=True), build("pipedream", p, m), comm, mse,
                        optimizer=lambda ps: SGD(ps, lr=0.1))
        loss = pipe.step(x, y)
        label = f"pipedream p={p} m={m} rank {comm.rank}"
        err = largest(abs(q.data - w).max() for q, w in zip(pipe.parameters(), final[comm.rank]))
        if not err <= TOL:
            problems.append(f"{label}: weight error {err:.2e}")
        problems += loss_problems(label, pipe, loss, ref_loss)
        want = {key: versions for key, versions in weight_versions(build("pipedream", p, m)).items()
                if key[0] == comm.rank}
        if pipe.versions_used != want:
            problems.append(f"pipedream p={p} m={m}: versions used {pipe.versions_used}, "
                            f"want {want}")
        if pipe.stash:
            problems.append(f"pipedream p={p} m={m}: stashed versions left: {list(pipe.stash)}")
    return problems


def edge_cases():
    """On 2 ranks: p = 1 (each rank alone), a GPT and a ResNet (eval mode) cut into stages, the
    refused broken schedule and the clear errors."""
    from minipar import comm

    world = comm.world()
    alone = world.split(color=world.rank)
    problems = run_sync_cases(alone, 1, [1, 3])
    problems += gpt_and_resnet(world)
    return problems + errors(world)


def gpt_and_resnet_models():
    """[(make_model, batch, loss_fn)]: a GPT cut into its layers, a ResNet in eval mode."""
    import numpy as np

    from minipar import functional as F
    from minipar import manual_seed, nn

    def gpt(seed):
        manual_seed(seed)
        config = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)
        return nn.GPT(config).to_sequential().double()

    def resnet(seed):
        manual_seed(seed)
        return nn.ResNet(blocks=(1, 1), widths=(4, 8), num_classes=5).double().eval()

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 11, (5, 6))
    images = (rng.standard_normal((5, 1, 8, 8)), rng.integers(0, 5, 5))
    return [(gpt, (ids, np.roll(ids, -1, axis=1)), F.cross_entropy),
            (resnet, images, F.cross_entropy)]


def gpt_and_resnet(comm):
    (gpt, gpt_batch, loss), (resnet, images, _) = gpt_and_resnet_models()
    some = [("gpipe", {"remat": True}), ("1f1b", {}), ("zb-h1", {}), ("interleaved", {"v": 2})]
    problems = run_sync_cases(comm, 2, [2, 4], gpt, gpt_batch, loss, some)
    problems += run_sync_cases(comm, 2, [3], resnet, images, loss, some[:3])
    return problems + remat_replays_dropout(comm, gpt_batch) + remat_batchnorm(comm, images)


def remat_replays_dropout(comm, batch):
    """With dropout, the re-computed forward (R) must draw the forward's masks again: GPipe with
    and without re-materialisation give the same gradients."""
    from minipar import functional as F
    from minipar import manual_seed, nn
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline

    grads = []
    for remat in (False, True):
        manual_seed(5)
        config = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8,
                              dropout=0.3)
        pipe = Pipeline(nn.GPT(config).to_sequential().double(), build("gpipe", 2, 2, remat=remat),
                        comm, F.cross_entropy)
        pipe.step(*batch)
        grads.append([q.grad for q in pipe.parameters()])
    err = largest(abs(a - b).max() for a, b in zip(*grads))
    return [] if err <= TOL else [f"dropout under re-materialisation: gradients differ by "
                                  f"{err:.2e}"]


def remat_batchnorm(comm, batch):
    """Training-mode BatchNorm: the re-computed forward (R) must not move the running statistics
    a second time; gradients and statistics equal those of plain GPipe."""
    from minipar import functional as F
    from minipar import manual_seed, nn
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline

    runs = []
    for remat in (False, True):
        manual_seed(2)
        net = nn.ResNet(blocks=(1, 1), widths=(4, 8), num_classes=5).double()
        pipe = Pipeline(net, build("gpipe", 2, 3, remat=remat), comm, F.cross_entropy)
        pipe.step(*batch)
        stats = [v for stage in pipe.stages.values() for _, v in stage.named_buffers()]
        runs.append([q.grad for q in pipe.parameters()] + stats)
    err = largest(abs(a - b).max() for a, b in zip(*runs))
    return [] if err <= TOL else [f"BatchNorm under re-materialisation: differs by {err:.2e}"]


def errors(comm):
    """Each check returns the error message it got (or a failure)."""
    from minipar.parallel.pipeline import ScheduleError, build
    from minipar.parallel.pipeline.runtime import Pipeline

    broken = build("1f1b", 2, 3)
    broken.actions[1] = [a for a in broken.actions[1]
                         if (a.kind, a.stage, a.mb) != ("RECV_F", 1, 2)]
    x, y = data()
    cases = {
        "broken": (lambda: Pipeline(mlp(1), broken, comm, mse), ScheduleError,
                   "rank 0: SEND_F(stage 0, mb 2)->1 has no matching "
                   "RECV_F(stage 1, mb 2)<-0 on rank 1"),
        "layers": (lambda: Pipeline(mlp(1)[:3], build("interleaved", 2, 2), comm, mse),
                   ValueError, "cannot cut 3 layers into 4 stages"),
        "size": (lambda: Pipeline(mlp(1), build("1f1b", 3, 2), comm, mse), ValueError,
                 "is for 3 ranks but the communicator has 2"),
        "batch": (lambda: Pipeline(mlp(1), build("gpipe", 2, 12), comm, mse).step(x, y),
                  ValueError, "cannot cut a batch of 11 inputs into 12 micro-batches"),
    }
    problems = []
    for name, (make, error, text) in cases.items():
        try:
            make()
            problems.append(f"{name}: no error on rank {comm.rank}")
        except error as err:
            if text not in str(err):
                problems.append(f"{name}: rank {comm.rank} said {err}")
    return problems


def assert_none(problems_per_rank):
    """Each rank returned its list of failures: all must be empty."""
    for rank, problems in enumerate(problems_per_rank):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_sync_schedules_equal_serial_and_pipedream_its_rule(p):
    assert_none(run_on_ranks(sync_equivalence, p, timeout=120, args=(p,)))


@pytest.mark.mpi
def test_edge_cases_gpt_resnet_and_refusals():
    assert_none(run_on_ranks(edge_cases, 2, timeout=120))
