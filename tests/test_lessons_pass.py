"""Every lesson runs at its small size (``--quick``) and ends on its PASS line (issue 11).

A lesson is launched through ``minipar lesson NN -n N -- --quick`` when the CLI has that command,
else by plain ``mpiexec -n N python lessons/NN_x.py --quick``. Each (lesson, ranks) runs once
per test session: the other lesson tests read the same output through ``lesson_output``.
"""
import functools
import os
import pathlib
import subprocess
import sys

import pytest

from minipar.testing import RANK_ENV, mpiexec

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
SMALL = {"01_autograd.py": 1, "02_checkpointing.py": 1, "03_send_recv.py": 2,
         "04_allreduce.py": 4, "05_data_parallel.py": 3, "06_zero.py": 2,
         "07_model_parallel.py": 2, "08_gpipe.py": 4, "09_1f1b_interleaved.py": 4,
         "10_tensor_parallel.py": 2, "11_3d_parallel.py": 8, "12_expert_parallel.py": 2,
         "13_mixed_precision.py": 2,
         "14_long_context.py": 4,
         "15_compressed_communication.py": 2,
         "16_planning.py": 4,
         "17_fp8.py": 2}


# FP8 arrays live on NumPy (CuPy has no such dtype): on another device the lesson says so
CPU_ONLY = {"17_fp8.py"}


def has_lesson_command():
    from minipar.cli import SUBCOMMANDS
    return "lesson" in SUBCOMMANDS


def command(name, nprocs, args):
    if has_lesson_command():
        # -n before NAME: argparse then takes every word after -- for the lesson
        return [sys.executable, "-m", "minipar.cli", "lesson", "-n", str(nprocs), name[:2],
                "--", *args]
    return [mpiexec(), "-n", str(nprocs), sys.executable, str(LESSONS / name), *args]


def lesson_env(pythonpath=()):
    """The lessons' environment: the device this run was given (the CI's strict step gives
    ``strict``), else the CPU; waiting ranks sleep, since 8 ranks share 2 cores."""
    return {**os.environ, **RANK_ENV, "MINIPAR_DEVICE": os.environ.get("MINIPAR_DEVICE", "cpu"),
            "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (*map(str, pythonpath), str(ROOT),
                                                        os.environ.get("PYTHONPATH"))))}


@functools.lru_cache(maxsize=None)
def lesson_output(name, nprocs, args=("--quick",), timeout=240):
    """(exit status, stdout, stderr) of one run of a lesson, run once per session."""
    env = lesson_env()
    done = subprocess.run(command(name, nprocs, args), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    return done.returncode, done.stdout, done.stderr


def passed(name, nprocs, args=("--quick",)):
    """The stdout of a lesson run that exited 0 and ended on its PASS line."""
    status, out, err = lesson_output(name, nprocs, tuple(args))
    assert status == 0, out + err
    assert out.rstrip().splitlines()[-1].startswith("PASS: "), out + err
    return out


def test_every_lesson_is_listed():
    assert sorted(SMALL) == sorted(p.name for p in LESSONS.glob("[0-9][0-9]_*.py"))


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(SMALL))
def test_lesson_passes_at_its_small_size(name):
    if name in CPU_ONLY and os.environ.get("MINIPAR_DEVICE", "cpu") != "cpu":
        status, out, err = lesson_output(name, SMALL[name])
        # one line naming the CPU, status 2 (a wrong command line), not a traceback
        assert status == 2 and "needs the CPU" in err and "MINIPAR_DEVICE=cpu" in err, out + err
        assert "Traceback" not in err, err
        return
    out = passed(name, SMALL[name])
    assert "FAIL" not in out
    header = out.splitlines()[0]  # an MPI lesson's first line: where its ranks run
    if " ranks on " in header:
        assert header.endswith(f"device {os.environ.get('MINIPAR_DEVICE', 'cpu')}"), header


@pytest.mark.mpi
def test_a_lesson_runs_on_the_device_it_is_given(monkeypatch):
    """The CI's strict step runs the lessons on the strict device, and its header says so."""
    monkeypatch.setenv("MINIPAR_DEVICE", "strict")
    status, out, err = lesson_output.__wrapped__("03_send_recv.py", 2)  # not the cached run
    assert status == 0, out + err
    assert out.splitlines()[0] == "2 ranks on 1 node(s), device strict", out
