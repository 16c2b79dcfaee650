"""``minipar doctor``: READY and exit 0 on a working setup; each problem named with its fix."""
import os
import subprocess
import sys

import pytest


def doctor(*args, **env):
    done = subprocess.run([sys.executable, "-m", "minipar.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env})
    return done.returncode, done.stdout + done.stderr


@pytest.mark.mpi
def test_a_working_setup_is_ready_and_launches_two_ranks():
    status, out = doctor()
    assert status == 0, out
    for line in ("launcher", "MPI library loaded", "cores", "BLAS threads", "CuPy",
                 "2-rank launch", "CUDA-aware MPI", "node-local ranks", "GPU per rank", "READY"):
        assert line in out, (line, out)


def test_a_missing_launcher_is_a_problem_with_its_fix(tmp_path):
    status, out = doctor(MINIPAR_MPIEXEC=str(tmp_path / "no-such-mpiexec"))
    assert status == 1, out
    assert "is not an executable" in out and "fix: unset MINIPAR_MPIEXEC" in out
    assert out.rstrip().splitlines()[-1].startswith("NOT READY: 1 problem(s)")


def test_a_launcher_of_the_other_mpi_is_caught(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\necho "mpiexec (Open MPI) 5.0.11"\n')
    fake.chmod(0o755)
    status, out = doctor(MINIPAR_MPIEXEC=str(fake))
    if "MPI library loaded     Open MPI" in out:
        pytest.skip("mpi4py loads Open MPI here")
    assert status == 1 and "the launcher is openmpi but mpi4py loads mpich" in out, out
    assert "Open MPI rules" in out and "--oversubscribe" in out


def test_placement_shows_each_ranks_gpu_and_a_bad_minipar_gpu(capsys, monkeypatch):
    """The hello world's answers, faked for 4 ranks on a node of 2 GPUs."""
    from minipar.cli.doctor import Report, report_placement

    monkeypatch.delenv("MINIPAR_GPU", raising=False)
    hellos = [[r, 4, None, [r, 4, 1], 2, r % 2] for r in range(4)]
    report = Report()
    report_placement(report, hellos)
    out = capsys.readouterr().out
    assert "rank 0: 0 of 4, rank 1: 1 of 4, rank 2: 2 of 4, rank 3: 3 of 4 (1 node(s))" in out
    assert ("rank 0 -> GPU 0, rank 1 -> GPU 1, rank 2 -> GPU 0, rank 3 -> GPU 1 "
            "(local rank mod 2 GPU(s))") in out and not report.problems
    hellos[3][5] = "MINIPAR_GPU='5': local rank 3 would use GPU 5, but this node has 2 GPU(s)"
    report_placement(report, hellos)
    assert report.problems == [hellos[3][5]] and "fix: unset MINIPAR_GPU" in capsys.readouterr().out
