"""Checkpoint faults, each bounded in time: a checkpoint altered on disk (a flipped bit, a
truncation, an appended byte, a missing shard, the manifest of another save, shard files swapped)
is an error naming the file and nothing is loaded; a rank killed with SIGKILL during training
ends the job within 10 s and the checkpoint saved before stays loadable; a rank killed in the
middle of a save leaves an incomplete checkpoint that is refused, naming what is missing, and
temporary files that the next save removes.

Every case prints its seconds (``pytest -s``) for the record."""
import os
import shutil
import signal
import time

import numpy as np
import pytest

from minipar import to_numpy
from minipar.testing import run_on_ranks

BOUND = 10.0  # seconds: a generous bound on a shared 2-core machine, not a benchmark
STEPS_BEFORE_KILL = 2



def same(a, b):
    """Equal values wherever the arrays live (MINIPAR_DEVICE=strict or gpu: host copies)."""
    return np.array_equal(to_numpy(a), to_numpy(b))

def record(case, seconds):
    print(f"\n[fault ckpt] {case}: {seconds:.2f} s")
    assert seconds < BOUND, f"{case} took {seconds:.1f} s"


def model_and_state(seed):
    import minipar
    from minipar import nn, optim
    from minipar.distributed import AppState

    minipar.manual_seed(seed)
    model = nn.GPT(nn.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    model = model.double()
    return model, {"app": AppState(model, optim.AdamW(model.parameters(), lr=1e-2)),
                   "step": -1}


def train(comm, net, update, steps, save=None):
    ids = np.random.default_rng(1).integers(0, 16, size=(8, 8))
    rows = slice(comm.rank * 4, comm.rank * 4 + 4)
    for step in range(1, steps + 1):
        loss = net(ids[rows], np.roll(ids, -1, axis=1)[rows])[1]
        loss.backward()
        update()
        if save:
            save(step)


def save_two_runs_body(folder):
    """Two saves of the same layout (ZeRO-1 on 2 ranks): run a and run b, a step apart."""
    from minipar import comm
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.data import ZeRO
    from minipar import optim

    world = comm.world()
    model, _ = model_and_state(0)
    zero = ZeRO(model, lambda ps: optim.AdamW(ps, lr=1e-2), world)
    for run, steps in (("a", 1), ("b", 1)):
        train(world, model, zero.step, steps)
        dcp.save({"app": zero, "step": 1}, checkpoint_id=os.path.join(folder, run))


def load_damaged_body(folder):
    """Every rank loads the damaged checkpoint: each must raise naming the same file."""
    from minipar.distributed import checkpoint as dcp
    from minipar.io import CheckpointError

    _, state = model_and_state(5)
    try:
        dcp.load(state, checkpoint_id=folder)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saves")
    start = time.perf_counter()
    run_on_ranks(save_two_runs_body, 2, args=(str(folder),), timeout=120)
    record("save two checkpoints on 2 ranks (set-up)", time.perf_counter() - start)
    return folder


def flip_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def swap_shard_files(path):
    """Rewrite the manifest at ``path`` with its two shard files in each other's place (each
    still beside its own SHA-256): the files are whole, the order is wrong."""
    from minipar import io
    manifest = io.load(path)
    manifest["files"] = manifest["files"][::-1]
    io.save(manifest, path)


def shard(folder, rank):
    """The shard file of ``rank`` in ``folder`` (its name carries the save's id)."""
    found, = folder.glob(f"shard-{rank:05d}-*.npz")
    return found.name


DAMAGE = {
    "shard: one bit flipped in the middle": (1, flip_middle),
    "shard: truncated by one byte": (1, lambda p: p.write_bytes(p.read_bytes()[:-1])),
    "shard: truncated to half": (0, lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size
                                                                         // 2])),
    "shard: one byte appended": (0, lambda p: p.write_bytes(p.read_bytes() + b"\n")),
    "shard: missing": (1, os.unlink),
    "manifest: one bit flipped in the middle": ("manifest.npz", flip_middle),
    "manifest: missing": ("manifest.npz", os.unlink),
    "manifest: from another save": ("manifest.npz",
                                    lambda p: shutil.copy(p.parent.parent / "b" / p.name, p)),
    "manifest: two shard files swapped": ("manifest.npz", swap_shard_files),
}


@pytest.mark.fault
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_altered_checkpoint_is_refused_and_nothing_loads(two_saves, tmp_path, case):
    name, damage = DAMAGE[case]
    folder = tmp_path / "a"
    shutil.copytree(two_saves / "a", folder)
    shutil.copytree(two_saves / "b", tmp_path / "b")
    name = shard(folder, name) if isinstance(name, int) else name
    damage(folder / name)
    from minipar.distributed import checkpoint as dcp
    from minipar.io import CheckpointError

    model, state = model_and_state(5)
    before = {n: a.copy() for n, a in model.state_dict().items()}
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as error:
        dcp.load(state, checkpoint_id=str(folder))
    record(case, time.perf_counter() - start)
    # b's manifest names b's shard files, which folder a lacks
    expected = shard(tmp_path / "b", 0) if case == "manifest: from another save" else name
    assert str(folder / expected) in str(error.value)
    if case == "manifest: two shard files swapped":  # which file holds which shard, and where
        assert (f"lists {folder / shard(folder, 1)} as rank 0's shard file, but it holds rank "
                f"1's") in str(error.value)
    assert state["step"] == -1 and not state["app"].optimizer.state  # nothing loaded
    for n, a in model.state_dict().items():
        assert same(a, before[n]), n
    dcp.load(state, checkpoint_id=str(two_saves / "a"))  # the intact copy loads
    assert state["step"] == 1


@pytest.mark.fault
def test_every_rank_refuses_a_damaged_shard(two_saves, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(two_saves / "a", folder)
    name = shard(folder, 1)
    flip_middle(folder / name)
    start = time.perf_counter()
    messages = run_on_ranks(load_damaged_body, 2, args=(str(folder),), timeout=60)
    record("2 ranks load a checkpoint with a flipped bit in rank 1's shard",
           time.perf_counter() - start)
    for message in messages:
        assert str(folder / name) in message and "damaged" in message


def killed_body(folder, victim, when):
    """Train ZeRO-1 on 2 ranks, saving every step into folder/step-N; rank ``victim`` kills
    itself with SIGKILL during training after step STEPS_BEFORE_KILL was saved (``when`` =
    "training"), or in the middle of the next save, after writing its shard ("saving")."""
    from minipar import comm, io
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.data import ZeRO
    from minipar import optim

    world = comm.world()
    model, _ = model_and_state(0)
    zero = ZeRO(model, lambda ps: optim.AdamW(ps, lr=1e-2), world)

    def die():
        with open(os.path.join(folder, "killed-at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def save(step):
        if step > STEPS_BEFORE_KILL and world.rank == victim and when == "training":
            die()
        if step > STEPS_BEFORE_KILL and world.rank == victim and when == "saving":
            write = io.write_atomic

            def write_then_die(path, data):
                write(path, data)
                die()

            io.write_atomic = write_then_die
        dcp.save({"app": zero, "step": step}, checkpoint_id=os.path.join(folder, f"step-{step}"))

    train(world, model, zero.step, STEPS_BEFORE_KILL + 3, save=save)


@pytest.mark.fault
@pytest.mark.parametrize("when", ["training", "saving"])
def test_killed_rank_ends_the_job_and_the_last_checkpoint_loads(tmp_path, when):
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(killed_body, 2, args=(str(tmp_path), 1, when), timeout=60)
    ended = time.time()
    killed = float((tmp_path / "killed-at").read_text())
    record(f"rank 1 killed (SIGKILL) while {when}: the job ends", ended - killed)
    assert "rank" in str(failure.value)
    from minipar.distributed import checkpoint as dcp
    from minipar.io import CheckpointError

    _, state = model_and_state(5)
    dcp.load(state, checkpoint_id=str(tmp_path / f"step-{STEPS_BEFORE_KILL}"))
    assert state["step"] == STEPS_BEFORE_KILL
    assert state["app"].optimizer.state[0]["step"] == STEPS_BEFORE_KILL
    incomplete = tmp_path / f"step-{STEPS_BEFORE_KILL + 1}"
    if when == "saving":  # the save that was cut short has shards but no manifest
        with pytest.raises(CheckpointError, match=f"{incomplete / 'manifest.npz'} does not exist"):
            dcp.load(state, checkpoint_id=str(incomplete))
    assert state["step"] == STEPS_BEFORE_KILL


def failed_write_body(folder):
    """Rank 1 cannot write its shard (a full disk): every rank's save raises, naming rank 1."""
    from minipar import comm, io
    from minipar.distributed import checkpoint as dcp

    world = comm.world()
    model, state = model_and_state(0)
    if world.rank == 1:
        def full_disk(path, data):
            raise OSError(28, "No space left on device")

        io.write_atomic = full_disk
    try:
        dcp.save(state, checkpoint_id=folder)
    except RuntimeError as e:
        return str(e)
    return "saved"


@pytest.mark.fault
def test_a_failed_shard_write_is_an_error_on_every_rank(tmp_path):
    start = time.perf_counter()
    messages = run_on_ranks(failed_write_body, 2, args=(str(tmp_path / "c"),), timeout=60)
    record("rank 1 cannot write its shard: every rank's save raises", time.perf_counter() - start)
    for message in messages:
        assert "rank 1: OSError" in message and "No space left" in message
    assert not (tmp_path / "c" / "manifest.npz").exists()  # no manifest: nothing claims a save


def resave_body(folder, fail_rank):
    """Save the untrained model, train a step, save again into the same folder while
    ``fail_rank`` cannot write its shard (a full disk)."""
    from minipar import comm, io
    from minipar.distributed import checkpoint as dcp

    world = comm.world()
    model, state = model_and_state(0)
    state["step"] = 1
    dcp.save(state, checkpoint_id=folder)
    train(world, model, state["app"].optimizer.step, 1)
    if world.rank == fail_rank:
        def full_disk(path, data):
            raise OSError(28, "No space left on device")

        io.write_atomic = full_disk
    state["step"] = 2
    with pytest.raises(RuntimeError, match="No space left"):
        dcp.save(state, checkpoint_id=folder)


@pytest.mark.fault
def test_a_failed_resave_leaves_the_last_checkpoint_loadable(tmp_path):
    """Rank 0 has written its new shard when rank 1's write fails: the folder's checkpoint is
    still the first save, whole, and the failed save left no file behind."""
    folder = tmp_path / "c"
    run_on_ranks(resave_body, 2, args=(str(folder), 1), timeout=60)
    from minipar.distributed import checkpoint as dcp

    untrained, _ = model_and_state(0)
    before = untrained.state_dict()
    model, state = model_and_state(5)
    dcp.load(state, checkpoint_id=str(folder))
    assert state["step"] == 1
    for n, a in model.state_dict().items():
        assert same(a, before[n]), n
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["manifest.npz", shard(folder, 0), shard(folder, 1)])


def test_a_resave_whose_manifest_fails_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    """One process: the shard is written, the manifest is not (the disk fills up between them);
    a later successful save removes the earlier save's shard."""
    from minipar import io
    from minipar.distributed import checkpoint as dcp

    folder = str(tmp_path / "c")
    model, state = model_and_state(0)
    state["step"] = 1
    dcp.save(state, checkpoint_id=folder)
    saved = {n: a.copy() for n, a in model.state_dict().items()}
    for a in model.state_dict().values():
        a += 1.0
    write, calls = io.write_atomic, []

    def full_after_one(path, data):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        write(path, data)

    monkeypatch.setattr(io, "write_atomic", full_after_one)
    state["step"] = 2
    with pytest.raises(RuntimeError, match="No space left"):
        dcp.save(state, checkpoint_id=folder)
    monkeypatch.setattr(io, "write_atomic", write)
    other, loaded = model_and_state(5)
    dcp.load(loaded, checkpoint_id=folder)
    assert loaded["step"] == 1
    for n, a in other.state_dict().items():
        assert same(a, saved[n]), n
    dcp.save(state, checkpoint_id=folder)
    assert len(os.listdir(folder)) == 2  # the manifest and this save's one shard
    dcp.load(loaded, checkpoint_id=folder)
    assert loaded["step"] == 2


KILLED_MID_SAVE = """
import os, signal
import numpy as np
from minipar.distributed import checkpoint as dcp
# killed as its shard's temporary file is about to become the shard: the file stays behind
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
dcp.save({"x": np.zeros(4), "step": 2}, checkpoint_id=%r)
"""


@pytest.mark.fault
def test_the_next_save_removes_the_temporary_files_of_a_killed_save(tmp_path):
    """A process killed in the middle of a re-save leaves its shard's temporary file; the next
    save into the folder removes it (and the manifest's), not another program's."""
    import subprocess
    import sys

    from minipar.distributed import checkpoint as dcp

    folder = tmp_path / "c"
    dcp.save({"x": np.arange(4.0), "step": 1}, checkpoint_id=str(folder))
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE % str(folder)], timeout=60,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert killed.returncode == -signal.SIGKILL
    left = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".shard-00000-"), left
    (folder / ".manifest.npz.k1ll3d_x.tmp").write_bytes(b"half a manifest")
    (folder / ".notes.txt.abcd1234.tmp").write_text("another program's")
    state = {"x": np.arange(4.0) + 1, "step": 3}
    dcp.save(state, checkpoint_id=str(folder))
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".notes.txt.abcd1234.tmp", "manifest.npz", shard(folder, 0)])
    dcp.load(state, checkpoint_id=str(folder))
    assert state["step"] == 3
