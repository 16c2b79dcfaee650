"""The multi-rank harness: values come back, every failing rank's traceback is shown, a hang
becomes a timeout that names who waits on whom."""
import pytest

from minipar.testing import run_on_ranks


def rank_and_size(offset):
    from mpi4py import MPI

    return [MPI.COMM_WORLD.Get_rank() + offset, MPI.COMM_WORLD.Get_size()]


def two_ranks_fail():
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    assert rank not in (1, 2), f"rank {rank} says no"


def rank0_waits_for_ever():
    import numpy as np

    from minipar import comm

    world = comm.world()
    if world.rank == 0:
        world.recv(np.empty(4), source=1)


@pytest.mark.mpi
def test_values_come_back_per_rank():
    assert run_on_ranks(rank_and_size, 3, args=(10,)) == [[10, 3], [11, 3], [12, 3]]


@pytest.mark.mpi
def test_module_target_and_script_target(tmp_path):
    assert run_on_ranks("test_testing_harness:rank_and_size", 2, args=(0,),
                        env={"PYTHONPATH": __file__.rsplit("/", 1)[0]}) == [[0, 2], [1, 2]]
    script = tmp_path / "script.py"
    script.write_text("from mpi4py import MPI\nassert MPI.COMM_WORLD.Get_size() == 2\n")
    assert run_on_ranks(str(script), 2) == [None, None]


@pytest.mark.mpi
def test_every_failing_rank_is_reported():
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(two_ranks_fail, 4)
    text = str(failure.value)
    assert "--- rank 1 ---" in text and "rank 1 says no" in text
    assert "--- rank 2 ---" in text and "rank 2 says no" in text
    assert "--- rank 0 ---" not in text


@pytest.mark.mpi
def test_a_hang_times_out_and_names_the_waiting_rank():
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(rank0_waits_for_ever, 2, timeout=4)
    text = str(failure.value)
    assert "timed out after 4 s: ranks [0] did not finish" in text
    assert "rank 0 blocked in recv with peer 1" in text
