"""Lesson 01 runs end to end (its --quick smoke mode) and documents how to run it."""
import ast
import pathlib

from test_lessons_pass import passed

LESSON = pathlib.Path(__file__).resolve().parent.parent / "lessons" / "01_autograd.py"


def test_docstring_has_title_and_run_line():
    doc = ast.get_docstring(ast.parse(LESSON.read_text()))
    assert doc.splitlines()[0].startswith("Lesson 01")
    assert "python lessons/01_autograd.py" in doc


def test_quick_run():
    out = passed(LESSON.name, 1)  # the shared run: exit 0 and a PASS line
    assert "de/da" in out and "validation loss" in out and "sample:" in out
