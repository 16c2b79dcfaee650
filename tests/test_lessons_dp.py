"""Smoke runs of the data-parallel lessons (``--quick``) under mpiexec, checking what they print."""
import re

import pytest

from test_lessons_pass import passed


def run_lesson(name, nprocs):
    return passed(name, nprocs)  # the shared run: exit 0 and a PASS line


@pytest.mark.parametrize("nprocs", [3])
def test_lesson_05_data_parallel(nprocs):
    out = run_lesson("05_data_parallel.py", nprocs)
    diff = float(re.search(r"data-parallel vs serial after \d+ epochs: (\S+)", out).group(1))
    assert diff < 1e-10, out
    for method in ("DDP ring", "DDP recursive_halving", "DDP mpi", "parameter server, one",
                   "parameter server, sharded"):
        assert method in out, out
    gain = re.search(r"gain from overlap \(off / on\): (\S+)x; DDP's default here: overlap "
                     r"(on|off): 3 rank\(s\) on (\d+) usable cores", out)
    assert gain and float(gain.group(1)) > 0, out
    assert (gain.group(2) == "on") == (int(gain.group(3)) > 3), out


def test_lesson_06_zero():
    out = run_lesson("06_zero.py", 2)
    cell = r"\s+(\d+)/(\d+)/(\d+)"
    row = [int(v) for v in re.findall(r"^\s+2" + cell * 4 + r"\s+(\S+)", out, re.M)[0][:12]]
    dp, z1, z2, z3 = row[0:3], row[3:6], row[6:9], row[9:12]
    assert abs(z1[2] - dp[2] / 2) <= 1 and abs(z2[1] - dp[1] / 2) <= 1, out
    assert all(abs(z - d / 2) <= 1 for z, d in zip(z3, dp)), out  # ZeRO-3: half of everything
    sent = dict(re.findall(r"^\s+(DP|ZeRO-\d)\s+\S+\s+\S+\s+(\S+)$", out, re.M))
    ratios = [float(sent[k]) for k in ("ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert ratios == pytest.approx([1.0, 1.0, 1.5], abs=0.005), out  # traffic: x DP's
    gap = float(re.search(r"largest loss difference from plain DP over \d+ steps: (\S+)", out)
                .group(1))
    assert gap < 1e-5, out
