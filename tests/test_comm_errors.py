"""Bad input gets a clear error and the job ends: never a hang, never a wrong sum."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minipar.testing import mpiexec, run_on_ranks


def caught_errors_body():
    """Errors every rank raises with the same message; returns (case, message) per case."""
    from minipar import comm

    world = comm.world()
    r, p = world.rank, world.size
    seen = []

    def expect(case, fn):
        try:
            fn()
            seen.append((case, "no error"))
        except comm.CommError as error:
            seen.append((case, str(error)))

    x = np.ones(10 + (r == 1), np.float64)  # rank 1 has one more element
    expect("length", lambda: world.all_reduce(x, algorithm="ring", check=True))
    y = np.ones(10, np.float32 if r == 2 else np.float64)
    expect("dtype", lambda: world.all_reduce(y, algorithm="recursive_halving", check=True))
    z = np.ones(10)
    expect("op", lambda: world.all_reduce(z, op="mean"))
    expect("algorithm", lambda: world.all_reduce(z, algorithm="tree"))
    expect("peer", lambda: world.send(z, p))
    expect("root", lambda: world.broadcast(z, root=-1))
    expect("out", lambda: world.all_reduce(z, out=np.ones((10, 2))[:, 0]))
    world.barrier()
    return seen


@pytest.mark.mpi
def test_bad_input_raises_the_same_error_on_every_rank():
    per_rank = [dict(map(tuple, seen)) for seen in run_on_ranks(caught_errors_body, 3)]
    for case in ("length", "dtype", "op", "algorithm", "out"):  # the same words on every rank
        assert len({seen[case] for seen in per_rank}) == 1, [seen[case] for seen in per_rank]
    seen = per_rank[0]
    assert "arrays differ across ranks" in seen["length"] and "float64[11]" in seen["length"]
    assert "float32" in seen["dtype"] and "float64" in seen["dtype"]
    assert "sum, avg, max, min, prod" in seen["op"]
    assert "ring" in seen["algorithm"] and "recursive_halving" in seen["algorithm"]
    assert "out of range" in seen["peer"] and "0..2" in seen["peer"]
    assert "out of range" in seen["root"]
    assert "C-contiguous" in seen["out"]


def mismatch_body(kind, algorithm):
    """No explicit check: the receive-side size/dtype checks must stop the job."""
    from minipar import comm

    world = comm.world()
    if kind == "length":
        x = np.ones(1000 + world.rank, np.float64)
    else:
        x = np.ones(1000, np.int64 if world.rank == 1 else np.float64)
    world.all_reduce(x, algorithm=algorithm)


@pytest.mark.mpi
@pytest.mark.parametrize("kind,algorithm", [("length", "ring"), ("dtype", "recursive_doubling"),
                                            ("length", "parameter_server")])
def test_mismatch_ends_the_job_with_a_clear_error(kind, algorithm):
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(mismatch_body, 3, args=(kind, algorithm), timeout=60)
    text = str(failure.value)
    assert "CommError" in text and "differ across ranks" in text, text


def truncated_body():
    """Rank 1 sends 8 bytes with tag 5 where rank 0 receives 4: rank 0's error, as text."""
    from minipar import comm

    world = comm.world()
    if world.rank == 1:
        world.send(np.ones(2, np.float32), 0, tag=5)
        return None
    try:
        world.recv(np.ones(1, np.float32), 1, tag=5)
    except comm.CommError as error:
        return str(error)


@pytest.mark.mpi
def test_a_message_larger_than_its_receive_names_another_send_of_that_tag():
    """A point-to-point receive takes the sender's first message with its tag, which may be
    one sent for a later receive: the error says so beside the lengths."""
    assert run_on_ranks(truncated_body, 2)[0] == (
        "rank 0: message from rank 1 is larger than the 4-byte receive buffer: lengths or "
        "dtypes differ across ranks, or this receive took another of rank 1's tag-5 messages")


def raising_body():
    """Rank 1 raises in the middle of a ring all-reduce; its peers are left waiting."""
    from minipar import comm
    from minipar.comm import patterns

    world = comm.world()
    if world.rank == 1:
        patterns.reducer = lambda op, like: (_ for _ in ()).throw(RuntimeError("boom"))
    world.all_reduce(np.ones(100), algorithm="ring")


@pytest.mark.mpi
def test_a_rank_raising_inside_a_collective_ends_the_job():
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(raising_body, 3, timeout=60, grace=0.5)
    text = str(failure.value)
    assert "--- rank 1 ---" in text and "RuntimeError: boom" in text and "timed out" not in text


@pytest.mark.mpi
def test_uncaught_error_in_a_plain_script_aborts_every_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from minipar import comm
        world = comm.world()
        if world.rank == 0:
            raise ValueError("rank 0 gives up")
        world.recv(np.empty(3), 0)  # would wait for ever without the abort hook
    """))
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(script)], timeout=60,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode != 0
    assert "rank 0 gives up" in done.stderr and "[minipar rank 0]" in done.stderr


def test_a_bfloat16_tag_names_its_dtype():
    from minipar.backend import bfloat16
    from minipar.comm.errors import dtype_tag, tag_dtype

    assert tag_dtype(dtype_tag(bfloat16)) == "bfloat16"
    assert tag_dtype(dtype_tag(np.dtype("float16"))) == "float16"
