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
    rows = {(m[0], m[1]): [float(v) for v in m[2:]] for m in re.findall(
        r"^\s+(float32|mixed)\s+2 (DP|ZeRO-\d)" + r"\s+(\S+)" * 5 + r"\s+\S+\s+(\S+)\s+\d+$",
        out, re.M)}
    # bytes per parameter: parameters, gradients, master, moments, total; the paper's total
    for precision, a, state in (("float32", 4, 8), ("mixed", 2, 12)):
        dp, z1, z2, z3 = (rows[precision, kind] for kind in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
        assert dp[:2] == [a, a] and dp[2] + dp[3] == state and dp[4] == 2 * a + state, out
        assert z1[4] == pytest.approx(2 * a + state / 2, abs=1e-3), out  # padding aside
        assert z2[4] == pytest.approx(a + (a + state) / 2, abs=1e-3), out
        assert z3[4] == pytest.approx((2 * a + state) / 2, abs=1e-3), out
        assert all(row[4] == pytest.approx(row[5], abs=1e-3) for row in (dp, z1, z2, z3)), out
        assert f"ok: {precision} AdamW: the bytes a rank holds equal the paper's formulas" in out
    sent = {kind: (float(dp), float(fp32)) for kind, dp, fp32 in re.findall(
        r"^\s+(DP|ZeRO-\d)\s+\S+\s+\S+\s+(\S+)\s+\S+\s+(\S+)$", out, re.M)}
    ratios = [sent[k][0] for k in ("ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert ratios == pytest.approx([1.0, 1.0, 1.5], abs=0.005), out  # traffic: x DP's
    assert [sent[k][1] for k in sent] == pytest.approx([0.5] * 4, abs=0.002), out  # 16 bits
    gap = float(re.search(r"largest loss difference from plain DP over \d+ steps: (\S+)", out)
                .group(1))
    assert gap < 1e-5, out
