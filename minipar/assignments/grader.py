"""The grader: each task's checks run in a sandbox and are scored from a report read outside it.

``grade_task`` copies the tree's ``minipar/`` (nothing else of the tree reaches ``sys.path``)
into a scratch folder beside the grader's own copies of the checks and of the harness they use,
runs pytest there (as a user of its own when the grader is root), and scores the task from the
JUnit report pytest writes: every one of its checks passed and the run exited 0, else 0 points.
``refusal`` turns away, before anything runs, a folder that is not a tree (no minipar/ package
of files); ``set_aside`` names what a tree carries at its top that could fool pytest, which the
copy leaves behind. A failed task's output opens with its first failing check's message (its
first line names the step), the check in words, then the traceback with library frames cut,
the sandbox's paths named as the student's files.

    results = grade_tasks("student/", [BY_ID["ring-all-reduce"]])
    write_reports(results, "results.json", "report.md")
"""
import ast
import json
import os
import pathlib
import re
import secrets
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from minipar.assignments import sandbox
from minipar.assignments.sandbox import KEPT

HERE = pathlib.Path(__file__).resolve().parent
CHECKS = HERE / "checks.py"  # the reference checks
TASK_TIMEOUT = 90  # seconds for one task's pytest run (each multi-rank job is bounded at 40 s)
BUDGET = 290  # seconds for a whole grading run: a task started later gets what is left
RESULTS_LIMIT = 1_000_000  # bytes of results.json, whatever the tasks printed
MESSAGE_LINES = 120  # lines of a failing check's message a report keeps
SHADOWED = ("pytest", "_pytest", "numpy", "mpi4py")  # what a tree's top level may not name
# Read once, when the grader is imported: a task that rewrites the installed files (possible
# when the grader is not root) cannot change what a later task runs.
SOURCES = {"sitecustomize.py": (HERE / "sandbox.py").read_text(),
           "_minipar_grader/testing.py": (HERE.parent / "testing.py").read_text(),
           "_minipar_grader/gradcheck.py": (HERE.parent / "gradcheck.py").read_text(),
           "_minipar_grader/feedback.py": (HERE / "feedback.py").read_text(),
           "test_assignment_checks.py": CHECKS.read_text()}
LIBRARY = (sysconfig.get_paths()["stdlib"], "site-packages", "/_pytest/", "/_minipar_grader/",
           "<frozen ")  # the frames a traceback shows the student cut


# --- what is refused before anything runs -------------------------------------------------------
def refusal(tree):
    """Why ``tree`` is not graded (the sentence the student reads), or None."""
    tree = pathlib.Path(tree)
    package = tree / "minipar"
    if package.is_symlink() or not package.is_dir():
        return "the tree holds no minipar/ folder (a link to one does not count)"
    if not (package / "__init__.py").is_file():  # a namespace package: another minipar wins
        return ("minipar/ has no __init__.py, so Python would import an installed minipar in "
                "its place: put the file back")
    links = [p.relative_to(tree).as_posix() for p in package.rglob("*") if p.is_symlink()]
    if links:
        return f"minipar/ holds links ({', '.join(links[:3])}): hand in files, not links"
    return None


def set_aside(tree):
    """[(name, why)] of the files at the top of ``tree`` that would hijack the grader were
    they on sys.path: only minipar/ is copied into the sandbox, so they never run; the report
    names them, so that the teacher reads what the tree tried."""
    found = []
    for entry in sorted(pathlib.Path(tree).iterdir()):
        name, stem = entry.name, entry.name.split(".")[0]
        if stem in ("sitecustomize", "usercustomize") or name.endswith(".pth"):
            found.append((name, "would run when Python starts"))
        elif stem in SHADOWED and (entry.is_dir() or name.endswith((".py", ".pyc", ".so"))):
            found.append((name, f"would be imported in place of {stem}"))
        elif name.endswith((".dist-info", ".egg-info")) and re.search(
                r"^\s*\[pytest11\]", _text(entry / "entry_points.txt"), re.MULTILINE):
            found.append((name, "declares a pytest plugin (a pytest11 entry point)"))
    return found


def set_aside_note(tree):
    """The words the reports open with for set_aside(tree), '' when it is empty."""
    found = set_aside(tree)
    return "" if not found else (
        "set aside, not run (only minipar/ is graded): "
        + "; ".join(f"{name} {why}" for name, why in found))


def _text(path):
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# --- the verdict and what the student reads ----------------------------------------------------
def _cases(report):
    """[(test name, failure message or None, failure text)] from pytest's JUnit report; None
    when there is none (a crash, an early exit, a kill) or it cannot be read."""
    try:
        if os.path.getsize(report) > 16 * 2**20:
            return None
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    cases = []
    for case in root.iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        cases.append((case.get("name", "?"), (bad[0].get("message") or bad[0].tag) if bad else None,
                      (bad[0].text or "") if bad else ""))
    return cases


def _missing(task, cases):
    """The task's checks the report does not show (each name covers its parameters)."""
    names = [name for name, _, _ in cases or ()]
    return [t for t in task.tests if not any(n == t or n.startswith(t + "[") for n in names)]


def _feedback(task, status, cases, output, timeout, checks):
    """What a failed task's student reads: one short block first, then the trimmed traceback."""
    lines = [f"timed out: its tests ran past {timeout:.0f} s and were stopped"] \
        if status is None else []
    failed = [case for case in cases or () if case[1] is not None]
    if failed:
        name, message, text = failed[0]
        # the check's message first: its first line names the step that went wrong
        message = _message(text, message)
        lines += [message[0], f"first failing check: {name} in minipar/assignments/checks.py",
                  f"  task {task.id} (lesson {task.lesson}); it checks: {_in_words(name, checks)}",
                  *message[1:MESSAGE_LINES],
                  *([f"[... {len(message) - MESSAGE_LINES} more lines cut: a report keeps the "
                     f"first {MESSAGE_LINES} lines of a check's message]"]
                    if len(message) > MESSAGE_LINES else []),
                  "", "--- traceback, library frames cut ---", _trimmed(text)]
    else:
        missing = _missing(task, cases)
        why = ("the checks left no report" if cases is None else
               f"the report does not show {', '.join(missing)}" if missing else
               "its checks passed, but not the run")
        if status is not None:
            lines.append(f"{why} (it ended with status {status}): a crash, an early exit "
                         f"(os._exit, sys.exit) or a run the grader turned down counts as failed")
        lines += [line for line in output.split("\n") if line.startswith("minipar grader:")]
        lines += ["", "--- output, last lines ---", *_trimmed(output).strip().split("\n")[-40:]]
    text = "\n".join(lines).strip()
    return text if len(text) <= KEPT else (text[:KEPT // 4] + f"\n[... cut: a task's report "
                                           f"keeps {KEPT // 1024} KiB ...]\n" + text[-3 * KEPT // 4:])


def _message(text, attribute):
    """A failure's whole message, as lines: the last run of pytest's ``E`` lines in the
    report's element text (its ``message`` attribute is cut at 500 characters), else that."""
    block = []
    for line in text.rstrip().split("\n")[::-1]:
        if not (line == "E" or line.startswith("E ")):
            if block:
                break
            continue
        block.append(line[4:] if line.startswith("E   ") else line[1:].strip())
    return block[::-1] if block else (attribute.strip().split("\n") or [""])


def _in_words(name, checks):
    """A check in words: its docstring's first line, else its name; and its parameters."""
    base, _, case = name.partition("[")
    for node in ast.parse(checks).body:
        if isinstance(node, ast.FunctionDef) and node.name == base:
            doc = ast.get_docstring(node)
            words = doc.split("\n")[0] if doc else base.removeprefix("test_").replace("_", " ")
            # stacked parametrize decorators: pytest's id lists the innermost first
            names = [a.strip() for d in reversed(node.decorator_list)
                     if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize"
                     and d.args and isinstance(d.args[0], ast.Constant)
                     for a in d.args[0].value.split(",")]
            values = case[:-1].split("-") if case else []
            if values:
                pairs = zip(names, values) if len(names) == len(values) else [("case", case[:-1])]
                words += ", " + ", ".join(f"{k}={v}" for k, v in pairs)
            return words
    return base


_FRAME = re.compile(r'^(\s*)File "([^"]+)", line \d+|^(\s*)(\S.*?):\d+: in \S')


def _trimmed(text):
    """``text`` with the frames of the harness, pytest, numpy and the standard library cut."""
    kept, cut, skip_below = [], 0, None
    for line in text.split("\n"):
        frame = _FRAME.match(line)
        indent = len(line) - len(line.lstrip())
        if skip_below is not None and not frame and indent > skip_below and line.strip():
            continue  # the source lines of a frame just cut
        skip_below = None
        if frame and any(part in (frame[2] or frame[4]) for part in LIBRARY):
            cut, skip_below = cut + 1, len(frame[1] or frame[3] or "")
            continue
        if cut:
            kept.append(f"{' ' * indent}... {cut} library frame{'s' * (cut > 1)} cut")
            cut = 0
        kept.append(line)
    return "\n".join(kept)


def _named(text, scratch):
    """The sandbox's paths as the student's: the checks' copy, the harness, the tree's files."""
    for folder in (str(scratch / "harness"), "../harness"):  # absolute, or as pytest shows it
        text = text.replace(f"{folder}/test_assignment_checks.py", "minipar/assignments/checks.py")
        text = text.replace(f"{folder}/_minipar_grader/", "minipar/")
    return text.replace(str(scratch / "tree") + os.sep, "")


# --- grading ------------------------------------------------------------------------------------
def _result(task, passed, output, seconds=0.0):
    return {"task": task.id, "title": task.title, "lesson": task.lesson,
            "score": task.points if passed else 0, "max_score": task.points, "passed": passed,
            "output": output, "seconds": round(seconds, 1)}


def unscored(tasks, reason):
    """Results scoring every task 0, ``reason`` as each one's output."""
    return [_result(task, False, reason) for task in tasks]


def grade_task(task, tree, timeout=TASK_TIMEOUT, checks=CHECKS):
    """{"task", "title", "lesson", "score", "max_score", "passed", "output", "seconds"} for one
    task in ``tree``: pytest runs its checks in a sandbox (see the module's docstring)."""
    start, tree = time.time(), pathlib.Path(tree).resolve()
    if timeout <= 0:
        return _result(task, False, "not run: the grading's time budget was spent")
    why = refusal(tree)
    if why:
        return _result(task, False, f"not graded: {why}")
    sources = dict(SOURCES)
    if pathlib.Path(checks) != CHECKS:
        sources["test_assignment_checks.py"] = pathlib.Path(checks).read_text()
    with sandbox.own_uid() as uid, tempfile.TemporaryDirectory(
            prefix="minipar-grade-", ignore_cleanup_errors=True) as scratch:
        scratch = pathlib.Path(scratch)
        sandbox.lay_out(scratch, tree, uid, sources)
        harness, report = scratch / "harness", scratch / "report" / "junit.xml"
        # the checks' folder is pytest's root and its ini the grader's; no conftest.py, no
        # cache; the JUnit report goes where the grader reads it, the verdict's only source
        command = [sys.executable, "-m", "pytest", "-q", "-x", "--tb=short", "--noconftest",
                   "-p", "no:cacheprovider", "-c", str(harness / "pytest.ini"),
                   f"--rootdir={harness}", f"--junitxml={report}",
                   *(f"{harness / 'test_assignment_checks.py'}::{name}" for name in task.tests)]
        env = sandbox.environment(scratch, secrets.token_hex(8))
        status = sandbox.run(command, scratch / "tree", env, timeout, scratch / "output.log", uid)
        cases = _cases(report)
        passed = status == 0 and bool(cases) and not _missing(task, cases) \
            and all(message is None for _, message, _ in cases)
        output = "all checks passed" if passed else _named(_feedback(
            task, status, cases, sandbox.kept(scratch / "output.log"), timeout,
            sources["test_assignment_checks.py"]), scratch)
    return _result(task, passed, output, time.time() - start)


def grade_tasks(tree, tasks, timeout=TASK_TIMEOUT, progress=None, budget=BUDGET):
    """Grade ``tasks`` in ``tree``, each within ``timeout`` seconds and all within ``budget``;
    a list of grade_task results."""
    results, end = [], time.time() + budget
    for task in tasks:
        results.append(grade_task(task, tree, min(timeout, end - time.time())))
        if progress:
            progress(results[-1])
    return results


# --- the reports --------------------------------------------------------------------------------
def _name(result):
    return f"{result['task']}: {result['title']}" if result.get("title") else result["task"]


def gradescope(results, note=""):
    """Gradescope's autograder results.json: total ``score``, ``note`` (what was set aside) as
    its ``output``, and one ``tests`` entry per task, the outputs cut until the file stays
    under RESULTS_LIMIT bytes."""
    report = {"score": sum(r["score"] for r in results), **({"output": note} if note else {}),
              "execution_time": round(sum(r["seconds"] for r in results)),
              "tests": [{"name": _name(r), "score": r["score"], "max_score": r["max_score"],
                         "status": "passed" if r["passed"] else "failed", "output": r["output"]}
                        for r in results]}
    while report["tests"] and len(json.dumps(report, indent=2)) > RESULTS_LIMIT:
        longest = max(report["tests"], key=lambda test: len(test["output"]))
        text, keep = longest["output"], len(longest["output"]) // 4
        longest["output"] = (text[:keep] + f"\n[... cut: results.json is kept under "
                             f"{RESULTS_LIMIT:,} bytes ...]\n" + text[-keep:])
    return report


def markdown(results, note=""):
    """The student's report: ``note`` (what was set aside), a table of scores, then each failing
    task's first failing check."""
    total, most = sum(r["score"] for r in results), sum(r["max_score"] for r in results)
    lines = [f"# Assignment grade: {total} / {most}", "", *([note, ""] if note else []),
             "| task | score | lesson |", "|---|---|---|"]
    lines += [f"| {r['task']} | {r['score']} / {r['max_score']} | {r.get('lesson', '')} |"
              for r in results]
    for r in results:
        if not r["passed"]:
            lines += ["", f"## {_name(r)}", "", "```", r["output"], "```"]
    return "\n".join(lines) + "\n"


def clear_reports(*paths):
    """Remove earlier reports before grading starts: a grading that dies leaves none, not a
    stale or planted one."""
    for path in paths:
        if path:
            pathlib.Path(path).unlink(missing_ok=True)


def write_reports(results, json_path=None, markdown_path=None, note=""):
    """Write results.json and the Markdown report, each whole or not at all (renamed into
    place), readable by all; ``note`` opens both."""
    for path, text in ((json_path, lambda: json.dumps(gradescope(results, note), indent=2)),
                       (markdown_path, lambda: markdown(results, note))):
        if path:
            path = pathlib.Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                             delete=False) as f:
                f.write(text())
            os.chmod(f.name, 0o644)
            os.replace(f.name, path)
