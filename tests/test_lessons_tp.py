"""Lesson 10 runs end to end on 2 ranks (--quick) and shows the numbers it promises."""
import ast
import pathlib
import re

import pytest

from test_lessons_pass import passed

LESSON = pathlib.Path(__file__).resolve().parent.parent / "lessons" / "10_tensor_parallel.py"


def test_docstring_has_title_and_run_line():
    doc = ast.get_docstring(ast.parse(LESSON.read_text()))
    assert doc.splitlines()[0].startswith("Lesson 10")
    assert "mpiexec -n 2 python lessons/10_tensor_parallel.py" in doc


@pytest.mark.mpi
def test_quick_run_on_two_ranks():
    out = passed(LESSON.name, 2)  # the shared run: exit 0 and a PASS line
    assert "-> an all-reduce would be needed before GeLU" in out
    assert "1 forward (g), 1 backward (f)" in out
    assert "rank 1: heads [2, 3]" in out
    assert "backward moves nothing" in out
    diffs = [float(d) for d in re.findall(r"\|diff\| ([0-9.e+-]+)", out)]
    assert len(diffs) == 5 and max(diffs) < 1e-10  # the loss, then 2 + 2 steps, vs serial
    blocks = [line.split() for line in out.splitlines() if line.strip().startswith("blocks.0")]
    assert ["blocks.0", "all_reduce", "2", "2"] == blocks[0][:4]  # Megatron's 2 + 2
