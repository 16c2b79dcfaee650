"""The student tree stands alone, and submissions are graded as they arrive (issue 21).

``make`` writes a README, install metadata and the task record; ``pip install -e`` of the tree
into a fresh environment where the reference is installed too makes the tree's ``minipar``
command run the student's code; ``grade`` without ``--tasks`` grades the recorded tasks; a
zip of the tree or of its folder is graded, and an empty, corrupt or ambiguous one still gets a
Gradescope results.json with 0 and the reason; ``make`` refuses to write over a folder.
The graded runs and the fresh environment start subprocesses and ranks: they are marked ``mpi``.
"""
import importlib.metadata
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from minipar import assignments
from minipar.assignments import submission, tree
from minipar.cli import main

ROOT = assignments.ROOT
QUICK = ["one-f-one-b", "rank-grid"]  # table order; single-process checks: seconds to grade
POINTS = [assignments.BY_ID[i].points for i in QUICK]


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A tree with the two quick tasks stripped."""
    out = tmp_path_factory.mktemp("tree") / "hw"
    assignments.make(out, QUICK)
    return out


def _listing(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else b"")
                  for p in folder.rglob("*"))


def test_make_refuses_a_folder_with_something_in_it_and_force_writes_over_it(tmp_path, capsys):
    out = tmp_path / "hw"
    out.mkdir()
    (out / "my_work.py").write_text("print('a student's work')\n")
    before = _listing(out)
    with pytest.raises(SystemExit) as exit:
        main(["assignment", "make", "--out", str(out), "--tasks", "rank-grid"])
    assert exit.value.code == 2
    assert f"argument --out: {out} is not empty" in capsys.readouterr().err
    assert _listing(out) == before  # nothing written
    assert main(["assignment", "make", "--out", str(out), "--tasks", "rank-grid", "--force"]) == 0
    assert (out / "minipar/parallel/groups.py").is_file() and (out / "my_work.py").is_file()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        assignments.make(tmp_path / "a_file", ["rank-grid"], force=True)


def test_the_tree_has_a_readme_install_metadata_and_its_task_record(student):
    readme = (student / "README.md").read_text()
    assert readme.startswith(f"# Assignment: 2 task(s), {sum(POINTS)} points")
    for task in (assignments.BY_ID[i] for i in QUICK):
        assert f"| `{task.id}` | {task.points} | {task.title} |" in readme
        assert f"-k \"{task.tests[0]}\"" in readme and f"--tasks {task.id}" in readme
        assert f"minipar lesson {task.lesson}" in readme and task.files[0] in readme
    assert "`lessons/11_3d_parallel.py`" in readme and 'pip install -e ".[mpi]"' in readme
    assert "minipar assignment grade ." in readme
    setup = (student / "setup.cfg").read_text()
    assert "minipar = minipar.cli:main" in setup and "name = minipar" in setup
    assert "testpaths" not in setup and "mpi: runs ranks" in setup and "mpi4py" in setup
    assert (student / "pyproject.toml").read_text().startswith("[build-system]")
    record = json.loads((student / "assignment.json").read_text())
    assert record == {"tasks": QUICK, "points": sum(POINTS)}
    assert tree.recorded(student) == QUICK and tree.recorded(ROOT) is None


def test_the_trees_watchdog_reports_a_deadlock_in_seconds(student):
    """make writes the tree's watchdog default (tree.WATCHDOG); MINIPAR_TIMEOUT still wins."""
    path, reference, short = tree.WATCHDOG
    assert reference in (ROOT / path).read_text() and short in (student / path).read_text()
    read = "from minipar.comm import watch; print(watch._watch['timeout'])"
    env = {k: v for k, v in os.environ.items() if k != "MINIPAR_TIMEOUT"}
    for extra, want in (({}, "12.0"), ({"MINIPAR_TIMEOUT": "30"}, "30.0")):
        run = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True,
                             env={**env, **extra, "PYTHONPATH": str(student)}, timeout=60,
                             cwd=student)  # not the reference's checkout, first on sys.path
        assert run.stdout.strip() == want, run.stderr


def test_the_metadata_of_a_wheel_installed_reference_declares_the_same_command():
    try:
        importlib.metadata.distribution("minipar")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("minipar is not installed here (only on PYTHONPATH)")
    text = tree.setup_cfg(None)  # no setup.cfg beside the package: read what pip installed
    assert "minipar = minipar.cli:main" in text and "numpy" in text and "mpi =" in text


def test_a_broken_record_is_read_as_a_clear_error(tmp_path):
    (tmp_path / "assignment.json").write_text('{"tasks": "rank-grid"}')
    with pytest.raises(ValueError, match='"tasks" must be a list'):
        tree.recorded(tmp_path)
    (tmp_path / "assignment.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read its task list"):
        tree.recorded(tmp_path)


def test_grade_picks_the_recorded_tasks_else_every_task(student, monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(assignments, "grade", lambda tree, ids, *a, **k: asked.append(ids) or [])
    for extra in ([], ["--all"], ["--tasks", "ddp-buckets"]):
        assert main(["assignment", "grade", str(student), *extra]) == 0
    assert main(["assignment", "grade", str(ROOT)]) == 0  # a reference tree records nothing
    assert asked == [QUICK, None, ["ddp-buckets"], None]
    with pytest.raises(SystemExit):  # --tasks and --all contradict each other
        main(["assignment", "grade", str(student), "--all", "--tasks", "rank-grid"])


def _zip(path, folder, prefix=""):
    """Zip every file under ``folder`` as ``prefix/<relative path>``."""
    with zipfile.ZipFile(path, "w") as archive:
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                archive.write(file, str(pathlib.PurePosixPath(prefix, file.relative_to(folder))))
    return path


def _results(submitted, tmp_path, *extra, status=0):
    out = tmp_path / "results" / "results.json"
    assert main(["assignment", "grade", str(submitted), "--json", str(out), *extra]) == status
    report = json.loads(out.read_text())
    assert set(report) >= {"score", "execution_time", "tests"}
    for test in report["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output"}
    return report


def test_an_ungradeable_submission_still_gets_results_with_the_reason(student, tmp_path):
    empty = tmp_path / "empty.zip"
    zipfile.ZipFile(empty, "w").close()
    corrupt = tmp_path / "corrupt.zip"
    corrupt.write_bytes(_zip(tmp_path / "whole.zip", student / "lessons").read_bytes()[:3000])
    two = tmp_path / "two"
    for name in ("mine", "backup"):
        (two / name / "minipar").mkdir(parents=True)
        (two / name / "minipar/__init__.py").write_text("")
    cases = {empty: "empty.zip is empty", corrupt: "corrupt.zip is not a zip archive",
             _zip(tmp_path / "two.zip", two): "holds 2 minipar/ trees (backup, mine)",
             student / "lessons": "holds no minipar/ package"}
    for submitted, reason in cases.items():
        report = _results(submitted, tmp_path, "--tasks", ",".join(QUICK), status=1)
        assert report["score"] == 0 and [t["max_score"] for t in report["tests"]] == POINTS
        for test in report["tests"]:
            assert test["output"].startswith("not graded: ") and reason in test["output"], test


def _venv(folder):
    """What `python -m venv` leaves that matters here: pyvenv.cfg, and packages."""
    (folder / "lib/python3/site-packages/numpy").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (folder / "lib/python3/site-packages/numpy/core.so").write_bytes(bytes(3 * 2**20))


def test_pack_leaves_out_environments_caches_and_builds_and_stays_small(tmp_path, capsys):
    tree = tmp_path / "hw"
    assignments.make(tree)  # every task
    _venv(tree / ".venv")
    _venv(tree / "my-env")  # a virtual environment of any name: it holds a pyvenv.cfg
    for folder in ("__pycache__", "build/lib", "dist", "minipar.egg-info", ".git",
                   "minipar/__pycache__", ".pytest_cache"):
        (tree / folder).mkdir(parents=True, exist_ok=True)
        (tree / folder / "x.bin").write_bytes(bytes(2**20))
    (tree / "notes.txt").write_text("the student's own notes travel with the tree\n")
    assert main(["assignment", "pack", str(tree)]) == 0
    assert "hand in this file" in capsys.readouterr().out
    packed = tmp_path / "hw.zip"
    names = zipfile.ZipFile(packed).namelist()
    assert packed.stat().st_size < 2**20, packed.stat().st_size  # every task under 1 MB
    kept = {n.split("/")[1] for n in names}
    assert kept >= {"minipar", "lessons", "README.md", "assignment.json", "notes.txt"}
    assert kept.isdisjoint({".venv", "my-env", "build", "dist", "minipar.egg-info", ".git",
                            "__pycache__", ".pytest_cache"}) and ".pyc" not in str(names)
    with submission.opened(packed) as (found, reason):
        assert reason is None and found.name == "hw"
    with pytest.raises(SystemExit) as exit:  # not a tree: refused, nothing written
        main(["assignment", "pack", str(tmp_path), "--out", str(tmp_path / "x.zip")])
    assert exit.value.code == 2 and not (tmp_path / "x.zip").exists()
    assert "holds no minipar/ folder" in capsys.readouterr().err


def test_a_zip_made_by_hand_is_read_without_its_environment_or_says_what_made_it_large(
        student, tmp_path, monkeypatch):
    monkeypatch.setattr(submission, "MAX_BYTES", 4 * 2**20)  # the tree is about 1.5 MB
    hand = tmp_path / "hand"
    shutil.copytree(student, hand / "hw")
    _venv(hand / "hw" / ".venv")
    with submission.opened(_zip(tmp_path / "venv.zip", hand)) as (found, reason):
        assert reason is None and not (found / ".venv").exists()  # left out, not counted
    (hand / "hw/data").mkdir()
    (hand / "hw/data/big.bin").write_bytes(bytes(5 * 2**20))
    with submission.opened(_zip(tmp_path / "data.zip", hand)) as (found, reason):
        assert found is None and "over the 4 MB / 20000 limit" in reason
        assert "the most is in hw/data/ 5 MB in 1 files" in reason
        assert "minipar assignment pack" in reason


def test_an_unpacked_zip_never_lands_outside_its_folder(tmp_path):
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as archive:
        archive.writestr("hw/minipar/__init__.py", "")
        archive.writestr("../escaped.py", "print('out')")
    (tmp_path / "into").mkdir()
    with pytest.raises(submission.Unusable, match="would unpack outside its folder"):
        submission.unzip(evil, tmp_path / "into")
    assert not (tmp_path / "escaped.py").exists()
    with zipfile.ZipFile(tmp_path / "windows.zip", "w") as archive:  # backslashes: folders
        archive.writestr("hw\\minipar\\__init__.py", "")
    with submission.opened(tmp_path / "windows.zip") as (found, reason):
        assert reason is None and found.name == "hw" and (found / "minipar/__init__.py").is_file()


@pytest.mark.mpi
def test_a_zip_of_the_folder_or_of_the_tree_is_graded(student, tmp_path):
    for name, prefix in (("folder.zip", "hw"), ("tree.zip", "")):
        report = _results(_zip(tmp_path / name, student, prefix), tmp_path / name[:-4])
        assert [t["name"].split(":")[0] for t in report["tests"]] == QUICK  # the record's tasks
        for test in report["tests"]:  # graded: the stub's message, not a refusal
            assert f"Task {test['name'].split(':')[0]}:" in test["output"], test


@pytest.mark.mpi
def test_grade_without_tasks_totals_the_recorded_tasks(student, tmp_path):
    solved = tmp_path / "solved"
    shutil.copytree(student, solved)
    for task in QUICK:  # the student's answer: the reference code (its markers are comments)
        for name in assignments.BY_ID[task].files:
            shutil.copy(ROOT / name, solved / name)
    report = _results(solved, tmp_path)
    assert [t["name"].split(":")[0] for t in report["tests"]] == QUICK
    assert report["score"] == sum(t["max_score"] for t in report["tests"]) == sum(POINTS)


def _rank_env(**extra):
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.mpi
def test_a_lesson_says_which_minipar_it_runs_when_not_its_trees(student):
    lesson = str(student / "lessons/03_send_recv.py")  # one rank: it stops at the rank check
    # the tree's lesson where only the reference is found
    other = subprocess.run([sys.executable, lesson], capture_output=True, text=True, timeout=120,
                           env=_rank_env(PYTHONPATH=str(ROOT)))
    note = f"note: this lesson runs the minipar in {ROOT / 'minipar'}, not the one in "
    assert other.stderr.startswith(note + f"{student / 'minipar'}; to run that one: "
                                   f"pip install -e {student}"), other.stderr
    own = subprocess.run([sys.executable, lesson], capture_output=True, text=True, timeout=120,
                         env=_rank_env(PYTHONPATH=str(student)))
    assert "note:" not in own.stderr and "needs 2 ranks" in own.stderr, own.stderr
    # the reference's own lesson, started inside the student's tree (`minipar lesson` there)
    inside = subprocess.run([sys.executable, str(ROOT / "lessons/03_send_recv.py")], cwd=student,
                            capture_output=True, text=True, timeout=120,
                            env=_rank_env(PYTHONPATH=str(ROOT)))
    assert inside.stderr.startswith(note + f"{student / 'minipar'}"), inside.stderr


@pytest.mark.mpi
def test_the_installed_tree_runs_the_students_code_beside_the_reference(tmp_path):
    student = tmp_path / "hw"
    assignments.make(student, ["ring-all-reduce"])
    venv = student / ".venv"  # where the tree's README makes it
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    # the system site of a venv made from a venv is the base Python's: this .pth adds the one
    # the tests run in (its numpy, mpi4py, setuptools and the reference minipar, installed)
    [packages] = venv.glob("lib/python*/site-packages")
    (packages / "zz_reference.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()))
    python = venv / "bin/python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "-q", "--no-deps", "--no-build-isolation", "-e", str(student)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    env = _rank_env(PATH=os.pathsep.join([str(venv / "bin"), _rank_env()["PATH"]]))
    libraries = pathlib.Path(sys.prefix, "lib")
    if any(libraries.glob("libmpi.so*")):  # the mpich wheel's, which mpi4py seeks in sys.prefix
        env["MPI4PY_LIBMPI"] = str(libraries)
    which = subprocess.run([str(python), "-c", "import minipar; print(minipar.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert which.stdout.strip() == str(student / "minipar/__init__.py"), which.stderr
    lesson = subprocess.run([str(venv / "bin/minipar"), "lesson", "04", "-n", "4", "--",
                             "--quick"], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert lesson.returncode != 0 and "PASS" not in lesson.stdout
    assert "Task ring-all-reduce: the ring reduce-scatter" in lesson.stdout + lesson.stderr
    # handed in as the README says: its pack command, run in the tree, leaves .venv out
    (venv / "lib/fat.bin").write_bytes(bytes(2**20))
    pack = subprocess.run([str(venv / "bin/minipar"), "assignment", "pack", "."],
                          capture_output=True, text=True, timeout=120, env=env, cwd=student)
    assert pack.returncode == 0 and "hand in this file" in pack.stdout, pack.stderr
    names = zipfile.ZipFile(tmp_path / "hw.zip").namelist()
    assert "hw/minipar/comm/patterns.py" in names and not any(".venv" in n for n in names)
    assert not any("egg-info" in n or "__pycache__" in n for n in names)
    zipped, folder = (_results(handed, tmp_path / f"of-{handed.name}")
                      for handed in (tmp_path / "hw.zip", student))
    assert [(t["name"], t["score"], t["status"]) for t in zipped["tests"]] == \
        [(t["name"], t["score"], t["status"]) for t in folder["tests"]]
    assert "Task ring-all-reduce:" in zipped["tests"][0]["output"]
