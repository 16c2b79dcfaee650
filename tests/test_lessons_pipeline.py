"""Lessons 7-9 run end to end under mpiexec (--quick, one launch each) and print what they
promise."""
import ast
import pathlib
import re

import pytest

from test_lessons_pass import passed

LESSONS = pathlib.Path(__file__).resolve().parent.parent / "lessons"
CASES = {"07_model_parallel.py": 2, "08_gpipe.py": 4, "09_1f1b_interleaved.py": 4}


def run(name):
    return passed(name, CASES[name])  # the shared run: exit 0 and a PASS line


def rows(out):
    return [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+\d", line)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_docstring_has_title_and_run_line(name):
    doc = ast.get_docstring(ast.parse((LESSONS / name).read_text()))
    assert doc.splitlines()[0].startswith(f"Lesson {int(name[:2])}:")
    assert f"mpiexec -n {CASES[name]} python lessons/{name}" in doc


@pytest.mark.mpi
def test_lesson07_naive_then_pipelined_resnet():
    out = run("07_model_parallel.py")
    assert "UCI digits: 1797 real 8x8 images" in out
    assert re.search(r"^naive\s+64\s+1\s", out, re.M)
    assert len(re.findall(r"^gpipe\s+\d+\s+\d+\s", out, re.M)) == 3
    first, last = map(float, re.search(r"loss ([\d.]+) at step 1, ([\d.]+) at step", out).groups())
    assert last < first


@pytest.mark.mpi
def test_lesson08_bubble_and_rematerialised_memory():
    out = run("08_gpipe.py")
    assert "3/7 = 0.429" in out and "rank 3 |" in out
    table = [r for r in rows(out) if len(r) == 7]
    assert len(table) == 4
    for r in table:  # plain GPipe holds m = 4 micro-batches, re-materialised one
        assert r[1] == "4" and r[4] == "1"
        assert float(r[2]) == pytest.approx(float(r[3]), rel=0.05)
    assert "max |diff| = 0.0e+00" in out


@pytest.mark.mpi
def test_lesson09_memory_bubbles_and_staleness():
    out = run("09_1f1b_interleaved.py")
    memory = [r for r in rows(out) if len(r) == 8]
    assert [(r[1], r[3], r[5]) for r in memory] == [("4", str(4 - i), str(4 - i)) for i in range(4)]
    assert all(float(r[7]) < float(r[2]) for r in memory[1:])  # ZB-H1: B frees all but what W needs
    assert "3/11 = 0.273" in out and "3/15 = 0.200" in out
    assert re.search(r"^\s+3\s+v0/v0\s+v1/v1\s+v2/v2\s+v3/v3\s+\[3, 2, 1, 0\]", out, re.M)
