"""The README is a reading path: at most 160 lines, one row per lesson naming its command, the
files to read in order and the tests that prove it; each lesson's docstring ends with the same
files and tests ("Read next: ..."), and every path named exists."""
import ast
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def resolve(names):
    """Paths from a list of names where a bare name lies in the folder of the path before it."""
    folder, paths = "", []
    for name in names:
        path = name if "/" in name else os.path.join(folder, name)
        folder = os.path.dirname(path.rstrip("/"))
        paths.append(path)
    return paths


def readme_rows():
    """Lesson number -> (run command, [paths to read], [tests])."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d\d", cells[0]):
            ticks = [re.findall(r"`([^`]+)`", c) for c in cells[2:]]
            rows[cells[0]] = (ticks[0][0], resolve(ticks[1]), ticks[2])
    return rows


def read_next(path):
    """([paths to read], [tests]) from the lesson docstring's closing "Read next:" sentence."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    closing = re.search(r"Read next:\s+(.*);\s+proved\s+by\s+(.*)\.\s*\Z", doc, re.S)
    files, tests = closing.groups()
    names = [n.strip() for n in re.split(r",|\bthen\b", " ".join(files.split())) if n.strip()]
    return resolve(names), re.findall(r"tests/\S+\.py", tests)


def test_the_readme_is_at_most_160_lines():
    assert len(README.read_text().splitlines()) <= 160


def test_one_row_per_lesson_with_its_command_files_and_tests():
    rows = readme_rows()
    assert sorted(rows) == [p.name[:2] for p in LESSONS]
    for path in LESSONS:
        run, read, tests = rows[path.name[:2]]
        assert run.startswith(f"minipar lesson {path.name[:2]}")
        assert read[0] == f"lessons/{path.name}"
        for name in read + tests:
            assert (ROOT / name).exists(), f"README row {path.name[:2]} names {name}"


def test_each_lesson_ends_with_its_readme_row():
    rows = readme_rows()
    for path in LESSONS:
        _, read, tests = rows[path.name[:2]]
        assert read_next(path) == (read[1:], tests), path.name
