"""The ``minipar`` command: its subcommands are registered and ``lessons`` lists every lesson."""
import os
import pathlib
import subprocess
import sys

import pytest

from minipar.cli import SUBCOMMANDS, build_parser, main

LESSONS = sorted(p.name for p in (pathlib.Path(__file__).parent.parent / "lessons").glob("[0-9]*.py"))


def test_every_subcommand_builds():
    parser = build_parser()
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit):  # --help exits 0 after printing
            parser.parse_args([name, "--help"])


def test_lessons_lists_each_lesson_with_its_run_line(capsys):
    assert main(["lessons"]) == 0
    out = capsys.readouterr().out
    assert LESSONS, "the lessons folder is empty"
    for name in LESSONS:
        assert name in out
    assert "$ mpiexec -n 4 python lessons/04_allreduce.py\n" in out


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 0
    assert "lessons" in capsys.readouterr().out


def test_a_bad_argument_exits_2_with_the_error_line(capsys):
    with pytest.raises(SystemExit, match=r"^minipar groups: error: argument --tp: must be a "
                                         r"positive integer, got 0$") as exit_:
        main(["groups", "--world", "8", "--tp", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: minipar groups") and err.endswith(
        "minipar groups: error: argument --tp: must be a positive integer, got 0\n")


def test_the_benchmark_checks_its_arguments_before_mpi_starts():
    """``minipar bench`` and ``python -m minipar.bench`` import mpi4py only to measure, so under
    mpiexec a bad argument ends every rank before MPI starts (``minipar schedule`` imports the
    pipeline package, which uses minipar.comm, but it never creates a communicator)."""
    code = ("import sys; import minipar.bench, minipar.cli.bench, minipar.cli.groups; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=pathlib.Path(__file__).parent.parent)
    assert out.stdout.strip() == "False", out.stderr


def test_the_script_names_itself_in_its_errors():
    root = pathlib.Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "scripts/bench_allreduce.py", "--sizes", "abc"],
                          capture_output=True, text=True, timeout=60, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "scripts/bench_allreduce.py: error: argument --sizes:")


def test_python_dash_m_minipar_is_the_command():
    """Where the console script is not on PATH (a student's tree before pip install)."""
    done = subprocess.run([sys.executable, "-m", "minipar", "assignment", "list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "ring-all-reduce" in done.stdout, done.stderr


@pytest.mark.parametrize("name, nprocs, said", [
    ("03", 1000, "lesson 03 runs on 2 ranks, not 1000: minipar lesson 03 -n 2"),
    ("04", 1, "lesson 04 runs on 2 or more ranks, not 1: minipar lesson 04 -n 4"),
    ("10", 3, "lesson 10 runs on 2, 4 or 8 ranks, not 3: minipar lesson 10 -n 2"),
    ("01", 4, "lesson 01 runs on 1 rank, not 4: minipar lesson 01"),  # it uses no MPI
    ("12", 3, "lesson 12 runs on 2, 4 or 8 ranks, not 3: minipar lesson 12 -n 2"),
])
def test_lesson_refuses_a_rank_count_before_launching(name, nprocs, said, capsys, no_mpiexec):
    """The counts a lesson's ``mpi_world`` accepts are read from its source (or asked of the
    lesson where it computes them), so a wrong ``-n`` is an argument error here, not N processes
    started only to hear the lesson refuse."""
    with pytest.raises(SystemExit) as exit_:
        main(["lesson", name, "-n", str(nprocs)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument -n/--nprocs: {said}\n")


@pytest.fixture
def no_mpiexec(monkeypatch):
    """Processes start (the lesson asked for its counts) but mpiexec does not."""
    real_popen = subprocess.Popen

    def no_launch(args, *rest, **kwargs):
        assert "mpiexec" not in os.path.basename(args[0]), f"launched {args}"
        return real_popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", no_launch)


@pytest.mark.parametrize("argv, said", [
    (["11", "-n", "1000"], "lesson 11 runs on 4, 8 or 16 ranks, not 1000: minipar lesson 11 -n 8"),
    (["11", "-n", "8", "--", "--tp", "1", "--pp", "1"],
     "lesson 11 runs on 1, 2 or 4 ranks, not 8: minipar lesson 11 -n 1 -- --tp 1 --pp 1"),
    (["09", "-n", "8", "--", "--quick"],  # --quick: m = 4 micro-batches, p divides them
     "lesson 09 runs on 2 or 4 ranks, not 8: minipar lesson 09 -n 4 -- --quick"),
    (["10", "-n", "8", "--", "--quick"],  # --quick: 4 heads, p divides them
     "lesson 10 runs on 2 or 4 ranks, not 8: minipar lesson 10 -n 2 -- --quick"),
])
def test_lesson_asks_counts_it_computes_from_its_arguments(argv, said, capsys, no_mpiexec):
    """Lesson 11 runs on T·P·D ranks for its own --tp, --pp and --batch: the command asks the
    lesson (one plain process, up to its mpi_world call) and refuses before mpiexec starts."""
    with pytest.raises(SystemExit) as exit_:
        main(["lesson", *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument -n/--nprocs: {said}\n")


def test_lesson_refuses_its_own_bad_arguments_before_launching(no_mpiexec, capfd):
    with pytest.raises(SystemExit) as exit_:
        main(["lesson", "11", "-n", "8", "--", "--tp", "x"])
    assert exit_.value.code == 2
    assert "argument --tp: invalid int value: 'x'" in capfd.readouterr().err


def test_lesson_launches_a_count_its_arguments_allow(monkeypatch):
    """The count the lesson computes is the one launched: -n 2 with --tp 1 --pp 2."""
    launched = []

    class Done:
        def __init__(self, args, *rest, **kwargs):
            launched.append(args)

        def wait(self):
            return 0

    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda args, *rest, **kwargs: (
        Done(args) if "mpiexec" in os.path.basename(args[0]) and len(args) > 2 else
        real_popen(args, *rest, **kwargs)))
    assert main(["lesson", "11", "-n", "2", "--", "--tp", "1", "--pp", "2", "--quick"]) == 0
    assert launched and launched[0][-5:] == ["--tp", "1", "--pp", "2", "--quick"]
