"""Assignments: the marked regions, the student tree, and the grader's round trip.

The round trip (the acceptance of issue 11): the reference tree grades 100 %, a tree with every
task stripped scores 0 on each stripped task, a tree with one task stripped loses exactly that
task's points, and the stripped tree imports and runs a lesson that does not need the stripped
code. The graded runs launch pytest and MPI ranks (marked ``mpi``); they grade a few tasks each
so the file stays within a couple of minutes, and the reference once in full. The loss-scale
task (issue 23) and the online-softmax merge (issue 24) have quick round trips of their own;
the loss-scale check's hand-made table is replayed on torch.amp.GradScaler.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from minipar import assignments
from minipar.assignments.checks import LOSS_SCALE_CASES
from minipar.cli import main
from nn_torch_twins import requires_torch, torch

ROOT = assignments.ROOT
MARKER_FILES = sorted({f for t in assignments.TASKS for f in t.files})


def test_ids_are_words_not_numbers_and_points_sum_to_100():
    ids = [t.id for t in assignments.TASKS]
    assert len(set(ids)) == len(ids) >= 9
    assert all(not i.isdigit() and " " not in i and "," not in i for i in ids)
    assert sum(t.points for t in assignments.TASKS) == 100


def test_every_task_has_a_region_in_its_files_and_its_tests_exist():
    found = {}
    for name in MARKER_FILES:
        for task, first, last in assignments.regions((ROOT / name).read_text()):
            assert last > first + 1, f"{name}:{first + 1}: an empty region"
            found.setdefault(task, set()).add(name)
    for t in assignments.TASKS:
        assert found.get(t.id) == set(t.files), t.id
        for name in t.tests:
            assert f"def {name}(" in assignments.CHECKS.read_text(), name
            assert t.id.replace("-", "_") in name  # the test names its task


def test_markers_are_whole_comment_lines_only_in_the_tasks_files():
    begin, end = assignments.BEGIN, assignments.END
    paths = [p for folder in ("minipar", "tests", "lessons", "scripts")
             for p in sorted((ROOT / folder).glob("**/*.py"))]  # docs/teaching.md shows them
    for path in paths:
        lines = [l for l in path.read_text(errors="replace").split("\n") if begin in l or end in l]
        rel = path.relative_to(ROOT).as_posix()
        assert not lines or rel in MARKER_FILES, f"{rel} uses the solution markers"
        assert all(l.strip().startswith("###") for l in lines), rel


def test_strip_keeps_the_signature_hints_and_indentation():
    source = ('def f(x):\n    """Doc."""\n    # hint: add one\n'
              f'    {assignments.BEGIN} rank-grid\n    y = x + 1\n    return y\n'
              f'    {assignments.END}\n')
    stub = assignments.strip(source, {"rank-grid"})
    assert stub == ('def f(x):\n    """Doc."""\n    # hint: add one\n    raise NotImplementedError('
                    '"Task rank-grid: rank <-> (tp, dp, pp) coordinates of the 3-D grid '
                    '(see lesson 11)")\n')
    kept = assignments.strip(source, set())
    assert kept == 'def f(x):\n    """Doc."""\n    # hint: add one\n    y = x + 1\n    return y\n'
    namespace = {}
    exec(kept, namespace)
    assert namespace["f"](1) == 2


def test_list_prints_one_task_per_line(capsys):
    assert main(["assignment", "list"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l and not l.endswith(":")]
    assert [l.split()[0] for l in lines] == [t.id for t in assignments.TASKS]
    assert [int(l.split()[1]) for l in lines] == [t.points for t in assignments.TASKS]


def test_unknown_task_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["assignment", "make", "--out", str(tmp_path / "s"), "--tasks", "ring,rank-grid"])
    assert exit.value.code == 2
    assert "unknown task ring" in capsys.readouterr().err


def test_make_writes_stubs_for_chosen_tasks_and_solutions_for_the_rest(tmp_path):
    main(["assignment", "make", "--out", str(tmp_path), "--tasks", "rank-grid,ddp-buckets"])
    groups = (tmp_path / "minipar/parallel/groups.py").read_text()
    assert groups.count('NotImplementedError("Task rank-grid:') == 2
    assert "def coords(self, rank):" in groups and "(inverse of ``coords``)" in groups
    ops = (tmp_path / "minipar/ops.py").read_text()
    assert "gb = a2.swapaxes(-1, -2) @ as_2d(g)" in ops  # op-backward kept its solution
    for path in (tmp_path / "minipar").rglob("*.py"):
        assert assignments.BEGIN not in path.read_text(), path
    assert (tmp_path / "minipar/assignments/checks.py").is_file()
    assert (tmp_path / "lessons/02_checkpointing.py").is_file()


def test_a_task_past_its_time_or_the_budget_scores_zero_with_a_reason():
    task = assignments.BY_ID["ddp-buckets"]
    late = assignments.grade_task(task, ROOT, timeout=0.2)
    assert (late["score"], late["passed"]) == (0, False)
    assert late["output"].startswith("timed out: its tests ran past 0 s"), late["output"]
    spent = assignments.grade(ROOT, ["rank-grid", "ddp-buckets"], budget=0)
    assert [r["output"] for r in spent] == ["not run: the grading's time budget was spent"] * 2


def _grade(tree, ids, tmp_path):
    """Grade ``tree`` through the command; the Gradescope JSON it wrote."""
    out = tmp_path / "results.json"
    args = ["assignment", "grade", str(tree), "--json", str(out),
            "--markdown", str(tmp_path / "report.md")]
    assert main(args + (["--tasks", ",".join(ids)] if ids else [])) == 0
    return json.loads(out.read_text())


def _scores(report):
    return {t["name"].split(":")[0]: t["score"] for t in report["tests"]}


@pytest.mark.mpi
def test_the_reference_tree_grades_100_percent(tmp_path):
    report = _grade(ROOT, None, tmp_path)
    assert report["score"] == 100, json.dumps(report, indent=1)[:3000]
    for test in report["tests"]:  # Gradescope's fields; every name carries its task's id
        assert set(test) >= {"name", "score", "max_score", "output"}
        assert test["score"] == test["max_score"]
    assert [t["name"].split(":")[0] for t in report["tests"]] == [t.id for t in assignments.TASKS]


@pytest.mark.mpi
def test_every_stripped_task_grades_zero(tmp_path):
    assignments.make(tmp_path / "student")
    ids = ["op-backward", "ddp-buckets", "one-f-one-b", "megatron-f-g", "loss-scale-update",
           "online-softmax-merge"]
    report = _grade(tmp_path / "student", ids, tmp_path)
    assert report["score"] == 0 and set(_scores(report).values()) == {0}
    for test in report["tests"]:
        assert f"Task {test['name'].split(':')[0]}:" in test["output"]  # the stub's message
    text = (tmp_path / "report.md").read_text()
    assert "first failing check:" in text and "# Assignment grade: 0 / 30" in text


@pytest.mark.mpi
def test_one_stripped_task_loses_exactly_its_points_and_the_tree_still_works(tmp_path):
    tree = tmp_path / "student"
    assignments.make(tree, ["ring-all-reduce"])
    ids = ["ring-all-reduce", "recursive-halving", "megatron-f-g", "layer-norm"]
    report = _grade(tree, ids, tmp_path)
    ring = assignments.BY_ID["ring-all-reduce"].points
    assert _scores(report) == {i: 0 if i == "ring-all-reduce" else assignments.BY_ID[i].points
                               for i in ids}
    assert report["score"] == sum(assignments.BY_ID[i].points for i in ids) - ring
    # the stripped tree imports, and a lesson that needs no ring runs to its PASS line
    env = {**os.environ, "PYTHONPATH": str(tree)}
    parts = [p.relative_to(tree).with_suffix("").parts
             for p in (tree / "minipar").rglob("*.py") if p.name != "__main__.py"]
    modules = sorted(".".join(n[:-1] if n[-1] == "__init__" else n) for n in parts)
    code = ("import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
            "import minipar; print(minipar.__file__)")
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tree / "minipar/__init__.py")
    lesson = subprocess.run([sys.executable, "lessons/02_checkpointing.py", "--quick"], cwd=tree,
                            env=env, capture_output=True, text=True, timeout=240)
    assert lesson.returncode == 0 and "PASS" in lesson.stdout, lesson.stdout + lesson.stderr


@pytest.mark.mpi
@pytest.mark.fault
def test_a_hanging_ring_is_stopped_and_reports_who_waits_on_whom(tmp_path, monkeypatch):
    tree = tmp_path / "student"
    assignments.make(tree, ["ring-all-reduce"])
    patterns = tree / "minipar/comm/patterns.py"
    stub = assignments.BY_ID["ring-all-reduce"].stub()
    wrong = "c.Recv(tmp[:1], left)  # every rank receives first: a deadlock"
    patterns.write_text(patterns.read_text().replace(stub, wrong))
    monkeypatch.setenv("MINIPAR_TIMEOUT", "4")
    report = _grade(tree, ["ring-all-reduce"], tmp_path)
    output = report["tests"][0]["output"]
    assert report["score"] == 0
    assert "first failing check: test_ring_all_reduce_equals_the_sum" in output
    assert "waits in recv from rank" in output, output


# --- the single-process tasks of issues 23 and 24: listed, and a quick round trip each ----------
LOSS_SCALE = assignments.BY_ID["loss-scale-update"]
MERGE = assignments.BY_ID["online-softmax-merge"]


@pytest.mark.parametrize("task, lesson, file", [
    (LOSS_SCALE, "13", "minipar/amp/grad_scaler.py"),
    (MERGE, "14", "minipar/parallel/context/ring.py")], ids=lambda x: getattr(x, "id", None))
def test_the_new_tasks_are_listed_with_their_lesson(task, lesson, file, capsys):
    assert main(["assignment", "list"]) == 0
    [line] = [l for l in capsys.readouterr().out.splitlines() if l.startswith(task.id)]
    assert line.split()[1] == "5" and line.endswith(f"(lesson {lesson})")
    assert task.files == (file,)


def _stub_fails_reference_passes(task, tree):
    """Make ``tree`` with only ``task`` stripped; its grade: 0 with the stub's message, and
    rank-grid beside it keeps its points; the reference scores the task's points."""
    assignments.make(tree, [task.id])
    results = {r["task"]: r for r in assignments.grade(tree, [task.id, "rank-grid"])}
    assert {name: r["score"] for name, r in results.items()} == {
        task.id: 0, "rank-grid": assignments.BY_ID["rank-grid"].points}
    output = results[task.id]["output"]
    assert output.split("\n")[1].startswith(f"first failing check: {task.tests[0]}"), output
    assert f"raised NotImplementedError: Task {task.id}:" in output, output
    assert f"(see lesson {task.lesson})" in output, output
    [reference] = assignments.grade(ROOT, [task.id])
    assert reference["score"] == reference["max_score"] == task.points, reference


@requires_torch
@pytest.mark.parametrize("case", list(LOSS_SCALE_CASES))
def test_the_loss_scale_checks_trajectories_are_torchs(case):
    """The scales and growth trackers the check expects, written by hand from the rule, are
    torch.amp.GradScaler("cpu")'s when found_inf of its optimizers step on an inf or a NaN."""
    settings, found, powers, trackers = LOSS_SCALE_CASES[case]
    scaler = torch.amp.GradScaler("cpu", **settings)
    scaler.scale(torch.zeros(()))  # torch makes its scale tensor at the first scale()
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(max(found))]
    optimizers = [torch.optim.SGD([p], lr=0.1) for p in params]
    for k, (bad, power, tracker) in enumerate(zip(found, powers, trackers)):
        for i, (p, optimizer) in enumerate(zip(params, optimizers)):
            p.grad = torch.ones(3)
            if i < bad:
                p.grad[k % 3] = (float("inf"), float("nan"), float("-inf"))[k % 3]
            scaler.step(optimizer)
        scaler.update()
        got = (scaler.get_scale(), scaler.state_dict()["_growth_tracker"])
        assert got == (2.0**power, tracker), f"step {k}"


def test_the_loss_scale_round_trip_stub_fails_reference_passes(tmp_path):
    """A tree with only loss-scale-update stripped: the task scores 0 with its stub's message and
    rank-grid beside it keeps its points; in that tree GradScaler works up to update(), which
    names the task; the reference scores the task's points."""
    tree = tmp_path / "student"
    _stub_fails_reference_passes(LOSS_SCALE, tree)
    source = (tree / LOSS_SCALE.files[0]).read_text()
    assert LOSS_SCALE.stub() in source and "def _update_scale(self, found_inf):" in source
    assert "growth_interval, scale·growth_factor" in source  # the docstring stays
    code = """
import numpy, minipar
from minipar import optim
from minipar.amp import GradScaler
w = minipar.Tensor(numpy.ones(3, numpy.float32), requires_grad=True)
scaler, opt = GradScaler(init_scale=8.0), optim.SGD([w], lr=0.5)
scaler.scale((w * 2.0).sum()).backward()
scaler.step(opt)
scaler.update(new_scale=4.0)  # a scale given: the rule is not needed
print(scaler.get_scale(), w.data.tolist())
scaler.scale(w.sum()).backward()
scaler.step(opt)
scaler.update()
"""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["4.0 [0.0, 0.0, 0.0]"], proc.stdout + proc.stderr
    assert f'NotImplementedError: Task {LOSS_SCALE.id}: ' in proc.stderr, proc.stderr


def test_the_online_softmax_merge_round_trip_stub_fails_reference_passes(tmp_path):
    """A tree with only online-softmax-merge stripped: the task scores 0 with its stub's message
    and rank-grid keeps its points; in that tree _fold keeps its signature, its docstring and
    the backend line before the region, and stops at the stub; the reference scores 5."""
    tree = tmp_path / "student"
    _stub_fails_reference_passes(MERGE, tree)
    source = (tree / MERGE.files[0]).read_text()
    head = ('def _fold(s, v, m, l, acc):\n    """The online softmax: fold one block of scores')
    stubbed = f"    xp = backend.get_array_module(s)\n    {MERGE.stub()}\n\n\ndef _forward("
    assert head in source and "keeps m = −inf, l = 0 and acc = 0." in source
    assert stubbed in source and "m_new" not in source
