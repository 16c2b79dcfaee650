"""A student's first distributed program is usually wrong: every mistake of this file gives a
message that names the problem, on a job that ends by itself within seconds. Each case runs as a
plain ``mpiexec`` job (no harness around the ranks), with a short watchdog where a rank waits on
a peer that will never answer.

The seconds each job took are printed with ``pytest -s`` (the issue's table)."""
import textwrap

import numpy as np
import pytest

from minipar.testing import run_job

pytestmark = [pytest.mark.mpi, pytest.mark.fault]

WATCHDOG = {"MINIPAR_TIMEOUT": "2"}
BOUND = 10.0  # seconds a job may take to end, start-up included (generous: shared machines)

PRELUDE = """
import sys, time
import numpy as np
from minipar import comm
"""

CASES = {
    # name: (body run on every rank, expected words in the output, environment)
    "stuck peer": ("""
world = comm.world()
if world.rank == 1:
    time.sleep(3600)
world.all_reduce(np.ones(10))
""", ["no progress", "all_reduce #0", "rank 1 is not inside a minipar call"], WATCHDOG),
    "a rank skips a collective and exits 0": ("""
world = comm.world()
if world.rank == 0:
    world.all_reduce(np.ones(10), algorithm="ring")
""", ["reached the end of its program while rank 0 still waits for it", "all_reduce #0"], {}),
    "sys.exit() on one rank": ("""
world = comm.world()
if world.rank == 1:
    sys.exit()
world.all_reduce(np.ones(10))
""", ["rank 0 still waits for it", "all_reduce #0"], {}),
    "sys.exit(3) on one rank": ("""
world = comm.world()
if world.rank == 1:
    sys.exit(3)
world.barrier()
""", ["rank 0 still waits for it", "barrier"], {}),
    "exception before comm.world()": ("""
if __import__("mpi4py.MPI").MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("rank 1 fails before world()")
comm.world().barrier()
""", ["[rank 1]", "RuntimeError: rank 1 fails before world()"], {}),
    "send tag 1, receive tag 2": ("""
world = comm.world()
if world.rank == 0:
    world.send(np.ones(3), 1, tag=1)
else:
    world.recv(np.empty(3), 0, tag=2)
""", ["rank 1 still waits for it in recv from rank 0", "tag 2"], WATCHDOG),
    "both ranks send 8 MB first": ("""
world = comm.world()
world.send(np.ones(1 << 20), 1 - world.rank)
world.recv(np.empty(1 << 20), 1 - world.rank)
""", ["no progress", "send to rank", "waits in send to rank"], WATCHDOG),
    "empty on one rank, 10 elements on the other": ("""
world = comm.world()
world.all_reduce(np.ones(0 if world.rank == 0 else 10))
""", ["CommError", "0-byte receive buffer", "differ across ranks"], {}),
    "parameter_server on one rank, sequential on the other": ("""
world = comm.world()
world.all_reduce(np.ones(10), algorithm="parameter_server" if world.rank == 0 else "sequential")
""", ["no progress", "parameter_server", "sequential"], WATCHDOG),
    "ring on one rank, recursive_halving on the other": ("""
world = comm.world()
world.all_reduce(np.ones(4), algorithm="ring" if world.rank == 0 else "recursive_halving")
""", ["CommError", "algorithms differ across ranks", "ring", "recursive_halving"], {}),
    "sum on one rank, max on the other": ("""
world = comm.world()
world.all_reduce(np.ones(10), op="sum" if world.rank == 0 else "max", algorithm="ring")
""", ["CommError", "reduction ops differ across ranks"], {}),
    "all_reduce on one rank, broadcast on the other": ("""
world = comm.world()
x = np.ones(10)
if world.rank == 0:
    world.all_reduce(x, algorithm="ring")
else:
    world.broadcast(x, root=0)
print("second all-reduce gives", world.all_reduce(np.ones(10))[0])
""", ["CommError", "collectives differ across ranks", "broadcast #0", "all_reduce #0"], {}),
    "a skipped collective before a correct one": ("""
world = comm.world()
if world.rank == 0:
    world.all_reduce(np.ones(10), algorithm="ring")
world.all_reduce(np.ones(10), algorithm="ring")
""", ["rank 0 still waits for it", "all_reduce #1", "skipped a call"], {}),
    "mpi with int32 on one rank and float32 on the other": ("""
world = comm.world()
world.all_reduce(np.ones(10, "int32" if world.rank == 0 else "float32"), algorithm="mpi")
""", ["CommError", "disagree on an MPI collective", "dtypes differ across ranks"], {}),
    "a Tensor passed to all_reduce": ("""
import minipar
world = comm.world()
world.all_reduce(minipar.tensor([1.0, 2.0]))
""", ["CommError", "all_reduce takes a NumPy or CuPy array, got Tensor", "tensor.data"], {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_job_ends_with_a_message_naming_the_problem(case):
    body, words, env = CASES[case]
    status, output, seconds = run_job(PRELUDE + textwrap.dedent(body), 2, timeout=60, env=env)
    print(f"\n{case}: exit status {status}, ended in {seconds:.1f} s")
    assert status not in (None, 0), f"{case}: the job did not fail (status {status}):\n{output}"
    missing = [w for w in words if w not in output]
    assert not missing, f"{case}: {missing} not in the output:\n{output}"
    assert "second all-reduce gives" not in output, output  # no corrupted result after a mismatch
    assert seconds < BOUND, f"{case}: the job took {seconds:.1f} s to end:\n{output}"


def test_a_numpy_integer_peer_works_like_an_int():
    status, output, _ = run_job(PRELUDE + textwrap.dedent("""
        world = comm.world()
        peer = np.int64(1 - world.rank)
        got = world.sendrecv(np.full(3, world.rank, float), peer, np.empty(3), peer)
        seen = world.gather_object((float(got[0]), float(world.broadcast(np.ones(2), root=np.int32(0))[0])))
        if world.rank == 0:
            print("got", seen)
        """), 2, timeout=60)
    assert status == 0, output
    assert "got [(1.0, 1.0), (0.0, 1.0)]" in output, output


def test_a_large_transfer_that_progresses_does_not_trip_the_watchdog():
    """64 MiB moved in 1 MiB chunks under a short watchdog, in the chunked path's own order
    (the clock restarting with each chunk is shown deterministically by the next test)."""
    status, output, _ = run_job(PRELUDE + textwrap.dedent("""
        world = comm.world()
        x = np.ones(8 << 20)
        y = world.all_reduce(x, algorithm="ring")
        ok = world.gather_object(float(y[0]) == world.size and float(y[-1]) == world.size)
        if world.rank == 0:
            print("sums right on ranks", ok)
        """), 2, timeout=120, env={"MINIPAR_TIMEOUT": "5", "MINIPAR_CHUNK_BYTES": str(1 << 20)})
    assert status == 0 and "sums right on ranks [True, True]" in output, output


def test_chunks_report_progress_while_a_slow_transfer_goes_on(monkeypatch):
    """The watchdog's clock restarts with every chunk: 5 chunks of 0.2 s never look 0.3 s
    stuck, although the whole transfer takes a second."""
    import time

    from minipar.comm import watch, wire

    class SlowMPI:
        def Send(self, piece, dest, tag):
            time.sleep(0.2)
            oldest.append(time.monotonic() - watch.state["call"][4])

    class Owner:  # what a Wire reads of its Communicator
        rank, size, world_ranks, counters, _log = 0, 2, (0, 1), wire.Counters(), {"trace": None}

    oldest = []
    monkeypatch.setattr(wire, "CHUNK_BYTES", 100)
    wire.Wire(SlowMPI(), Owner(), strict=False).Send(np.zeros(500, "u1"), 1)
    assert len(oldest) == 5 and max(oldest) < 0.3, oldest


def test_a_hang_in_a_pipeline_names_the_action_and_micro_batch():
    """Rank 1 never runs its half of the pipeline: rank 0's watchdog names the action."""
    status, output, seconds = run_job(PRELUDE + textwrap.dedent("""
        import minipar
        from minipar import nn
        from minipar.parallel.pipeline import Pipeline, build
        world = comm.world()
        minipar.manual_seed(0)
        pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), build("1f1b", 2, 2),
                        world, lambda out, t: ((out - t) ** 2).mean())
        if world.rank == 1:
            time.sleep(3600)
        pipe.step(np.ones((4, 4), "float32"), np.ones((4, 4), "float32"))
        """), 2, timeout=60, env=WATCHDOG)
    print(f"\npipeline hang: exit status {status}, ended in {seconds:.1f} s")
    assert status == 1, output
    assert "pipeline action RECV_B(stage 0, mb 0)<-1" in output, output
    assert seconds < BOUND, output
