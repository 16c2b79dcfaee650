"""Point-to-point calls, sub-groups, the non-blocking all-reduce, the benchmark, and CuPy arrays."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks


def p2p_body():
    from minipar import comm

    world = comm.world()
    r, p = world.rank, world.size
    right, left = (r + 1) % p, (r - 1) % p
    got = np.empty(5, np.int64)
    # a ring of non-blocking messages, then blocking ones with a tag
    recv = world.irecv(got, left, tag=3)
    world.isend(np.full(5, r, np.int64), right, tag=3).wait()
    assert (recv.wait() == left).all()
    if r == 0:
        world.send(np.arange(5.0)[::-1], 1)  # non-contiguous send: copied
    elif r == 1:
        assert (world.recv(np.empty(5), 0) == np.arange(5.0)[::-1]).all()
    # sub-groups: split by parity, and an explicit rank list
    half = world.split(r % 2)
    assert half.size == (p + 1 - r % 2) // 2 and half.rank == r // 2
    total = half.all_reduce(np.array([r]), algorithm="ring")
    assert total[0] == sum(range(r % 2, p, 2))
    firsts = world.group([2, 0])
    if r in (0, 2):
        assert firsts.rank == (1 if r == 0 else 0)
        assert firsts.all_reduce(np.array([r + 1.0]), algorithm="recursive_halving")[0] == 4.0
    else:
        assert firsts is None
    # non-blocking all-reduce: MPI's Iallreduce and a hand-coded one on the worker thread
    x = np.arange(1000.0) * (r + 1)
    works = [world.iall_reduce(x, algorithm=a) for a in ("mpi", "ring", "recursive_halving")]
    want = np.arange(1000.0) * p * (p + 1) / 2
    for work in works:
        assert np.allclose(work.wait(), want)
    world.barrier()
    return world.counters.snapshot()["messages_sent"]


@pytest.mark.mpi
def test_p2p_groups_and_nonblocking_all_reduce():
    sent = run_on_ranks(p2p_body, 4)
    assert all(s > 0 for s in sent)


def chunked_body():
    """Every message moves in chunks (MINIPAR_CHUNK_BYTES=64: 400 bytes in 7): an isend meets a
    blocking recv, a send an irecv, each one message in the counters and one trace event."""
    from minipar import comm

    world = comm.world()
    peer = 1 - world.rank
    got = np.empty(50)
    world.counters.reset()
    world.trace = []
    if world.rank == 0:
        request = world.isend(np.arange(50.0), peer)
        world.recv(got, peer)
    else:
        request = world.irecv(got, peer)
        world.send(np.arange(50.0) + 1, peer)
    request.wait()
    events = [(event.op, event.peer, event.nbytes) for event in world.trace]
    world.trace = None
    counted = world.counters.snapshot()
    return bool((got == np.arange(50.0) + peer).all()), events, counted


@pytest.mark.mpi
def test_chunked_messages_match_across_blocking_and_non_blocking_calls():
    (ok0, events0, counted0), (ok1, events1, counted1) = run_on_ranks(
        chunked_body, 2, env={"MINIPAR_CHUNK_BYTES": "64"})
    assert ok0 and ok1
    assert events0 == [["recv", 1, 400], ["isend", 1, 400]]  # lists: results come back as JSON
    assert events1 == [["send", 0, 400], ["irecv", 0, 400]]
    for counted in (counted0, counted1):
        assert (counted["messages_sent"], counted["bytes_sent"]) == (1, 400)
        assert (counted["messages_received"], counted["bytes_received"]) == (1, 400)


def bench_body():
    from minipar import bench
    from minipar.comm import world

    return bench.run_bench(world(), [8, 4096], ["ring", "recursive_doubling"], 1 << 20,
                           as_json=True)


@pytest.mark.mpi
def test_benchmark_counts_no_wrong_results_and_its_columns_follow_from_its_times():
    rows = run_on_ranks(bench_body, 2)[0]
    assert [row["algorithm"] for row in rows] == ["mpi", "ring", "recursive_doubling"] * 2
    # every rank's result equals the exact sum (the benchmark compares the bits)
    assert all(row["wrong"] == 0 for row in rows), rows
    mpi = {row["bytes"]: row["time_us"] for row in rows if row["algorithm"] == "mpi"}
    for row in rows:
        seconds = row["time_us"] / 1e6
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / seconds / 1e9, rel=1e-12)
        # busbw = algbw * 2(p - 1)/p, nccl-tests' factor: 1 on 2 ranks
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"], rel=1e-12)
        assert row["vs_mpi"] == pytest.approx(row["time_us"] / mpi[row["bytes"]], rel=1e-12)
        if row["algorithm"] != "mpi":  # the model's column is the registry's formula
            assert row["measured_over_model"] == pytest.approx(
                row["time_us"] / row["model_us"], rel=1e-12)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", None])
def test_collectives_on_cupy_arrays(aware):
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no GPU")
    from test_comm_collectives import collectives_body

    env = {"MINIPAR_DEVICE": "gpu", **({"MINIPAR_CUDA_AWARE": aware} if aware else {})}
    failures = sum(run_on_ranks(collectives_body, 2, env=env, timeout=300), [])
    assert not failures, "\n".join(failures[:50])


def test_synchronous_sends_switch_every_send_of_chunks(monkeypatch):
    """MINIPAR_SYNC_SENDS=1 (``wire.SYNC_SENDS``): blocking sends are MPI_Ssend, started ones
    MPI_Issend, the multi-piece sendrecv's too; a small sendrecv stays one MPI_Sendrecv."""
    from minipar.comm import wire

    class Recorder:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *args: self.calls.append(name) or Done()

    class Done:
        def Wait(self, status=None):
            pass

    class Owner:  # what a Wire reads of its Communicator
        rank, size, world_ranks, counters, _log = 0, 2, (0, 1), wire.Counters(), {"trace": None}

    def calls(sync):
        monkeypatch.setattr(wire, "SYNC_SENDS", sync)
        mpi = Recorder()
        w = wire.Wire(mpi, Owner(), strict=False)
        monkeypatch.setattr(w, "check", lambda status, nbytes, source, tag: None)
        w.Send(np.zeros(300, "u1"), 1)
        w.Isend(np.zeros(300, "u1"), 1)
        w.Sendrecv(np.zeros(300, "u1"), 1, np.zeros(300, "u1"), 1)
        w.Sendrecv(np.zeros(10, "u1"), 1, np.zeros(10, "u1"), 1)
        return mpi.calls

    monkeypatch.setattr(wire, "CHUNK_BYTES", 100)
    assert calls(True) == ["Ssend"] * 3 + ["Issend"] * 3 + ["Irecv"] * 3 + ["Issend"] * 3 + [
        "Sendrecv"]
    assert calls(False) == ["Send"] * 3 + ["Isend"] * 3 + ["Irecv"] * 3 + ["Isend"] * 3 + [
        "Sendrecv"]
    with pytest.raises(ValueError, match="MINIPAR_SYNC_SENDS must be 0 or 1, got 'yes'"):
        wire._sync_sends("yes")


SEND_FIRST = """
import numpy as np
from minipar import comm
world = comm.world()
peer = 1 - world.rank
world.send(np.full(10, world.rank), peer)  # both partners send first: the bug of lesson 03
got = world.recv(np.empty(10, int), peer)
print(f"rank {world.rank} got {got[0]} from rank {peer}")
"""


@pytest.mark.mpi
@pytest.mark.fault
def test_with_synchronous_sends_a_send_first_pair_deadlocks_even_when_small():
    """10 elements go eagerly: the bug passes unseen. With MINIPAR_SYNC_SENDS=1 each send waits
    for a receive that is never posted, and the watchdog names who waits on whom."""
    from minipar.testing import run_job

    status, output, _ = run_job(SEND_FIRST, 2, timeout=60, env={"MINIPAR_SYNC_SENDS": "0"})
    assert status == 0 and "rank 0 got 1 from rank 1" in output, output
    status, output, seconds = run_job(SEND_FIRST, 2, timeout=60,
                                      env={"MINIPAR_SYNC_SENDS": "1", "MINIPAR_TIMEOUT": "2"})
    assert status not in (None, 0), output
    assert "minipar watchdog: no progress" in output and " got " not in output, output
    assert any(f"in send to rank {peer} (80 bytes" in output and
               f"rank {peer} waits in send to rank {1 - peer}" in output for peer in (0, 1)), output
    assert seconds < 10.0, f"the job took {seconds:.1f} s to end:\n{output}"
