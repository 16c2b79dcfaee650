"""minipar.distributed.checkpoint: resume is bit-identical (DDP, ZeRO-1/2, 3D; dropout, optimizer
state and step included) and a checkpoint of one layout loads into another with the same next-step
losses (float64): DDP, ZeRO and the parameter server on 2 ranks -> a plain process, ZeRO-1 and
the parameter server 2 -> 4 ranks, TP 2 x PP 2 -> TP 1 x PP 4 and -> serial."""
import os

import numpy as np
import pytest

from minipar import to_numpy
from minipar.testing import run_on_ranks

K = 2  # steps before the checkpoint, and after it
RESHARD_TOLERANCE = 1e-12  # float64: the layouts only reorder sums



def same(a, b):
    """Equal values wherever the arrays live (MINIPAR_DEVICE=strict or gpu: host copies)."""
    return np.array_equal(to_numpy(a), to_numpy(b))

def gpt_config(dropout):
    from minipar import nn
    return nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16,
                        dropout=dropout)


def batches(n=8, steps=2 * K):
    ids = np.random.default_rng(1).integers(0, 16, size=(steps, n, 8))
    return [(x, np.roll(x, -1, axis=1)) for x in ids]


def make_optimizer(params):
    from minipar import optim
    return optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------- one process: trees and objects

def test_tree_items_and_back():
    from minipar.distributed.tree import items, unflatten

    tree = {"a": {3: [1, (2, {})], "w": "x"}, "rng": (0, 3), "e": [], "f": (), "g": None}
    assert unflatten(items(tree)) == tree
    # a dict empty on one rank (a worker without optimizer) and full on another: the union
    full = list(items({"h": {"lr": 0.1}}))
    empty = list(items({"h": {}}))
    assert unflatten(full + empty) == unflatten(empty + full) == {"h": {"lr": 0.1}}


def test_plain_trees_fill_in_place_and_stateful_objects_load(tmp_path):
    """{"model": module.state_dict()} is filled in place, an optimizer and a module load as
    Stateful objects (integer keys and tuples intact), values are replaced; a key the checkpoint
    lacks or a shape that differs is an error before anything changes."""
    import minipar
    from minipar import nn, optim
    from minipar.distributed import checkpoint as dcp

    def build(seed):
        minipar.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(minipar.randn(5, 3)).sum().backward()
        opt.step()
        return model, opt

    model, opt = build(0)
    dcp.save({"model": model.state_dict(), "optim": opt, "copy": model,
              "meta": {"step": 7, "rng": (0, 3), "epoch": [1, {}]}},
             checkpoint_id=str(tmp_path / "c"))
    other, other_opt = build(1)
    live = other.state_dict()
    state = {"model": live, "optim": other_opt, "meta": {"step": 0, "rng": None, "epoch": None}}
    dcp.load(state, checkpoint_id=str(tmp_path / "c"))
    assert state["model"] is live and all(same(live[k], a)
                                          for k, a in model.state_dict().items())
    assert live["0.weight"] is other.state_dict()["0.weight"]  # in place: the very arrays
    assert state["meta"] == {"step": 7, "rng": (0, 3), "epoch": [1, {}]}
    assert sorted(other_opt.state) == [0, 1, 2, 3] and other_opt.state[0]["step"] == 1
    assert same(other_opt.state[2]["momentum_buffer"],
                          opt.state[2]["momentum_buffer"])
    fresh, _ = build(2)
    dcp.load({"copy": fresh}, checkpoint_id=str(tmp_path / "c"))  # a module as Stateful
    assert same(fresh.state_dict()["1.bias"], model.state_dict()["1.bias"])

    third, third_opt = build(3)
    before = {k: a.copy() for k, a in third.state_dict().items()}
    with pytest.raises(KeyError, match=r"\['meta'\]\['lr'\]"):
        dcp.load({"model": third.state_dict(), "meta": {"lr": 1}},
                 checkpoint_id=str(tmp_path / "c"))
    wrong = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"\['copy'\]\['0.weight'\] has shape \(5, 3\) here"):
        dcp.load({"model": third.state_dict(), "copy": wrong.state_dict()},
                 checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"\['model'\]\['0.weight'\] has shape \(5, 3\) here"):
        dcp.load({"model": wrong.state_dict()}, checkpoint_id=str(tmp_path / "c"))
    assert all(same(a, before[k]) for k, a in third.state_dict().items())


@pytest.mark.parametrize("form", ["module", "AppState"])
def test_a_failed_load_checks_everything_before_it_writes(tmp_path, form):
    """{"a": a module that fits, "b": one that does not}: the error comes before ``a`` changes
    (and before its optimizer does, in the AppState form)."""
    import minipar
    from minipar import nn, optim
    from minipar.distributed import AppState
    from minipar.distributed import checkpoint as dcp

    def build(seed, width=4):
        minipar.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, width), nn.Linear(width, 2))
        opt = optim.AdamW(model.parameters(), lr=0.1)
        model(minipar.randn(5, 3)).sum().backward()
        opt.step()
        return model, opt

    def wrap(model, opt):
        return model if form == "module" else AppState(model, opt)

    saved = [build(0), build(1)]
    dcp.save({"a": wrap(*saved[0]), "b": wrap(*saved[1])}, checkpoint_id=str(tmp_path / "c"))
    ok, bad = build(2), build(3, width=5)
    before = {k: a.copy() for k, a in ok[0].state_dict().items()}
    moments = [s["exp_avg"].copy() for _, s in sorted(ok[1].state.items())]
    with pytest.raises((KeyError, ValueError), match=r"0.weight.*\(5, 3\)"):
        dcp.load({"a": wrap(*ok), "b": wrap(*bad)}, checkpoint_id=str(tmp_path / "c"))
    assert all(same(a, before[k]) for k, a in ok[0].state_dict().items())
    assert all(same(s["exp_avg"], m) for (_, s), m in zip(sorted(ok[1].state.items()), moments))
    assert all(s["step"] == 1 for s in ok[1].state.values())


# ---------------------------------------------------------------- data parallel (2 and 4 ranks)

def dp_run(kind, comm, dropout, folder, steps, load=False, save_at=None):
    """Global mean losses of ``steps`` steps of ``kind`` (ddp, zero1, zero2, ps, ps-sharded) from step
    ``start``; loads ``folder`` first when ``load``, saves there after ``save_at`` steps."""
    import minipar
    from minipar import nn
    from minipar.distributed import AppState, checkpoint as dcp
    from minipar.parallel.data import DistributedDataParallel, ParameterServer, ZeRO

    minipar.manual_seed(0 if not load else 99)  # a resumed run must take everything from disk
    model = nn.GPT(gpt_config(dropout)).double()
    if kind == "ddp":
        net, opt = DistributedDataParallel(model, comm), make_optimizer(model.parameters())
        app, update, clear = AppState(model, opt), opt.step, opt.zero_grad
    else:
        app = (ZeRO(model, make_optimizer, comm, stage=int(kind[-1])) if "zero" in kind else
               ParameterServer(model, make_optimizer, comm, sharded=kind == "ps-sharded"))
        net, update, clear = model, app.step, app.zero_grad
    state = {"app": app, "step": 0, "rng": minipar.get_rng_state()}
    if load:
        dcp.load(state, checkpoint_id=folder)
        minipar.set_rng_state(state["rng"])
    losses, rows = [], 8 // comm.size
    for ids, targets in batches()[state["step"]:state["step"] + steps]:
        clear()
        mine = slice(comm.rank * rows, (comm.rank + 1) * rows)
        loss = net(ids[mine], targets[mine])[1]
        loss.backward()
        update()
        losses.append(float(np.mean(comm.all_gather_object(loss.item()))))
        state["step"] += 1
        if state["step"] == save_at:
            dcp.save({"app": app, "step": state["step"], "rng": minipar.get_rng_state()},
                     checkpoint_id=folder)
    return losses, [minipar.to_numpy(p.data).tolist() for p in model.parameters()]


def two_ranks_body(folder):
    """Resume checks with dropout; then the checkpoints the reshard tests load (no dropout)."""
    from minipar import comm

    world, out = comm.world(), {}
    for kind in ("ddp", "zero1", "zero2", "ps", "ps-sharded"):
        where = os.path.join(folder, f"{kind}-dropout")
        reference, final = dp_run(kind, world, 0.1, where, 2 * K, save_at=K)
        resumed, params = dp_run(kind, world, 0.1, where, K, load=True)
        out[kind] = {"bit-identical": resumed == reference[K:] and params == final,
                     "reference": reference[K:], "resumed": resumed}
        losses, _ = dp_run(kind, world, 0.0, os.path.join(folder, kind), 2 * K, save_at=K)
        out[kind]["after save"] = losses[K:]
    return out


def four_ranks_body(folder):
    """ZeRO-1 of 2 ranks on 4; the one-server parameter server of 2 ranks sharded over 4."""
    from minipar import comm
    return {f"{saved} as {kind}": dp_run(kind, comm.world(), 0.0, os.path.join(folder, saved),
                                          K, load=True)[0]
            for saved, kind in (("zero1", "zero1"), ("ps", "ps-sharded"))}


# ---------------------------------------------------------------- 3D (4 ranks)

def trainer_run(folder, tp, pp, dropout, steps, load=False, save_at=None):
    import minipar
    from minipar import comm
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D

    groups = ParallelGroups(comm.world(), tp=tp, pp=pp)
    trainer = Trainer3D(gpt_config(dropout), groups, microbatches=2, dtype="float64",
                        seed=0 if not load else 99, make_optimizer=make_optimizer)
    state = {"trainer": trainer, "step": 0, "rng": minipar.get_rng_state()}
    if load:
        dcp.load(state, checkpoint_id=folder)
        minipar.set_rng_state(state["rng"])
    losses = []
    for ids, targets in batches()[state["step"]:state["step"] + steps]:
        losses.append(float(trainer.step(ids, targets)))  # a device scalar until read
        state["step"] += 1
        if state["step"] == save_at:
            dcp.save({"trainer": trainer, "step": state["step"], "rng": minipar.get_rng_state()},
                     checkpoint_id=folder)
    params = [minipar.to_numpy(p.data).tolist() for p in trainer.pipe.params]
    return losses, params


def trainer_body(folder):
    resume = os.path.join(folder, "3d-dropout")
    reference, final = trainer_run(resume, 2, 2, 0.1, 2 * K, save_at=K)
    resumed, params = trainer_run(resume, 2, 2, 0.1, K, load=True)
    reshard = os.path.join(folder, "3d")
    before, _ = trainer_run(reshard, 2, 2, 0.0, 2 * K, save_at=K)
    after, _ = trainer_run(reshard, 1, 4, 0.0, K, load=True)
    return {"bit-identical": resumed == reference[K:] and params == final,
            "reference": reference[K:], "resumed": resumed,
            "tp2 pp2": before[K:], "tp1 pp4": after}


# ---------------------------------------------------------------- the serial side, in pytest

def serial_after_load(folder, key="app"):
    """Load a checkpoint of any layout into the serial GPT and AdamW in THIS process (no
    mpiexec), then train the K steps after it: the global losses."""
    import minipar
    from minipar import nn
    from minipar.distributed import AppState, checkpoint as dcp

    minipar.manual_seed(7)
    model = nn.GPT(gpt_config(0.0)).double()
    opt = make_optimizer(model.parameters())
    state = {key: AppState(model, opt), "step": None}
    dcp.load(state, checkpoint_id=folder)
    losses = []
    for ids, targets in batches()[state["step"]:]:
        model.zero_grad()
        loss = model(ids, targets)[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dcp"))
    results = run_on_ranks(two_ranks_body, 2, args=(folder,), timeout=240)
    return folder, results


@pytest.mark.mpi
def test_data_parallel_resume_is_bit_identical(data_parallel):
    _, results = data_parallel
    for rank, out in enumerate(results):
        for kind, result in out.items():
            assert result["bit-identical"], (rank, kind, result)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "ps", "ps-sharded"])
def test_two_ranks_to_a_plain_process(data_parallel, kind):
    folder, results = data_parallel
    losses = serial_after_load(os.path.join(folder, kind))
    np.testing.assert_allclose(losses, results[0][kind]["after save"], rtol=0,
                               atol=RESHARD_TOLERANCE)


@pytest.mark.mpi
def test_zero1_and_parameter_server_two_ranks_to_four(data_parallel):
    folder, results = data_parallel
    for ranks in run_on_ranks(four_ranks_body, 4, args=(folder,), timeout=240):
        for kind, losses in ranks.items():
            np.testing.assert_allclose(losses, results[0][kind.split(" ")[0]]["after save"],
                                       rtol=0, atol=RESHARD_TOLERANCE, err_msg=kind)


@pytest.mark.mpi
def test_3d_resume_and_tp2_pp2_to_tp1_pp4_and_serial(tmp_path):
    results = run_on_ranks(trainer_body, 4, args=(str(tmp_path),), timeout=300)
    for rank, out in enumerate(results):
        assert out["bit-identical"], (rank, out)
        np.testing.assert_allclose(out["tp1 pp4"], out["tp2 pp2"], rtol=0,
                                   atol=RESHARD_TOLERANCE, err_msg=f"rank {rank}")
    serial = serial_after_load(str(tmp_path / "3d"), key="trainer")
    np.testing.assert_allclose(serial, results[0]["tp2 pp2"], rtol=0, atol=RESHARD_TOLERANCE)


LESSON = os.path.join(os.path.dirname(__file__), "..", "lessons", "11_3d_parallel.py")


@pytest.mark.mpi
def test_lesson11_saves_and_resumes_in_another_layout(tmp_path):
    """TP 2 x PP 2 saves; TP 1 x PP 4 resumes at step 4 and checks itself against the serial
    GPT loaded from the same checkpoint (the lesson asserts it)."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_on_ranks(LESSON, 4, args=("--quick", "--save", first), timeout=240)
    run_on_ranks(LESSON, 4, args=("--quick", "--tp", "1", "--pp", "4", "--resume", first,
                                  "--save", second), timeout=240)
    from minipar.distributed import checkpoint as dcp
    state = {"step": None}
    dcp.load(state, checkpoint_id=second)
    assert state["step"] == 8
