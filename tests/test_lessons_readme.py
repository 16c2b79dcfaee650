"""Each lesson's docstring ends with its README row (test_layers.py checks the rows): the same
files to read, in order, and the same tests that prove it ("Read next: ...; proved by ...")."""
import ast
import pathlib
import re

from test_layers import readme_rows, resolve

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def read_next(path):
    """([paths to read], [tests]) from the lesson docstring's closing "Read next:" sentence."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    closing = re.search(r"Read next:\s+(.*);\s+proved\s+by\s+(.*)\.\s*\Z", doc, re.S)
    files, tests = closing.groups()
    names = [n.strip() for n in re.split(r",|\bthen\b", " ".join(files.split())) if n.strip()]
    return resolve(names), re.findall(r"tests/\S+\.py", tests)


def test_each_lesson_ends_with_its_readme_row():
    rows = readme_rows()
    for path in LESSONS:
        _, read, tests = rows[path.name[:2]]
        assert read_next(path) == (read[1:], tests), path.name
