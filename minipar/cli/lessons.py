"""``minipar lessons``: the lesson scripts, their rank counts and first docstring line, with the
``minipar lesson NN`` command and the plain mpiexec line each one runs."""
import ast
import json
import pathlib
import re
import subprocess
import sys

# asked of a lesson that computes its counts from its arguments: its mpi_world() prints them
# after the mark and exits (lessons/_kit.py), before any rank is launched
RANK_COUNTS_ENV, RANK_COUNTS_MARK = "MINIPAR_LESSON_RANK_COUNTS", "minipar-rank-counts: "
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


def rank_counts(path):
    """(ranks, at_least) from the lesson's ``mpi_world(__doc__, ranks=..., at_least=...)`` call,
    read without running it when they are literals: the counts it can run on, so ``minipar
    lesson`` refuses a wrong ``-n`` before launching anything. None when the lesson computes them
    (from its arguments: ``(2, 4) if args.quick else (2, 4, 8)``, lesson 11's T·P·D), for
    asked_counts(). A lesson without the call uses no MPI: it runs as one process."""
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "mpi_world":
            given = {k.arg: k.value for k in node.keywords}
            try:
                ranks = ast.literal_eval(given["ranks"]) if "ranks" in given else ()
                at_least = ast.literal_eval(given.get("at_least", ast.Constant(1)))
            except ValueError:
                return None
            return tuple(sorted(ranks)) or None, at_least
    return (1,), 1


def asked_counts(path, lesson_args, env):
    """(ranks, at_least) from the lesson itself, for counts it computes (from its arguments:
    lesson 11's T·P·D for its --tp, --pp, --batch): one plain process runs it up to its
    ``mpi_world`` call, which prints them and exits; None when it stops before (``--help``).
    A command line the lesson refuses exits here, with the lesson's message and status."""
    done = subprocess.run([sys.executable, str(path), *lesson_args], capture_output=True,
                          text=True, env={**env, RANK_COUNTS_ENV: "1"}, timeout=300)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(done.returncode)
    for line in done.stdout.splitlines():
        if line.startswith(RANK_COUNTS_MARK):
            said = json.loads(line[len(RANK_COUNTS_MARK):])
            return tuple(said["ranks"]) or None, said["at_least"]
    return None


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
