"""scripts/bench_gpu.py: without a GPU one line and exit 0; its --cpu smoke run (the same code
on NumPy, tiny sizes) runs every part, so the GPU benchmark cannot rot between GPU runs."""
import os
import pathlib
import subprocess
import sys

import pytest

from minipar import backend

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"


def bench(*args, **env):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    return done.returncode, done.stdout + done.stderr


@pytest.mark.skipif(backend._cupy_or_none() is not None, reason="a GPU is here")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    status, out = bench()
    assert status == 0, out
    assert out.strip().splitlines() == [
        "bench_gpu: no GPU here (CuPy with a CUDA device): nothing measured; "
        "--cpu runs a smoke test of the same code on NumPy"]


@pytest.mark.mpi
def test_the_cpu_smoke_run_goes_through_every_part():
    status, out = bench("--cpu", "--repeats", "2")
    assert status == 0, out
    assert out.startswith("device cpu (a smoke run")
    assert "GPT training step (forward + backward + AdamW)" in out and "minipar " in out
    assert "all-reduce on 2 ranks" in out and "ring staged" in out
    assert "3D demo (lessons/11, 4 ranks, --quick):" in out and "ms per step" in out
    assert "4 ranks on 1 node(s), device cpu" in out  # the lesson's header line
