"""Staged transfers (comm/staging.py): with MINIPAR_CUDA_AWARE=0 a device array goes device ->
host buffer -> MPI -> host buffer -> device, and the host buffers are reused, not made per call.

Without a GPU the device array is faked (a NumPy array the comm layer is told lives on a
device); under MINIPAR_DEVICE=strict, and on a GPU with CuPy (pinned buffers), the same body
runs on real device arrays."""
import numpy as np
import pytest

from minipar import backend
from minipar.testing import run_on_ranks

FORCE_STAGING = {"MINIPAR_CUDA_AWARE": "0"}


def test_buffers_are_reused_by_size_and_never_handed_out_twice():
    from minipar.comm.staging import KEEP, MIN_BYTES, HostBuffers

    pool = HostBuffers()
    a, key_a = pool.take(np.zeros((10, 3), "float32"))
    b, key_b = pool.take(np.zeros(7, "float64"))  # a is still in flight: b is another buffer
    assert a.shape == (10, 3) and a.dtype == np.float32 and b.dtype == np.float64
    assert key_a[1] is not key_b[1] and key_a[1].size == MIN_BYTES
    pool.give(key_a)
    pool.give(key_b)
    c, key_c = pool.take(np.zeros(MIN_BYTES // 8, "int64"))  # the same size class: reused
    assert any(key_c[1] is k[1] for k in (key_a, key_b)) and pool.counts["buffers_made"] == 2
    big, key_big = pool.take(np.zeros(MIN_BYTES + 1, "uint8"))
    assert key_big[1].size == 2 * MIN_BYTES  # the next power of two
    keys = [pool.take(np.zeros(3))[1] for _ in range(KEEP + 3)]
    for key in keys:
        pool.give(key)
    assert sum(len(free) for free in pool._free.values()) <= 2 * KEEP  # bounded, not leaking
    pool.clear()
    assert pool._free == {} and pool.counts["buffers_made"] == 0


class DeviceArray(np.ndarray):
    """A NumPy array the comm layer is told lives on a device (CuPy's get/set to move it)."""

    def get(self, stream=None, order="C", out=None, blocking=True):
        out[...] = self.view(np.ndarray)
        return out

    def set(self, host, stream=None):
        self.view(np.ndarray)[...] = host


def staged_rounds(mode, rounds, n):
    """Every point-to-point call and MPI's all-reduce and broadcast on device arrays, ``rounds``
    times: returns what staging counted per round and the values that arrived."""
    from minipar import backend, comm
    from minipar.comm import staging

    if mode == "fake":
        backend.is_gpu_array = lambda a: isinstance(a, DeviceArray)
        backend.get_array_module = lambda *arrays: np
        device, host = (lambda a: np.asarray(a).view(DeviceArray)), np.asarray
    else:
        device, host = backend.asarray, backend.to_numpy
    world = comm.world()
    assert not world.is_cuda_aware()
    me, peer = world.rank, 1 - world.rank
    x = device(np.arange(n, dtype="float32") + 1000 * me)
    out = device(np.zeros(n, dtype="float32"))
    counted, seen = [], []
    for _ in range(rounds):
        before = staging.stats()
        if me == 0:
            world.send(x, 1)
            world.recv(out, 1)
        else:
            world.recv(out, 0)
            world.send(x, 0)
        seen.append(float(host(out)[1]))
        world.sendrecv(x, peer, out, peer)
        seen.append(float(host(out)[1]))
        request = world.irecv(out, peer)
        world.isend(x, peer).wait()
        request.wait()
        seen.append(float(host(out)[1]))
        p2p = {k: v - before[k] for k, v in staging.stats().items()}
        assert p2p["bytes_to_host"] == 3 * 4 * n and p2p["bytes_to_device"] == 3 * 4 * n, p2p
        total = world.all_reduce(x, algorithm="mpi")
        seen.append(float(host(total)[1]))
        y = device(np.arange(n, dtype="float32") + 1000 * me)
        world.all_reduce(y, algorithm="mpi", out=y)
        seen.append(float(host(y)[1]))
        world.broadcast(y, root=1, algorithm="mpi")
        seen.append(float(host(y)[1]))
        counted.append({k: v - before[k] for k, v in staging.stats().items()})
    return {"counted": counted, "seen": seen,
            "cached": sum(len(free) for free in staging.BUFFERS._free.values())}


def check_staged(results, n, rounds):
    for rank, result in enumerate(results):
        peer = 1 - rank
        arrived = [1 + 1000 * peer] * 3 + [2 + 1000] * 3  # element 1 of x, then of the sums
        assert result["seen"] == arrived * rounds, result["seen"]
        first, *rest = result["counted"]
        assert first["bytes_to_host"] >= 5 * 4 * n and first["buffers_made"] >= 1
        for later in rest:  # the same traffic every round, and not one buffer more
            assert later["bytes_to_host"] == first["bytes_to_host"]
            assert later["bytes_to_device"] == first["bytes_to_device"]
            assert later["buffers_made"] == 0, result["counted"]
        assert 0 < result["cached"] <= 8


NO_STRICT = "strict" not in getattr(backend, "_VALID_DEVICES", ())
NO_GPU = backend._cupy_or_none() is None


@pytest.mark.mpi
@pytest.mark.parametrize("device, n", [
    ("cpu", 5000),  # the faked device array
    pytest.param("strict", 5000, marks=pytest.mark.skipif(NO_STRICT, reason="no strict device")),
    pytest.param("gpu", 300_000, marks=[pytest.mark.gpu,  # 1.2 MB: pinned, past the smallest
                                        pytest.mark.skipif(NO_GPU, reason="needs CuPy, a GPU")]),
])
def test_staging_goes_through_reused_host_buffers(device, n):
    rounds = 3
    results = run_on_ranks(staged_rounds, nprocs=2, timeout=120,
                           args=("fake" if device == "cpu" else "device", rounds, n),
                           env={"MINIPAR_DEVICE": device, **FORCE_STAGING})
    check_staged(results, n, rounds)
