"""``minipar lesson`` and the launcher profile (minipar.testing.launch_command)."""
import os
import stat

import pytest

from minipar import testing
from minipar.cli import main
from minipar.cli.lesson import build_command, default_ranks, find


def fake_launcher(tmp_path, banner, status=0):
    """An executable that prints ``banner`` for --version, else records its argv and exits."""
    path = tmp_path / "mpiexec"
    path.write_text("#!/bin/sh\n"
                    f'if [ "$1" = "--version" ]; then echo "{banner}"; exit 0; fi\n'
                    f'echo "$@" > "{tmp_path}/argv"\nexit {status}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def profile(tmp_path, monkeypatch):
    def use(banner, args="", status=0):
        monkeypatch.setenv("MINIPAR_MPIEXEC", fake_launcher(tmp_path, banner, status))
        monkeypatch.setenv("MINIPAR_MPIEXEC_ARGS", args)
        testing._FLAVOURS.clear()
    yield use
    testing._FLAVOURS.clear()


def test_lessons_are_found_by_number_or_name_part():
    assert find("4")[0].name == "04_allreduce.py"
    assert find("04")[0].name == "04_allreduce.py"
    assert find("allreduce")[0].name == "04_allreduce.py"
    assert find("GPipe")[0].name == "08_gpipe.py"


@pytest.mark.parametrize("name", ["0", "99", "nosuchlesson", "_"])
def test_an_unknown_lesson_is_an_argparse_error_listing_the_lessons(name, capsys):
    with pytest.raises(SystemExit) as done:
        main(["lesson", name])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "minipar lesson: error: argument NAME:" in err and "04_allreduce" in err


def test_the_rank_count_comes_from_the_run_line():
    assert default_ranks("mpiexec -n 4 python lessons/04_allreduce.py") == 4
    assert default_ranks("python lessons/01_autograd.py") is None
    assert default_ranks(find("11")[2]) == 8


def test_single_process_lessons_run_as_plain_python():
    path, _, line = find("01")
    argv = build_command(path, line, None, ["--quick"])
    assert argv[1:] == [str(path), "--quick"] and "mpiexec" not in argv[0]


def test_mpich_gets_the_profile_flags_and_nothing_else(profile):
    profile("HYDRA build details:", args="-hosts a,b -bind-to core")
    argv = testing.launch_command(64, "python", "x.py")
    assert argv[1:] == ["-hosts", "a,b", "-bind-to", "core", "-n", "64", "python", "x.py"]


def test_open_mpi_gets_oversubscribe_and_root_flags(profile):
    profile("mpiexec (Open MPI) 5.0.11")
    many = testing.launch_command(os.cpu_count() + 1, "python", "x.py")
    assert "--oversubscribe" in many
    assert ("--allow-run-as-root" in many) == (os.geteuid() == 0)
    assert "--oversubscribe" not in testing.launch_command(1, "python", "x.py")


def test_open_mpi_with_a_hostfile_leaves_the_slots_to_it(profile):
    profile("mpiexec (Open MPI) 5.0.11", args="--hostfile hosts.txt")
    argv = testing.launch_command(os.cpu_count() + 1, "python", "x.py")
    assert argv[1:3] == ["--hostfile", "hosts.txt"] and "--oversubscribe" not in argv


def test_the_lesson_runs_through_the_profile_and_passes_its_status(profile, tmp_path):
    profile("mpiexec (Open MPI) 5.0.11", status=3)
    assert main(["lesson", "08", "--", "--quick"]) == 3
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("-n") + 1] == "4" and argv[-2:] == [str(find("08")[0]), "--quick"]


@pytest.mark.mpi
def test_lesson_04_runs_and_passes():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "minipar.cli", "lesson", "04", "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout


@pytest.mark.parametrize("argv, nprocs, rest", [
    (["04", "-n", "3", "--", "--quick"], 3, ["--quick"]),
    (["-n", "3", "04", "--", "--quick"], 3, ["--quick"]),
    (["04", "--nprocs=3"], 3, []),
    (["08", "--quick"], 4, ["--quick"]),
])
def test_n_and_the_lesson_arguments_go_where_they_belong(profile, tmp_path, argv, nprocs, rest):
    profile("mpiexec (Open MPI) 5.0.11")
    assert main(["lesson", *argv]) == 0
    recorded = (tmp_path / "argv").read_text().split()
    assert recorded[recorded.index("-n") + 1] == str(nprocs)
    assert recorded[recorded.index("-n") + 4:] == rest


class _Stream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        return self.tty


def test_a_terminal_is_passed_on_to_the_ranks_which_mpiexec_gives_pipes(monkeypatch):
    from minipar.cli.lesson import terminal_env
    monkeypatch.setenv("COLUMNS", "132")  # what shutil.get_terminal_size reads first
    assert terminal_env({}, _Stream(True), _Stream(True)) == {"MINIPAR_PROGRESS": "1",
                                                              "COLUMNS": "132"}
    assert terminal_env({}, _Stream(False), _Stream(False)) == {}  # a log file: no bars
    assert terminal_env({"MINIPAR_PROGRESS": "0", "COLUMNS": "80"},
                        _Stream(True), _Stream(True)) == {}  # the user's own setting wins
