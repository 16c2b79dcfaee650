"""``minipar lessons``: the lesson scripts, their rank counts and first docstring line."""
import ast
import pathlib
import re

LESSON_DIR = pathlib.Path(__file__).resolve().parents[2] / "lessons"


def lessons():
    """(path, summary, command) for every lessons/NN_*.py, in order."""
    found = []
    for path in sorted(LESSON_DIR.glob("[0-9][0-9]_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        found.append((path, summary, command(doc, path.name)))
    return found


def command(doc, name):
    """The first ``mpiexec ...`` or ``python ...`` line of a lesson's docstring, without the
    comment after two spaces; ``python lessons/NAME`` when there is none."""
    run = re.search(r"^\s*(mpiexec .*|python .*)$", doc, re.M)
    return re.split(r"\s{2,}", run.group(1).strip())[0] if run else f"python lessons/{name}"


def add_arguments(parser):
    pass


def run(args):
    items = lessons()
    if not items:
        print(f"no lessons found under {LESSON_DIR} (they ship with the source tree, not the wheel)")
        return 1
    for path, summary, line in items:
        print(f"{path.name:28s} {summary}\n{'':28s} $ {line}")
    return 0
