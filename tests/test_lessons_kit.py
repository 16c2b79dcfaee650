"""lessons/_kit.py: a lesson started on a wrong number of ranks says so in one line, exit status 2."""
import os
import pathlib
import subprocess
import sys

import pytest

from minipar.testing import RANK_ENV, mpiexec

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(nprocs, lesson, *args):
    env = {**os.environ, **RANK_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run([mpiexec(), "-n", str(nprocs), sys.executable,
                           str(ROOT / "lessons" / lesson), *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT.parent)  # not the root: any cwd works


@pytest.mark.mpi
def test_wrong_rank_count_prints_one_line_and_exits_2():
    done = run(3, "03_send_recv.py")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "lesson 03 needs 2 ranks: minipar lesson 03 -n 2"]


@pytest.mark.mpi
def test_help_prints_once_under_mpiexec():
    done = run(2, "03_send_recv.py", "--help")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("usage:") == 1, done.stdout


@pytest.mark.mpi
def test_the_suggested_command_keeps_the_arguments_and_fits_them():
    done = run(2, "11_3d_parallel.py", "--quick", "--tp", "3")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "lesson 11 needs 6 ranks (or 12): minipar lesson 11 -n 6 -- --quick --tp 3"]


def test_a_failed_check_prints_expected_and_measured_and_exits_1():
    script = ("from _kit import check, finish\n"
              "check('bubble within 0.15 of 3/7', False, '0.429 ± 0.15', '0.700')\n"
              "check('gradients equal', True)\n"
              "raise SystemExit(finish('the schedule runs as drawn'))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT / "lessons")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "FAIL: bubble within 0.15 of 3/7: expected 0.429 ± 0.15, measured 0.700",
        "  ok: gradients equal", "FAIL: the schedule runs as drawn"]
