"""run_on_ranks from a notebook: a function defined in a cell (or in ``__main__``) reaches the
ranks through cloudpickle, and what each rank printed comes back prefixed ``[rank r]``."""
import os
import subprocess
import sys
import textwrap

import pytest

from minipar.testing import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a notebook cell runs: the function's code lives in no file (co_filename "<string>"), and
# its module is __main__, as in IPython.
CELL = textwrap.dedent("""
    from minipar.testing import run_on_ranks
    scale = 10
    def body(x):
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        print("hello from", rank, "x =", x * scale)
        return rank * x
    values = run_on_ranks(body, 2, args=(3,), show_output=True)
    print("values", values, values.outputs == ["hello from 0 x = 30\\n", "hello from 1 x = 30\\n"])
""")


def cell(source, *, hide_cloudpickle=False):
    prelude = "import sys; sys.modules['cloudpickle'] = None\n" if hide_cloudpickle else ""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", prelude + source], capture_output=True,
                          text=True, timeout=120, env=env, cwd="/")
    return done.returncode, done.stdout + done.stderr


def printing_body(n):
    from mpi4py import MPI
    print("rank", MPI.COMM_WORLD.rank, "of", n)
    return MPI.COMM_WORLD.rank


@pytest.mark.mpi
def test_a_function_defined_in_a_cell_runs_and_its_output_comes_back_prefixed():
    pytest.importorskip("cloudpickle")
    status, out = cell(CELL)
    assert status == 0, out
    assert "[rank 0] hello from 0 x = 30\n[rank 1] hello from 1 x = 30\n" in out
    assert "values [0, 3] True" in out


def test_without_cloudpickle_a_cell_function_gets_a_clear_error():
    status, out = cell(CELL, hide_cloudpickle=True)
    assert status != 0
    assert "pip install 'minipar[notebook]'" in out and "define the function in a .py file" in out


@pytest.mark.mpi
def test_a_file_function_returns_values_and_what_each_rank_printed(capsys):
    values = run_on_ranks(printing_body, 2, args=(2,), show_output=True)
    assert values == [0, 1]
    assert values.outputs == ["rank 0 of 2\n", "rank 1 of 2\n"]
    assert values.printed() == "[rank 0] rank 0 of 2\n[rank 1] rank 1 of 2\n"
    assert capsys.readouterr().out == values.printed()
