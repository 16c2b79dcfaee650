"""One GPU per rank: a rank's GPU comes from its node-local rank (comm/node.py), GPU i mod count,
and MINIPAR_GPU overrides it. The GPU count is faked, so this runs without a GPU."""
import pytest

from minipar import backend
from minipar.testing import run_on_ranks


def test_ranks_of_a_node_spread_over_its_gpus():
    assert [backend.gpu_for(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [backend.gpu_for(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [backend.gpu_for(r, 1) for r in range(3)] == [0, 0, 0]  # CUDA_VISIBLE_DEVICES=one


def test_minipar_gpu_is_a_list_indexed_by_local_rank():
    assert [backend.gpu_for(r, 4, "1") for r in range(4)] == [1, 1, 1, 1]
    assert [backend.gpu_for(r, 4, "3,2") for r in range(4)] == [3, 2, 3, 2]
    assert [backend.gpu_for(r, 4, "0, 1,2,3") for r in range(4)] == [0, 1, 2, 3]
    assert [backend.gpu_for(r, 2, "") for r in range(3)] == [0, 1, 0]  # empty: unset


@pytest.mark.parametrize("value, words", [
    ("x", "expected a GPU index or a comma list"),
    ("0,,1", "expected a GPU index or a comma list"),
    ("4", "would use GPU 4, but this node has 4 GPU(s) (0..3)"),
    ("-1", "would use GPU -1"),
])
def test_a_bad_minipar_gpu_is_a_clear_error(value, words):
    with pytest.raises(ValueError, match="MINIPAR_GPU=") as error:
        backend.gpu_for(0, 4, value)
    assert words in str(error.value)


def test_no_gpu_is_an_error_not_a_division_by_zero():
    with pytest.raises(ValueError, match="no GPU"):
        backend.gpu_for(0, 0)


def test_select_gpu_is_a_no_op_on_the_cpu():
    if backend.device() == "gpu":
        pytest.skip("a GPU is here")
    assert backend.select_gpu(3) is None


class FakeCupy:
    """Just what select_gpu asks of CuPy: the device count, and Device(i).use()."""

    def __init__(self, count):
        fake = self
        self.count, self.used = count, []

        class Device:
            def __init__(self, index):
                self.index = index

            def use(self):
                fake.used.append(self.index)

        runtime = type("runtime", (), {"getDeviceCount": staticmethod(lambda: fake.count)})
        self.cuda = type("cuda", (), {"Device": Device, "runtime": runtime})


def choose_gpus(count, more_counts):
    """On every rank: fake a node with ``count`` GPUs, then ask comm.world() (which finds the
    local rank and hands it to backend.select_gpu); then the same rank with other counts."""
    import os

    from minipar import backend, comm

    cupy = FakeCupy(count)
    backend.device, backend.xp = (lambda: "gpu"), (lambda: cupy)
    world = comm.world()
    chosen = {count: world.gpu}
    for n in more_counts:
        cupy.count = n
        chosen[n] = backend.select_gpu(world.local.rank)
    os.environ["MINIPAR_GPU"] = "3,2"
    cupy.count = 4
    chosen["MINIPAR_GPU=3,2"] = backend.select_gpu(world.local.rank)
    assert cupy.used == list(chosen.values())  # the chosen device was made current each time
    return {"local": list(world.local), "gpus": {str(k): v for k, v in chosen.items()}}


@pytest.mark.mpi
def test_four_ranks_on_one_node_pick_distinct_gpus():
    results = run_on_ranks(choose_gpus, nprocs=4, args=(4, [2, 1]), timeout=60)
    assert [r["local"] for r in results] == [[0, 4, 1], [1, 4, 1], [2, 4, 1], [3, 4, 1]]
    by_count = {k: [r["gpus"][k] for r in results] for k in results[0]["gpus"]}
    assert by_count == {"4": [0, 1, 2, 3], "2": [0, 1, 0, 1], "1": [0, 0, 0, 0],
                        "MINIPAR_GPU=3,2": [3, 2, 3, 2]}


def world_on_this_machine():
    from minipar import comm

    world = comm.world()
    return [list(world.local), world.gpu]


@pytest.mark.mpi
def test_world_knows_its_node_and_keeps_the_cpu():
    results = run_on_ranks(world_on_this_machine, nprocs=2, timeout=60,
                           env={"MINIPAR_DEVICE": "cpu"})
    assert results == [[[0, 2, 1], None], [[1, 2, 1], None]]


def worker_thread_devices():
    """Fake a GPU for the caller; the all-reduce thread must make it current before it works."""
    import threading

    import numpy as np

    from minipar import comm
    from minipar.comm import nonblocking

    uses = []

    class Device:
        def use(self):
            uses.append(threading.current_thread().name)

    assert nonblocking.current_gpu() is None  # on the CPU: nothing to set
    nonblocking.current_gpu = Device
    world = comm.world()
    total = world.iall_reduce(np.ones(5), algorithm="ring").wait()
    assert total.tolist() == [world.size] * 5
    return uses


@pytest.mark.mpi
def test_the_all_reduce_thread_takes_the_callers_gpu_first():
    results = run_on_ranks(worker_thread_devices, nprocs=2, timeout=60,
                           env={"MINIPAR_DEVICE": "cpu"})
    assert results == [["minipar-iall_reduce"]] * 2


def gpu_worker_thread():
    from minipar import backend, comm

    cupy = backend.xp()
    world = comm.world()
    x = cupy.arange(6, dtype=cupy.float32)
    total = world.iall_reduce(x, algorithm="ring").wait()  # out=None: allocated by the thread
    assert total.device.id == world.gpu == cupy.cuda.Device().id, (total.device, world.gpu)
    assert cupy.asnumpy(total).tolist() == [world.size * v for v in range(6)]
    return world.gpu


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(backend._cupy_or_none() is None, reason="needs CuPy and a GPU")
def test_on_gpus_the_all_reduce_thread_runs_on_the_ranks_gpu():
    """With two GPUs rank 1 is on GPU 1: a thread left on GPU 0 would put the result there."""
    count = backend._cupy_or_none().cuda.runtime.getDeviceCount()
    results = run_on_ranks(gpu_worker_thread, nprocs=2, timeout=120, env={"MINIPAR_DEVICE": "gpu"})
    assert results == [0, 1 % count]
