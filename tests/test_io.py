"""minipar.save / minipar.load: the tree comes back as it went in, damage is an error naming the
file, no pickle is ever run, and a serial run resumes to the bit."""
import io
import os
import pickle

import numpy as np
import pytest

import minipar
from minipar import to_numpy
from minipar import nn, optim
from minipar.io import MAGIC, CheckpointError
from minipar.testing import train_serial


def test_round_trip_keeps_types_keys_and_bits(tmp_path):
    t = minipar.tensor([1.0, 2.0], requires_grad=True)
    p = nn.Linear(2, 3).weight
    obj = {"int keys": {0: "a", 7: [1, 2.5]}, (1, "tuple key"): (None, True, False),
           "floats": [float("nan"), float("inf"), -0.0, 0.1, 2**-1074], "big": 2**80,
           "tensor": t, "frozen": minipar.tensor([3.0]), "param": p, "scalar": np.float32(1.5),
           "arrays": [np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros((0, 4)),
                      np.array(7.0)], "empty": {}, "nested": [[], ()], "text": "héllo"}
    path = tmp_path / "ckpt"
    assert minipar.save(obj, path) == path
    assert os.listdir(tmp_path) == ["ckpt"]  # exactly the path given: no suffix, no leftovers
    back = minipar.load(path)
    assert list(back) == list(obj)
    assert back["int keys"] == {0: "a", 7: [1, 2.5]} and back[(1, "tuple key")] == (None, True,
                                                                                     False)
    f = back["floats"]
    assert np.isnan(f[0]) and f[1] == float("inf") and str(f[2]) == "-0.0" and f[3] == 0.1
    assert f[4] == 2**-1074 and back["big"] == 2**80 and back["text"] == "héllo"
    assert type(back["tensor"]) is minipar.Tensor and back["tensor"].requires_grad
    assert not back["frozen"].requires_grad and isinstance(back["param"], nn.Parameter)
    np.testing.assert_array_equal(back["param"].numpy(), p.numpy())
    assert back["scalar"] == np.float32(1.5) and back["scalar"].dtype == np.float32
    for a, b in zip(back["arrays"], obj["arrays"]):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert back["empty"] == {} and back["nested"] == [[], ()]


def test_unsupported_leaf_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"obj\['model'\]\['x'\] is a set"):
        minipar.save({"model": {"x": {1, 2}}}, tmp_path / "c")
    assert not os.listdir(tmp_path)


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c"
    minipar.save({"step": 1}, path)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        minipar.save({"step": 2}, path)
    assert os.listdir(tmp_path) == ["c"]  # the temporary file is gone
    assert minipar.load(path) == {"step": 1}  # the old checkpoint is whole


def state():
    minipar.manual_seed(0)
    model = nn.Linear(8, 4)
    return {"model": model.state_dict(), "step": 3, "weights": [np.arange(100.0) + i for i in range(3)]}


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "flip trailer"])
def test_damage_is_an_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "c"
    minipar.save(state(), path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "append":
        data += b"\0"
    else:
        data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(path)):
        minipar.load(path)


def test_every_flipped_byte_is_caught_and_array_damage_names_the_entry(tmp_path):
    path = tmp_path / "c"
    minipar.save(state(), path)
    good = path.read_bytes()
    entries = {}  # entry -> a byte in the middle of its data
    with np.load(io.BytesIO(good[:-len(MAGIC) - 64])) as npz:
        for name in npz.files:
            raw = npz[name].tobytes()
            entries[name] = good.index(raw) + len(raw) // 2
    for i in range(0, len(good), 13):
        data = bytearray(good)
        data[i] ^= 0x04
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=str(path)):
            minipar.load(path)
    for name, at in entries.items():  # a bit inside an array's data: the entry is named
        data = bytearray(good)
        data[at] ^= 0x04
        path.write_bytes(bytes(data))
        expected = "structure" if name == "structure" else f"first damaged entry: '{name}'"
        with pytest.raises(CheckpointError, match=expected):
            minipar.load(path)


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_is_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"model": Exploit()}))
    with pytest.raises(CheckpointError, match="plain.pkl is not a minipar checkpoint"):
        minipar.load(plain)
    # an .npz with an object array and a valid trailer: NumPy's refusal is the last line
    crafted = tmp_path / "crafted.npz"
    good = minipar.io.to_bytes({"x": np.zeros(2)})
    buffer = io.BytesIO()
    with np.load(io.BytesIO(good[:-len(MAGIC) - 64])) as npz:
        structure = npz["structure"]
    np.savez(buffer, structure=structure, a0=np.array([Exploit()], dtype=object))
    payload = buffer.getvalue()
    import hashlib
    crafted.write_bytes(payload + MAGIC + hashlib.sha256(payload).hexdigest().encode())
    with pytest.raises(CheckpointError, match="'a0' is a pickled object array"):
        minipar.load(crafted)
    # and a bare .npz (no trailer) holding a pickle
    bare = tmp_path / "bare.npz"
    with open(bare, "wb") as f:
        np.savez(f, a0=np.array([Exploit()], dtype=object))
    with pytest.raises(CheckpointError, match="bare.npz is damaged"):
        minipar.load(bare)
    assert not (tmp_path / "pwned").exists()


def test_serial_resume_is_bit_identical(tmp_path):
    """k steps, save, k more = the reference; a fresh process state, load, k more = equal bits
    (dropout's masks included: the RNG state is in the checkpoint)."""
    config = nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16,
                          dropout=0.1)
    rng = np.random.default_rng(1)
    batches = [(ids, np.roll(ids, -1, axis=1))
               for ids in rng.integers(0, 16, size=(6, 4, 8))]
    k = 3
    minipar.manual_seed(0)
    model = nn.GPT(config).double()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    train_serial(model, opt, batches[:k])
    minipar.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                  "rng": minipar.get_rng_state(), "step": k}, tmp_path / "step3")
    reference = train_serial(model, opt, batches[k:])
    final = {n: a.copy() for n, a in model.state_dict().items()}

    minipar.manual_seed(123)  # a different start: everything must come from the file
    model = nn.GPT(config).double()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = minipar.load(tmp_path / "step3")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    minipar.set_rng_state(ckpt["rng"])
    assert ckpt["step"] == k
    resumed = train_serial(model, opt, batches[ckpt["step"]:])
    assert resumed == reference
    for name, array in model.state_dict().items():
        assert np.array_equal(to_numpy(array), to_numpy(final[name])), name


@pytest.mark.gpu
def test_cupy_goes_to_the_host_and_comes_back_on_the_device(tmp_path):
    from minipar import backend
    from minipar.distributed import AppState, checkpoint as dcp

    if backend._cupy_or_none() is None:
        pytest.skip("CuPy with a CUDA device is not available")
    previous = backend.device()
    backend.set_device("gpu")
    try:
        cp = backend.xp()
        obj = {"a": cp.arange(4.0), "t": minipar.tensor([1.0, 2.0], requires_grad=True)}
        minipar.save(obj, tmp_path / "c")
        back = minipar.load(tmp_path / "c")
        assert backend.is_gpu_array(back["a"]) and backend.is_gpu_array(back["t"].data)
        assert back["t"].requires_grad and cp.array_equal(back["a"], obj["a"])
        backend.set_device("cpu")
        assert isinstance(minipar.load(tmp_path / "c")["a"], np.ndarray)  # the current device
        backend.set_device("gpu")
        # a distributed checkpoint of a model on the GPU, loaded into another on the GPU
        minipar.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = optim.Adam(model.parameters(), lr=0.1)
        model(minipar.randn(2, 4)).sum().backward()
        opt.step()
        dcp.save({"app": AppState(model, opt)}, checkpoint_id=str(tmp_path / "d"))
        minipar.manual_seed(1)
        other = nn.Linear(4, 3)
        other_opt = optim.Adam(other.parameters(), lr=0.1)
        dcp.load({"app": AppState(other, other_opt)}, checkpoint_id=str(tmp_path / "d"))
        assert backend.is_gpu_array(other.weight.data)
        assert backend.is_gpu_array(other_opt.state[0]["exp_avg"])
        assert cp.array_equal(other.weight.data, model.weight.data)
        assert cp.array_equal(other_opt.state[0]["exp_avg"], opt.state[0]["exp_avg"])
    finally:
        backend.set_device(previous)


def test_a_bfloat16_tensor_comes_back_bfloat16(tmp_path):
    """.npz has no bfloat16 type: the file names it, so load reads the 2 bytes back as it."""
    import minipar
    from minipar import backend

    if backend.device() != "cpu":
        pytest.skip("bfloat16 lives on the CPU only")
    x = minipar.randn(3, 4, dtype="bfloat16", requires_grad=True)
    half = minipar.randn(5, dtype="float16")
    minipar.save({"x": x, "half": half, "raw": x.data}, tmp_path / "c.mp")
    back = minipar.load(tmp_path / "c.mp")
    assert back["x"].dtype == minipar.bfloat16 and back["raw"].dtype == minipar.bfloat16
    assert back["half"].dtype == minipar.float16
    assert (back["x"].data.view("uint16") == x.data.view("uint16")).all()
