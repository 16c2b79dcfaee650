"""``minipar lessons``: the lesson scripts, their rank counts and first docstring line, with the
``minipar lesson NN`` command and the plain mpiexec line each one runs."""
import ast
import pathlib
import re
import sys

SOURCE_LESSONS = pathlib.Path(__file__).resolve().parents[2] / "lessons"
INSTALLED_LESSONS = pathlib.Path(sys.prefix) / "share" / "minipar" / "lessons"


def lesson_dir():
    """The lessons folder: the source tree's (a checkout or an editable install), else the one a
    wheel installs as data files under ``sys.prefix/share/minipar/lessons``."""
    for folder in (SOURCE_LESSONS, INSTALLED_LESSONS):
        if any(folder.glob("[0-9][0-9]_*.py")):
            return folder
    return SOURCE_LESSONS


LESSON_DIR = lesson_dir()


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
        print(f"no lessons found under {SOURCE_LESSONS} or {INSTALLED_LESSONS}: reinstall "
              f"minipar (pip install .) or run from a checkout of its source tree")
        return 1
    for path, summary, line in items:
        print(f"{path.name:28s} {summary}\n{'':28s} $ minipar lesson {path.name[:2]}\n"
              f"{'':28s} $ {line}")
    return 0
