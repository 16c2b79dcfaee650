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
         "10_tensor_parallel.py": 2, "11_3d_parallel.py": 8, "12_expert_parallel.py": 2}


def has_lesson_command():
    from minipar.cli import SUBCOMMANDS
    return "lesson" in SUBCOMMANDS


def command(name, nprocs, args):
    if has_lesson_command():
        # -n before NAME: argparse then takes every word after -- for the lesson
        return [sys.executable, "-m", "minipar.cli", "lesson", "-n", str(nprocs), name[:2],
                "--", *args]
    return [mpiexec(), "-n", str(nprocs), sys.executable, str(LESSONS / name), *args]


@functools.lru_cache(maxsize=None)
def lesson_output(name, nprocs, args=("--quick",), timeout=240):
    """(exit status, stdout, stderr) of one run of a lesson, run once per session."""
    env = {**os.environ, **RANK_ENV, "MINIPAR_DEVICE": "cpu",
           "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",  # waiting ranks sleep: 8 ranks share 2 cores
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
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
    out = passed(name, SMALL[name])
    assert "FAIL" not in out
