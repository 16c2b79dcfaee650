"""Smoke runs of the data-parallel lessons (``--quick``) under mpiexec, checking what they print."""
import re

import pytest

from test_lessons_pass import passed


def run_lesson(name, nprocs):
    return passed(name, nprocs)  # the shared run: exit 0 and a PASS line


@pytest.mark.parametrize("nprocs", [3])
def test_lesson_05_data_parallel(nprocs):
    out = run_lesson("05_data_parallel.py", nprocs)
    diff = float(re.search(r"data-parallel vs serial after \d+ epochs: (\S+)", out).group(1))
    assert diff < 1e-10, out
    for method in ("DDP ring", "DDP recursive_halving", "DDP mpi", "parameter server, one",
                   "parameter server, sharded"):
        assert method in out, out


def test_lesson_06_zero():
    out = run_lesson("06_zero.py", 2)
    cell = r"\s+(\d+)/(\d+)/(\d+)"
    rows = re.findall(r"^\s+2" + cell * 3, out, re.M)
    dp_state, z1_state, z2_grads = int(rows[0][2]), int(rows[0][5]), int(rows[0][7])
    assert abs(z1_state - dp_state / 2) <= 1 and abs(z2_grads - int(rows[0][1]) / 2) <= 1, out
    gap = float(re.search(r"largest loss difference from plain DP over \d+ steps: (\S+)", out)
                .group(1))
    assert gap < 1e-5, out
