"""The grader against submissions that try to fool it (issue 21's list), each made as a student
would: a tree from ``make``, one task's stub replaced by the cheat. Each cheat scores 0 on the
task it fakes while an honest task graded beside it keeps its points; a file at the tree's top
that could fool pytest is set aside and named (issue 37), a folder that is not a tree refused. The graded cases use op-backward and layer-norm (one process, about a second
each) except where the cheat needs ranks.
"""
import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time

import pytest

from minipar import assignments
from minipar.assignments import grader, sandbox
from minipar.cli import main

ROOT = assignments.ROOT
HONEST = "layer-norm"
FULL = assignments.BY_ID[HONEST].points  # what the honest task scores
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox user needs root")


def _tree(tmp_path, *stripped):
    tree = tmp_path / "student"
    assignments.make(tree, list(stripped) or ["op-backward"])
    return tree


def _cheat(tree, task, code):
    """Put ``code`` (at the stub's indentation) where ``task``'s stub is."""
    stub = assignments.BY_ID[task].stub()
    for name in assignments.BY_ID[task].files:
        path = tree / name
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.strip() == stub:
                indent = line[:len(line) - len(line.lstrip())]
                lines[i:i + 1] = [indent + part for part in code.strip("\n").split("\n")]
                path.write_text("\n".join(lines))
                return
    raise AssertionError(f"no stub of {task} in {tree}")


def _scores(results):
    return {r["task"]: r["score"] for r in results}


def _outputs(results):
    return {r["task"]: r["output"] for r in results}


@pytest.fixture
def shared():
    """A folder the sandbox user may write into (the cheats leave their pids there)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="minipar-cheat-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _alive(folder):
    """The pids written into ``folder`` whose process still runs (a zombie is not running)."""
    alive = []
    for path in folder.glob("*.pid"):
        pid = int(path.read_text())
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            alive.append(pid)
    return alive


# --- set aside, or refused before anything runs ------------------------------------------------
def _pytest_plugin(tree):
    info = tree / "cheat-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: cheat\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\ncheat = cheat_plugin\n")


FAKE = "import numpy.testing\nnumpy.testing.assert_allclose = lambda *a, **k: None\n"
SET_ASIDE = {  # what a student adds at the tree's top -> a phrase of the note
    "sitecustomize": (lambda t: (t / "sitecustomize.py").write_text(FAKE),
                      "sitecustomize.py would run when Python starts"),
    "usercustomize": (lambda t: (t / "usercustomize.py").write_text(FAKE),
                      "usercustomize.py"),
    "pth": (lambda t: (t / "cheat.pth").write_text("import os\n"), "cheat.pth"),
    "pytest module": (lambda t: (t / "pytest.py").write_text("def main(): return 0\n"),
                      "pytest.py would be imported in place of pytest"),
    "pytest package": (lambda t: (t / "pytest").mkdir() or (t / "pytest/__init__.py").touch(),
                       "in place of pytest"),
    "_pytest": (lambda t: (t / "_pytest").mkdir(), "in place of _pytest"),
    "numpy.testing": (lambda t: (t / "numpy/testing").mkdir(parents=True)
                      or (t / "numpy/testing/__init__.py").write_text(FAKE),
                      "numpy would be imported in place of numpy"),
    "mpi4py": (lambda t: (t / "mpi4py").mkdir(), "in place of mpi4py"),
    "plugin": (_pytest_plugin, "cheat-1.0.dist-info declares a pytest plugin"),
}
REFUSED = {  # a folder that is not a tree -> a phrase of the reason
    "no __init__": (lambda t: (t / "minipar/__init__.py").unlink(), "no __init__.py"),
    "empty minipar": (lambda t: shutil.rmtree(t / "minipar") or (t / "minipar").mkdir(),
                      "no __init__.py"),
    "link": (lambda t: (t / "minipar/ops.py").unlink() or (t / "minipar/ops.py").symlink_to(
        ROOT / "minipar/ops.py"), "links (minipar/ops.py)"),
    "no minipar": (lambda t: shutil.rmtree(t / "minipar"), "holds no minipar/"),
}


@pytest.mark.parametrize("cheat", list(SET_ASIDE))
def test_a_file_that_could_fool_pytest_is_set_aside_and_named(tmp_path, cheat, capsys):
    """The file never reaches the sandbox: the task it would fake scores 0, the honest task
    keeps its points, and both reports name what was set aside."""
    tree = _tree(tmp_path, "op-backward")
    assert grader.set_aside(tree) == []
    add, phrase = SET_ASIDE[cheat]
    add(tree)
    json_path, md_path = tmp_path / "results.json", tmp_path / "report.md"
    assert main(["assignment", "grade", str(tree), "--tasks", f"op-backward,{HONEST}",
                 "--json", str(json_path), "--markdown", str(md_path)]) == 0
    report = json.loads(json_path.read_text())
    scores = {t["name"].split(":")[0]: t["score"] for t in report["tests"]}
    assert scores == {"op-backward": 0, HONEST: FULL}, report
    assert report["output"].startswith("set aside, not run") and phrase in report["output"]
    assert phrase in md_path.read_text().split("| task |")[0]
    assert phrase in capsys.readouterr().out


@pytest.mark.parametrize("cheat", list(REFUSED))
def test_a_folder_that_is_not_a_tree_is_refused_with_what_is_missing(tmp_path, cheat, capsys):
    tree = _tree(tmp_path, "op-backward")
    assert grader.refusal(tree) is None
    add, phrase = REFUSED[cheat]
    add(tree)
    json_path = tmp_path / "results.json"
    assert main(["assignment", "grade", str(tree), "--tasks", f"op-backward,{HONEST}",
                 "--json", str(json_path)]) == 1
    assert phrase in capsys.readouterr().out
    report = json.loads(json_path.read_text())  # Gradescope still reads why
    assert report["score"] == 0
    for test in report["tests"]:
        assert test["output"].startswith("not graded: ") and phrase in test["output"], test
    if cheat != "no minipar":  # the library call refuses too, before anything runs
        results = assignments.grade(tree, ["op-backward", HONEST])
        assert all(r["seconds"] < 5 and phrase in r["output"] for r in results)


def test_the_reference_is_not_refused():
    assert grader.refusal(ROOT) is None


# --- scored 0 on the task it fakes, the honest task beside it keeps its points ------------------
def test_an_early_exit_leaves_no_report_and_scores_zero(tmp_path):
    tree = _tree(tmp_path, "op-backward")
    _cheat(tree, "op-backward", "import os\nos._exit(0)")
    results = assignments.grade(tree, ["op-backward", HONEST])
    assert _scores(results) == {"op-backward": 0, HONEST: FULL}, results
    assert "the checks left no report" in _outputs(results)["op-backward"]


def test_the_trees_own_harness_made_to_pass_everything_does_not_grade_it(tmp_path):
    tree = _tree(tmp_path, "op-backward", "ring-all-reduce")
    (tree / "minipar/gradcheck.py").write_text(
        "def gradcheck(*args, **kwargs):\n    return 0.0\n")
    testing = tree / "minipar/testing.py"
    testing.write_text(testing.read_text() + "\n\ndef run_on_ranks(target, nprocs, **kwargs):\n"
                                              "    return [None] * nprocs\n")
    feedback = tree / "minipar/assignments/feedback.py"  # the failure messages: none raised
    feedback.write_text(feedback.read_text() + "\n\ndef _gradcheck(*args):\n    pass\n\n\n"
                        "def _on_ranks(*args):\n    pass\n")
    results = assignments.grade(tree, ["op-backward", "ring-all-reduce", HONEST])
    assert _scores(results) == {"op-backward": 0, "ring-all-reduce": 0, HONEST: FULL}, results
    assert "Task op-backward:" in _outputs(results)["op-backward"]
    assert "Task ring-all-reduce:" in _outputs(results)["ring-all-reduce"]


def test_a_checker_replaced_by_the_code_under_test_fails_the_run(tmp_path):
    tree = _tree(tmp_path, "checkpoint-sequential")
    _cheat(tree, "checkpoint-sequential",
           "import numpy.testing\nnumpy.testing.assert_allclose = lambda *a, **k: None\n"
           "return modules[0](x) * 2.0")
    results = assignments.grade(tree, ["checkpoint-sequential", HONEST])
    assert _scores(results) == {"checkpoint-sequential": 0, HONEST: FULL}, results
    # the checks compare by their own code, so the patch buys nothing; the guard names it too
    assert "Task checkpoint-sequential:" in _outputs(results)["checkpoint-sequential"]
    # patched for the whole tree from minipar/__init__.py: every run it touches fails
    init = tree / "minipar/__init__.py"
    init.write_text(init.read_text() + "\nimport numpy.testing\n"
                                       "numpy.testing.assert_allclose = lambda *a, **k: None\n")
    # (an honest task whose checks all pass: only the guard can fail it)
    [result] = assignments.grade(tree, [HONEST])
    assert result["score"] == 0 and "replaced numpy.testing.assert_allclose" in result["output"]


def test_a_task_cannot_rewrite_the_checks_a_later_task_runs(tmp_path):
    tree = _tree(tmp_path, "op-backward", HONEST)
    # its own sandbox's copies and, where the grader is root, the installed checks (without
    # root the grader keeps the texts it read when it started: a later task runs those)
    targets = ["../harness/test_assignment_checks.py", "../harness/sitecustomize.py"]
    targets += [str(assignments.CHECKS)] if os.geteuid() == 0 else []
    _cheat(tree, "op-backward", f"""
for path in {targets!r}:
    try:
        open(path, "a").write("\\ndef test_layer_norm_backward_matches_finite_differences():\\n"
                              "    pass\\n")
        print("rewrote", path)
    except OSError as err:
        print("could not rewrite", path, err)
raise NotImplementedError("the cheat ran")""")
    before = assignments.CHECKS.read_text()
    results = assignments.grade(tree, ["op-backward", HONEST])
    assert assignments.CHECKS.read_text() == before
    assert _scores(results) == {"op-backward": 0, HONEST: 0}, results
    assert "Task layer-norm:" in _outputs(results)[HONEST]


@root_only
def test_a_task_run_as_root_cannot_kill_the_grader_or_write_its_results(tmp_path, capsys):
    tree = _tree(tmp_path, "op-backward")
    out = tmp_path / "results.json"
    fake = json.dumps({"score": 100, "tests": []})
    _cheat(tree, "op-backward", f"""
import os, signal
for attempt in (lambda: open({str(out)!r}, "w").write({fake!r}),
                lambda: os.kill(os.getppid(), signal.SIGKILL)):
    try:
        attempt()
    except OSError as err:
        print("refused:", err)
raise NotImplementedError("the cheat ran")""")
    args = ["assignment", "grade", str(tree), "--tasks", f"op-backward,{HONEST}",
            "--json", str(out)]
    assert main(args) == 0  # still here: the grader was not killed
    report = json.loads(out.read_text())
    assert report["score"] == FULL and [t["score"] for t in report["tests"]] == [0, FULL]
    assert "the cheat ran" in report["tests"][0]["output"]


def test_output_is_capped_and_results_json_stays_under_a_megabyte(tmp_path):
    tree = _tree(tmp_path, "op-backward")
    _cheat(tree, "op-backward", "import os\nos.write(1, b'x' * 5_000_000 + b'\\n')\nos._exit(3)")
    [result] = assignments.grade(tree, ["op-backward"])
    assert result["score"] == 0 and len(result["output"]) <= grader.KEPT
    huge = [{**result, "output": "é\x00" * 300_000} for _ in range(12)]
    assert len(json.dumps(grader.gradescope(huge), indent=2)) < grader.RESULTS_LIMIT


@pytest.mark.parametrize("user", ["own uid", "the grader's"])
def test_a_detached_child_neither_stretches_the_task_nor_survives_it(tmp_path, shared,
                                                                     monkeypatch, user):
    if user == "the grader's":  # as without root: its processes are found by their token
        monkeypatch.setattr(sandbox, "own_uid", lambda: contextlib.nullcontext(None))
    tree = _tree(tmp_path, "op-backward")
    _cheat(tree, "op-backward", f"""
import subprocess, sys
child = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=sys.__stdout__)
open({str(shared)!r} + f"/{{child.pid}}.pid", "w").write(str(child.pid))
raise NotImplementedError("left a child behind")""")
    start = time.time()
    [result] = assignments.grade(tree, ["op-backward"], timeout=60)
    assert result["score"] == 0 and "left a child behind" in result["output"]
    assert time.time() - start < 30
    assert list(shared.glob("*.pid")) and not _alive(shared)


@pytest.mark.mpi
def test_ranks_looping_outside_their_process_group_are_killed_at_the_tasks_bound(tmp_path,
                                                                                  shared):
    tree = _tree(tmp_path, "ring-all-reduce")
    _cheat(tree, "ring-all-reduce", f"""
import os, time
if os.fork() == 0:
    os.setsid()
open({str(shared)!r} + f"/{{os.getpid()}}.pid", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)""")
    start = time.time()
    [result] = assignments.grade(tree, ["ring-all-reduce"], timeout=12)
    assert time.time() - start < 30
    assert result["score"] == 0 and result["output"].startswith("timed out"), result["output"]
    assert len(list(shared.glob("*.pid"))) >= 2 and not _alive(shared)


# --- a ring that is not a ring (issue 37): each scores 0, the honest task keeps its points ------
# Each replaces the body of the ring reduce-scatter's step loop (ring_reduce_scatter in
# minipar/comm/patterns.py: c, buf, bounds, op, shift, src, r, p, right, left, tmp, s).
_RING_SHAPED = """send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
lo, hi = bounds[recv], bounds[recv + 1]
c.Sendrecv({payload}, right, tmp[:hi - lo], left)
"""
_OWN_CHUNK = "src[bounds[send]:bounds[send + 1]].copy()"
RING_CHEATS = {  # -> a phrase of what the grader says
    "dummy traffic, then MPI's Allreduce": (_RING_SHAPED.format(payload=_OWN_CHUNK) + """\
if s == p - 2:
    from mpi4py import MPI
    total = src.copy()
    c.mpi.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM if op == "sum" else MPI.MAX)
    buf[:] = total
""", "the task's code called MPI.Intracomm.Allreduce at minipar/comm/patterns.py:"),
    "COMM_WORLD.Allreduce": ("""\
if s == 0:
    from mpi4py import MPI
    total = src.copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM if op == "sum" else MPI.MAX)
    buf[:] = total
""", "MPI.Intracomm.Allreduce"),
    "Reduce and Bcast": ("""\
if s == 0:
    from mpi4py import MPI
    total = src.copy()
    MPI.COMM_WORLD.Reduce(MPI.IN_PLACE if r == 0 else total, total,
                          op=MPI.SUM if op == "sum" else MPI.MAX, root=0)
    MPI.COMM_WORLD.Bcast(total, root=0)
    buf[:] = total
""", "MPI.Intracomm.Reduce"),
    "zeros of the right sizes, the sum through files": (_RING_SHAPED.format(
        payload="numpy.zeros(bounds[send + 1] - bounds[send], buf.dtype)") + """\
if s == p - 2:
    c.cheat = getattr(c, "cheat", 0) + 1
    folder = os.environ.get("TMPDIR", "/tmp")
    numpy.save(f"{folder}/cheat-{c.cheat}-{r}.npy", src)
    c.mpi.Barrier()
    total = numpy.load(f"{folder}/cheat-{c.cheat}-0.npy")
    for q in range(1, p):
        part = numpy.load(f"{folder}/cheat-{c.cheat}-{q}.npy")
        total = total + part if op == "sum" else numpy.maximum(total, part)
    buf[:] = total
""", "carries the wrong partial sum"),
}


def _ring_cheat(tmp_path, cheat):
    tree = _tree(tmp_path, "ring-all-reduce")
    code, phrase = RING_CHEATS[cheat]
    _cheat(tree, "ring-all-reduce", "import os, numpy\n" + code)
    return tree, phrase


@pytest.mark.mpi
@pytest.mark.parametrize("cheat", list(RING_CHEATS))
def test_a_ring_that_is_not_a_ring_scores_zero(tmp_path, cheat):
    tree, phrase = _ring_cheat(tmp_path, cheat)
    results = assignments.grade(tree, ["ring-all-reduce", HONEST])
    assert _scores(results) == {"ring-all-reduce": 0, HONEST: FULL}, results
    assert phrase in _outputs(results)["ring-all-reduce"], _outputs(results)["ring-all-reduce"]


@pytest.mark.mpi
def test_the_cheat_scores_zero_from_its_packed_zip_too(tmp_path):
    tree, phrase = _ring_cheat(tmp_path, "dummy traffic, then MPI's Allreduce")
    assert main(["assignment", "pack", str(tree), "--out", str(tmp_path / "hw.zip")]) == 0
    json_path = tmp_path / "results.json"
    assert main(["assignment", "grade", str(tmp_path / "hw.zip"), "--tasks",
                 f"ring-all-reduce,{HONEST}", "--json", str(json_path)]) == 0
    tests = {t["name"].split(":")[0]: t for t in json.loads(json_path.read_text())["tests"]}
    assert (tests["ring-all-reduce"]["score"], tests[HONEST]["score"]) == (0, FULL)
    assert phrase in tests["ring-all-reduce"]["output"]


@pytest.mark.mpi
def test_f_and_g_through_mpis_own_allreduce_score_zero(tmp_path):
    tree = _tree(tmp_path, "megatron-f-g")
    summed = ("__import__('mpi4py.MPI').MPI.COMM_WORLD.allreduce({})")
    _cheat(tree, "megatron-f-g",  # f, then g: each stub in turn
           f"return make_result(x.data, (x,), lambda g: ({summed.format('g')},), 'f')")
    _cheat(tree, "megatron-f-g",
           f"return make_result({summed.format('x.data')}, (x,), lambda g: (g,), 'g')")
    results = assignments.grade(tree, ["megatron-f-g", HONEST])
    assert _scores(results) == {"megatron-f-g": 0, HONEST: FULL}, results
    assert "called MPI.Intracomm.allreduce at minipar/parallel/tensor/mappings.py:" in \
        _outputs(results)["megatron-f-g"], _outputs(results)["megatron-f-g"]


# --- what the student reads ---------------------------------------------------------------------
def test_feedback_opens_with_the_check_and_names_the_students_files(tmp_path):
    tree = _tree(tmp_path, "op-backward")
    # a student's slip: an error raised in their own code (a wrong value is the checks' message)
    _cheat(tree, "op-backward", "raise ValueError('shapes (2, 3) and (4,) not aligned')")
    [result] = assignments.grade(tree, ["op-backward"])
    lines = result["output"].split("\n")
    assert lines[0] == "ValueError: shapes (2, 3) and (4,) not aligned"  # what went wrong first
    assert lines[1] == ("first failing check: test_op_backward_matmul_matches_finite_"
                        "differences in minipar/assignments/checks.py")
    assert "task op-backward (lesson 01)" in lines[2]
    assert "minipar/ops.py:" in result["output"] and "minipar-grade-" not in result["output"]
    assert "site-packages" not in result["output"]


def test_a_long_message_reaches_the_reports_whole_up_to_its_stated_bound(tmp_path):
    """pytest cuts a failure's message attribute at 500 characters; the report keeps the whole
    message (from the element text) up to MESSAGE_LINES lines, and says where it cuts."""
    tree = _tree(tmp_path, "op-backward")
    lines = [f"line {i} of what differs" for i in range(grader.MESSAGE_LINES + 30)]
    _cheat(tree, "op-backward", f"raise AssertionError({chr(10).join(lines)!r})")
    [result] = assignments.grade(tree, ["op-backward"])
    text = result["output"]
    # the check's own first line (the gradient check names its inputs), then the message
    assert text.startswith("AssertionError: Task op-backward: the gradients"), text[:300]
    kept = grader.MESSAGE_LINES - 2  # the last line of ours kept, after that first line
    assert f"line {kept} of what differs" in text
    assert f"line {kept + 1} of what differs" not in text.split("--- traceback")[0]
    assert f"[... 31 more lines cut: a report keeps the first {grader.MESSAGE_LINES} lines" in text
    assert "full report in element text" not in text
    assert f"line {kept} of what differs" in grader.markdown([result])


def test_reports_are_cleared_first_and_written_whole(tmp_path):
    out, md = tmp_path / "results.json", tmp_path / "report.md"
    out.write_text("stale")
    grader.clear_reports(out, md)
    assert not out.exists()
    task = assignments.BY_ID[HONEST]
    grader.write_reports(grader.unscored([task], "not graded: why"), out, md)
    assert json.loads(out.read_text())["tests"][0]["output"] == "not graded: why"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]
