"""Assignments: the reference source with its solutions cut out, and the grader that scores them.

A solution region in the library is a run of whole statements between two comment lines in
nbgrader's convention: three hashes, ``BEGIN SOLUTION`` and the task's id (``ring-all-reduce``)
opening it, three hashes and ``END SOLUTION`` closing it, at the statements' indentation. The
markers appear nowhere else (this module spells them in two pieces).

``make`` copies the package and the lessons into a student tree where each chosen task's
regions become ``raise NotImplementedError("Task <id>: <title> (see lesson NN)")`` at their
indentation (signatures, docstrings and the comments before them stay); the other tasks keep
their solution, the markers removed; tree.py adds the README, setup.cfg and task record.
``grade`` runs each task's checks (the grader's own copy of ``minipar/assignments/checks.py``)
in a pytest subprocess whose working folder and ``PYTHONPATH`` are the student tree, all or
nothing per task: a task scores its points when every one of its checks passes, else 0.
"""
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from minipar.assignments import tree

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the tree this minipar was loaded from
CHECKS = pathlib.Path(__file__).resolve().parent / "checks.py"  # the reference checks
BEGIN, END = "### BEGIN " + "SOLUTION", "### END " + "SOLUTION"  # split: no false region here
TASK_TIMEOUT = 90  # seconds for one task's pytest run (each multi-rank job is bounded at 40 s)
BUDGET = 290  # seconds for a whole grading run: a task started later gets what is left
STUCK_TIMEOUT = "15"  # MINIPAR_TIMEOUT for graded ranks: a stuck call prints who waits on whom


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    points: int
    title: str
    lesson: str
    tests: tuple  # test names in checks.py (a name covers every parameter)
    files: tuple  # the library files holding its regions

    def stub(self):
        message = f"Task {self.id}: {self.title} (see lesson {self.lesson})"
        return f"raise NotImplementedError({json.dumps(message, ensure_ascii=False)})"


def _t(id, points, title, lesson, tests, *files):
    return Task(id, points, title, lesson, tuple(tests), files)


TASKS = (
    _t("op-backward", 10, "matmul's backward, dA = g Bᵀ and dB = Aᵀ g", "01",
       ["test_op_backward_matmul_matches_finite_differences"], "minipar/ops.py"),
    _t("layer-norm", 10, "layer norm's backward", "01",
       ["test_layer_norm_backward_matches_finite_differences"], "minipar/functional.py"),
    _t("checkpoint-sequential", 10, "checkpoint_sequential: segments, recompute all but the last",
       "02", ["test_checkpoint_sequential_same_gradients_as_plain_run"], "minipar/checkpoint.py"),
    _t("ring-all-reduce", 15, "the ring reduce-scatter of the ring all-reduce", "04",
       ["test_ring_all_reduce_equals_the_sum"], "minipar/comm/patterns.py"),
    _t("recursive-halving", 15, "the recursive-halving reduce-scatter (Rabenseifner)", "04",
       ["test_recursive_halving_all_reduce_equals_the_sum"], "minipar/comm/patterns.py"),
    _t("ddp-buckets", 10, "DDP's gradient buckets, in reverse order, capped in bytes", "05",
       ["test_ddp_buckets_follow_pytorchs_rule"], "minipar/parallel/data/buckets.py"),
    _t("megatron-f-g", 10, "Megatron's conjugate f and g operators", "10",
       ["test_megatron_f_g_are_conjugate"], "minipar/parallel/tensor/mappings.py"),
    _t("one-f-one-b", 10, "one rank's 1F1B order: warm-up, steady state, drain", "09",
       ["test_one_f_one_b_order_and_in_flight"], "minipar/parallel/pipeline/schedules.py"),
    _t("rank-grid", 10, "rank <-> (tp, dp, pp) coordinates of the 3-D grid", "11",
       ["test_rank_grid_coords_and_rank_are_inverse"], "minipar/parallel/groups.py"),
)
BY_ID = {t.id: t for t in TASKS}


def choose(ids=None):
    """The tasks named by a list of ids (None: all), in table order; an unknown id is an error."""
    if not ids:
        return list(TASKS)
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        raise ValueError(f"unknown task {', '.join(unknown)}; the tasks are {', '.join(BY_ID)}")
    return [t for t in TASKS if t.id in ids]


# --- making a student tree ----------------------------------------------------------------------
def regions(text):
    """(task id, first line, last line) of every marked region, 0-based, markers included."""
    found, open_at = [], None
    for i, line in enumerate(text.split("\n")):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if open_at is not None:
                raise ValueError(f"line {i + 1}: {BEGIN} inside another region")
            open_at, task = i, stripped[len(BEGIN):].strip()
            if task not in BY_ID:
                raise ValueError(f"line {i + 1}: region names unknown task {task!r}")
        elif stripped == END:
            if open_at is None:
                raise ValueError(f"line {i + 1}: {END} without a {BEGIN}")
            found.append((task, open_at, i))
            open_at = None
    if open_at is not None:
        raise ValueError(f"line {open_at + 1}: {BEGIN} never closed")
    return found


def strip(text, stripped_ids):
    """The source with the regions of ``stripped_ids`` replaced by their stub, others unmarked."""
    lines = text.split("\n")
    for task, first, last in reversed(regions(text)):
        if task in stripped_ids:
            indent = re.match(r"\s*", lines[first]).group(0)
            lines[first:last + 1] = [indent + BY_ID[task].stub()]
        else:
            lines[first:last + 1] = lines[first + 1:last]
    return "\n".join(lines)


def make(out, ids=None, source=ROOT, force=False):
    """Write a student tree to ``out`` with the tasks ``ids`` (default all) stripped, and its
    README, install metadata and task record (assignment.json); a FileExistsError, with nothing
    written, when ``out`` holds anything already, unless ``force``."""
    tasks, out, source = choose(ids), pathlib.Path(out), pathlib.Path(source)
    tree.refuse_to_overwrite(out, force)
    stripped = {t.id for t in tasks}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source / "minipar", out / "minipar", ignore=ignore, dirs_exist_ok=True)
    lessons = _lessons_dir(source)
    if lessons:
        shutil.copytree(lessons, out / "lessons", ignore=ignore, dirs_exist_ok=True)
    for path in sorted((out / "minipar").rglob("*.py")):
        text = path.read_text()
        if BEGIN in text:
            path.write_text(strip(text, stripped))
    tree.write(out, tasks, out / "lessons", source)
    return tasks


def _lessons_dir(source):
    """The lessons beside the package in a source tree, else where the lesson command finds them
    (an installed wheel ships them as data files)."""
    if (source / "lessons").is_dir():
        return source / "lessons"
    from minipar.cli import lessons
    found = pathlib.Path(getattr(lessons, "LESSON_DIR", source / "lessons"))
    return found if found.is_dir() else None


# --- grading ------------------------------------------------------------------------------------
def _first_failure(output):
    """The first failing test's report from pytest's output: its section, shortened."""
    sections = re.split(r"\n_{3,} (.+?) _{3,}\n", output)
    if len(sections) >= 3:
        body = sections[2].split("\n=====")[0].strip().split("\n")
        head = body[:60] + (["..."] if len(body) > 60 else [])
        return f"first failing check: {sections[1]}\n" + "\n".join(head)
    return "\n".join(output.strip().split("\n")[-30:])


def _run(command, cwd, env, timeout):
    """(returncode or None on timeout, output); a timeout kills the whole process group (the
    pytest run and any mpiexec it started)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def grade_task(task, tree, timeout=TASK_TIMEOUT, checks=CHECKS):
    """{"task", "score", "max_score", "passed", "output", "seconds"} for one task in ``tree``.

    ``checks`` is run from a folder of its own (pytest puts a test file's folder first on
    sys.path, and the checks must import the tree's minipar, not the grader's)."""
    tree = pathlib.Path(tree).resolve()
    env = {"MINIPAR_TIMEOUT": STUCK_TIMEOUT, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    start = time.time()
    if timeout <= 0:
        return {"task": task.id, "score": 0, "max_score": task.points, "passed": False,
                "output": "not run: the grading's time budget was spent", "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="minipar-grade-") as folder:
        test_file = shutil.copy(checks, pathlib.Path(folder) / "test_assignment_checks.py")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
                   "-x", f"--rootdir={folder}", *(f"{test_file}::{name}" for name in task.tests)]
        code, output = _run(command, tree, env, timeout)
    passed = code == 0
    if passed:
        output = "all checks passed"
    elif code is None:
        output = (f"timed out: its tests ran past {timeout:.0f} s and were stopped\n"
                  + _first_failure(output)).strip()
    else:
        output = _first_failure(output)
    return {"task": task.id, "score": task.points if passed else 0, "max_score": task.points,
            "passed": passed, "output": output, "seconds": round(time.time() - start, 1)}


def grade(tree=".", ids=None, timeout=TASK_TIMEOUT, progress=None, budget=BUDGET):
    """Grade every task (or ``ids``) in ``tree``, each within ``timeout`` seconds and all within
    ``budget``; a list of grade_task results."""
    results, end = [], time.time() + budget
    for task in choose(ids):
        results.append(grade_task(task, tree, min(timeout, end - time.time())))
        if progress:
            progress(results[-1])
    return results


def gradescope(results):
    """Gradescope's autograder results.json: total ``score`` and one ``tests`` entry per task."""
    return {"score": sum(r["score"] for r in results),
            "execution_time": round(sum(r["seconds"] for r in results)),
            "tests": [{"name": f"{r['task']}: {BY_ID[r['task']].title}", "score": r["score"],
                       "max_score": r["max_score"], "status": "passed" if r["passed"] else "failed",
                       "output": r["output"]} for r in results]}


def markdown(results):
    """The student's report: a table of scores, then each failing task's first failing check."""
    total, most = sum(r["score"] for r in results), sum(r["max_score"] for r in results)
    lines = [f"# Assignment grade: {total} / {most}", "", "| task | score | lesson |",
             "|---|---|---|"]
    lines += [f"| {r['task']} | {r['score']} / {r['max_score']} | {BY_ID[r['task']].lesson} |"
              for r in results]
    for r in results:
        if not r["passed"]:
            lines += ["", f"## {r['task']}: {BY_ID[r['task']].title}", "", "```",
                      r["output"], "```"]
    return "\n".join(lines) + "\n"


def write_reports(results, json_path=None, markdown_path=None):
    for path, text in ((json_path, lambda: json.dumps(gradescope(results), indent=2)),
                       (markdown_path, lambda: markdown(results))):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(path).write_text(text())
