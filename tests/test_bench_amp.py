"""scripts/bench_amp.py's smoke run: a row per step, each a ratio to its own float32 step."""
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_amp.py"


def test_quick_run_prints_each_step_against_its_float32():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300,
                         env={"MINIPAR_DEVICE": "cpu", "PATH": "/usr/bin:/bin"}).stdout
    rows = {" ".join(line.split()[:2]): line.split() for line in out.splitlines()
            if line.startswith("  minipar ") or line.startswith("  torch ")}
    assert {"minipar float32", "minipar fp16", "minipar bf16"} <= set(rows), out
    assert float(rows["minipar float32"][-1]) == 1.0  # against itself
    assert all(float(row[-1]) > 0 for row in rows.values())
    assert "NumPy has no 16-bit GEMM" in out
