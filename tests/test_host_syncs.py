"""The training step reads no device data on the host unless asked to (MINIPAR_DEBUG=1).

Reading a GPU array from the host (``bool``, ``int``, ``float``, ``.item()``, a copy to NumPy)
makes the host wait for every kernel queued before it: one such read per micro-batch or per
parameter turns an asynchronous GPU into a synchronous one. So the checks that read values
(target and id ranges) run on device arrays only under ``MINIPAR_DEBUG=1`` (``backend.debug()``),
sums stay on the device (clipping, the pipeline's loss), and point-to-point calls wait for the
stream only where MPI touches device memory.

The proof needs no GPU: a fake device. ``Device`` arrays (a NumPy subclass) stand for CuPy's,
the backend is told they are device arrays, its array module makes them, and every way of
reading one on the host is noted in ``Device.reads``. A GPT step, clipping, a pipeline step and
the p2p buffers are run on them and must note nothing; under the debug switch the checks read,
and a bad id or target raises the same error it raises on the CPU.
"""
import os
import subprocess
import sys

import numpy
import pytest

import minipar
from minipar import backend, functional as F, nn, optim


HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "__iter__", "item", "tolist")


def _noted(name):
    """ndarray's own ``name``, noting the host read in ``Device.reads`` first."""
    def read(self, *args):
        Device.reads.append(name.strip("_"))
        return getattr(numpy.ndarray, name)(self, *args)
    return read


def _set(self, host):  # CuPy's host -> device copy
    self[...] = host


# A stand-in device array: NumPy arithmetic, every host read noted.
Device = type("Device", (numpy.ndarray,),
              {"reads": [], "set": _set, **{name: _noted(name) for name in HOST_READS}})


def on_device(a):
    if isinstance(a, numpy.generic) or type(a) is numpy.ndarray:
        return numpy.asarray(a).view(Device)
    return a


class FakeCupy:
    """numpy's namespace, its functions' results made Device arrays (as CuPy's are)."""
    def __getattr__(self, name):
        f = getattr(numpy, name)
        if isinstance(f, (type, numpy.ufunc)) or not callable(f):
            return f  # dtypes, ndarray, ufuncs (they keep the subclass themselves), submodules

        def made_on_device(*args, **kwargs):
            out = f(*args, **kwargs)
            return tuple(map(on_device, out)) if isinstance(out, tuple) else on_device(out)
        return made_on_device


@pytest.fixture
def device(monkeypatch):
    """The fake device in place; yields the list of host reads (and stream syncs)."""
    fake = FakeCupy()
    reads = []
    monkeypatch.setattr(Device, "reads", reads)
    monkeypatch.setattr(backend, "xp", lambda: fake)
    monkeypatch.setattr(backend, "get_array_module", lambda *arrays: fake)
    monkeypatch.setattr(backend, "is_gpu_array", lambda a: isinstance(a, Device))
    monkeypatch.setattr(backend, "to_numpy", lambda a: reads.append("to_numpy") or numpy.asarray(a))
    monkeypatch.setattr(backend, "synchronize", lambda: reads.append("synchronize"))
    monkeypatch.setattr(backend, "_state", dict(backend._state, debug=False))
    return reads


def tiny_gpt():
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    for p in model.parameters():
        p.data = p.data.view(Device)
    return model


def batch(vocab=11):
    rng = numpy.random.default_rng(1)
    ids = rng.integers(0, vocab, size=(2, 8))
    return on_device(ids), on_device(numpy.roll(ids, -1, axis=1))


def gpt_step(model, opt, ids, targets):
    _, loss = model(ids, targets)
    opt.zero_grad()
    loss.backward()
    total = optim.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return loss, total


def test_a_gpt_step_with_clipping_reads_nothing_on_the_host(device):
    model = tiny_gpt()
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = batch()
    for _ in range(2):
        loss, total = gpt_step(model, opt, ids, targets)
    assert device == [], f"host reads on the training step: {device}"
    assert isinstance(loss.data, Device) and isinstance(total, Device)
    assert all(isinstance(p.data, Device) for p in model.parameters())
    assert 0 < float(total) and float(loss.data) > 0  # asked for: now, and only now, a read
    assert device == ["float", "float"]


def test_the_debug_switch_brings_the_checks_back(device):
    model = tiny_gpt()
    ids, targets = batch()
    backend.set_debug(True)
    model(ids, targets)
    assert "int" in device and "bool" in device, device  # the id range, the target range


def test_clip_grad_norm_on_the_device_matches_the_host_formula(device):
    rng = numpy.random.default_rng(0)
    grads = [rng.standard_normal(s).astype("float32") for s in [(3, 4), (5,)]]
    for max_norm in (0.1, 100.0):
        params = [nn.Parameter(on_device(numpy.zeros_like(g))) for g in grads]
        for p, g in zip(params, grads):
            p.grad = on_device(g)
        total = optim.clip_grad_norm_(params, max_norm)
        assert device == []
        want = numpy.sqrt(sum((g.astype("float64") ** 2).sum() for g in grads))
        coef = min(1.0, max_norm / (want + 1e-6))
        assert numpy.asarray(total) == pytest.approx(want)
        for p, g in zip(params, grads):
            numpy.testing.assert_allclose(numpy.asarray(p.grad), g * numpy.float32(coef),
                                          rtol=1e-6)
            assert p.grad.dtype == numpy.float32


def test_a_pipeline_step_keeps_its_losses_on_the_device(device):
    from minipar import comm
    from minipar.parallel.pipeline import Pipeline, build

    model = tiny_gpt().to_sequential()
    for p in model.parameters():
        p.data = p.data.view(Device)
    pipe = Pipeline(model, build("gpipe", 1, 2), comm.world(), F.cross_entropy,
                    optimizer=lambda ps: optim.SGD(ps, lr=0.1))
    ids, targets = batch()
    loss = pipe.step(ids, targets)
    assert device == [], f"host reads in the pipeline step: {device}"
    assert isinstance(loss, Device) and loss.dtype == numpy.float64 and loss.shape == ()


@pytest.mark.parametrize("aware", [True, False])
def test_p2p_buffers_wait_for_the_stream_only_where_mpi_reads_the_device(device, aware):
    """Host arrays never wait for the GPU; a device buffer handed to a CUDA-aware MPI waits once
    per call. (The staged path, a device -> host copy that waits by itself, is staging's own
    test's.)"""
    from minipar.comm import wire

    def buffer(made):  # send_buffer gives the buffer, or (buffer, done)
        return made[0] if isinstance(made, tuple) else made

    host = numpy.arange(4.0)
    assert buffer(wire.send_buffer(host, aware)) is host
    assert buffer(wire.recv_buffer(host, aware)) is host
    assert buffer(wire.inout_buffer(host, aware)) is host
    assert device == [], "host arrays must never wait for the GPU"
    if aware:
        dev = on_device(numpy.arange(4.0))
        for made in (wire.send_buffer(dev, aware), wire.recv_buffer(dev, aware),
                     wire.inout_buffer(dev, aware)):
            assert numpy.shares_memory(buffer(made), dev)  # the device memory itself
        assert device == ["synchronize"] * 3


# --- the moved checks still fire, with the same words -----------------------------------------

def test_a_bad_id_or_target_on_the_device_is_caught_under_the_debug_switch(device):
    weight = nn.Parameter(on_device(numpy.ones((4, 3), "float32")))
    logits = minipar.tensor(on_device(numpy.zeros((2, 5), "float32")))
    bad_ids, bad_targets = on_device(numpy.array([0, -1])), on_device(numpy.array([1, -2]))
    minipar.embedding(weight, bad_ids)  # unchecked: -1 is the last row, as in NumPy and CuPy
    F.cross_entropy(logits, bad_targets)  # unchecked: a wrong number, no host read
    assert device == []
    backend.set_debug(True)
    with pytest.raises(IndexError, match=r"embedding: ids must lie in \[0, 4\), got \[-1, 0\]"):
        minipar.embedding(weight, bad_ids)
    with pytest.raises(IndexError, match=r"cross_entropy: target values must lie in \[0, 5\) "
                                         r"\(or equal ignore_index=-100\), got -2 at position 1"):
        F.cross_entropy(logits, bad_targets)


def test_host_targets_are_checked_before_they_go_to_the_device(device):
    """Targets passed as a NumPy array are read where they are, for free, then moved."""
    logits = minipar.tensor(on_device(numpy.zeros((2, 5), "float32")))
    with pytest.raises(IndexError, match="got 7 at position 1"):
        F.cross_entropy(logits, numpy.array([1, 7]))
    assert device == []


def test_vocab_parallel_checks_under_the_debug_switch(device):
    from minipar import comm
    from minipar.parallel.tensor import VocabParallelEmbedding, vocab_parallel_cross_entropy

    minipar.manual_seed(0)
    table = VocabParallelEmbedding(6, 4, comm.world())
    table.weight.data = table.weight.data.view(Device)
    logits = minipar.tensor(on_device(numpy.zeros((2, 6), "float32")))
    bad_ids, bad_targets = on_device(numpy.array([[0, 6]])), on_device(numpy.array([-3, 2]))
    table(bad_ids)
    vocab_parallel_cross_entropy(logits, bad_targets, comm.world())
    assert device == []
    backend.set_debug(True)
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 6\), got \[0, 6\]"):
        table(bad_ids)
    with pytest.raises(IndexError, match=r"vocab_parallel_cross_entropy: target values must lie "
                                         r"in \[0, 6\) .*got -3 at position 0"):
        vocab_parallel_cross_entropy(logits, bad_targets, comm.world())


def test_host_arrays_are_always_checked():
    """NumPy arrays cost no sync to read: a student on a laptop gets the error at once."""
    w = nn.Parameter(numpy.ones((4, 3), "float32"))
    with pytest.raises(IndexError, match=r"got \[0, 9\]"):
        minipar.embedding(w, numpy.array([0, 9]))
    with pytest.raises(IndexError, match=r"got 5 at position 2"):
        F.cross_entropy(minipar.tensor(numpy.zeros((3, 5), "float32")), numpy.array([0, -100, 5]))


def test_one_switch_read_once_from_the_environment():
    code = ("from minipar import backend; from minipar.comm import buffers; "
            "print(backend.debug(), hasattr(buffers, 'DEBUG'))")
    for value, want in [("1", "True False"), ("0", "False False"), ("", "False False")]:
        env = dict(os.environ, MINIPAR_DEBUG=value, MINIPAR_DEVICE="cpu")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert out.split() == want.split(), (value, out)


# --- on a real GPU (skipped without CuPy): what the fake device cannot model -------------------

@pytest.mark.gpu
@pytest.mark.skipif(backend._cupy_or_none() is None, reason="CuPy with a CUDA device is not available")
def test_on_cupy_checks_wait_for_the_switch_and_sums_stay_on_the_device(monkeypatch):
    import cupy

    monkeypatch.setitem(backend._state, "debug", False)
    previous = backend.device()
    backend.set_device("gpu")
    try:
        logits = minipar.tensor(cupy.zeros((2, 5), "float32"), requires_grad=True)
        bad = cupy.asarray([1, -2])
        loss = F.cross_entropy(logits, bad)  # unchecked: no host read
        assert isinstance(loss.data, cupy.ndarray)
        p = nn.Parameter(cupy.ones(3, "float32"))
        p.grad = cupy.full(3, 2.0, "float32")
        total = optim.clip_grad_norm_([p], 1.0)
        assert isinstance(total, cupy.ndarray) and total.shape == ()
        assert float(total) == pytest.approx(12 ** 0.5)
        numpy.testing.assert_allclose(cupy.asnumpy(p.grad), 2.0 / (12 ** 0.5 + 1e-6), rtol=1e-6)
        backend.set_debug(True)
        with pytest.raises(IndexError, match="got -2 at position 1"):
            F.cross_entropy(logits, bad)
    finally:
        backend.set_device(previous)
