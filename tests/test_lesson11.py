"""Lesson 11 (3D parallelism, the flagship demo) runs under mpiexec and checks itself."""
import os

import pytest

from minipar.testing import run_on_ranks

LESSON = os.path.join(os.path.dirname(__file__), "..", "lessons", "11_3d_parallel.py")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,extra", [(8, []), (4, ["--tp", "2", "--pp", "2"])])
def test_lesson11_quick(nprocs, extra):
    """The lesson asserts by itself that its losses equal serial training's and fall."""
    run_on_ranks(LESSON, nprocs, args=("--quick", *extra), timeout=240)
