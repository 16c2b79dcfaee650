"""Lesson 01 runs end to end (its --quick smoke mode) and documents how to run it."""
import ast
import os
import pathlib
import subprocess
import sys

LESSON = pathlib.Path(__file__).resolve().parent.parent / "lessons" / "01_autograd.py"


def test_docstring_has_title_and_run_line():
    doc = ast.get_docstring(ast.parse(LESSON.read_text()))
    assert doc.splitlines()[0].startswith("Lesson 01")
    assert "python lessons/01_autograd.py" in doc


def test_quick_run():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_DEVICE="cpu")
    done = subprocess.run([sys.executable, str(LESSON), "--quick"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "de/da" in done.stdout and "validation loss" in done.stdout and "sample:" in done.stdout
