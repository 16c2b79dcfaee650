"""Lesson 17 runs on 2 ranks, full and --quick, and prints the numbers it promises: FP8 under
each recipe within the band of bf16's loss, the outliers' underflow (tensor-wise flushes, 1x128
tiles do not), 16 bytes per parameter in every precision, DDP over FP8 equal on both ranks."""
import re

import pytest

from test_lessons_pass import passed

LESSON = "17_fp8.py"
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


def outliers(out):
    """recipe -> (flushed to 0, mean relative error) on the activation with outliers."""
    return {r: (int(n), float(e)) for r, n, e in
            re.findall(r"^\s+(\S+(?: tiles)?)\s+outliers\s+(\d+)\s+([0-9.]+)", out, re.M)}


def check_numbers(out, steps):
    assert f"trained {steps} steps" in out
    gaps = dict(re.findall(r"(\w+) ([+-][0-9.]+)", re.search(
        rf"loss gap to bf16 at step {steps}: (.*)", out).group(1)))
    assert sorted(gaps) == sorted(RECIPES)
    assert all(abs(float(g)) < 0.05 for g in gaps.values()), gaps
    found = outliers(out)
    assert sorted(found) == ["1x128 tiles", "delayed", "mxfp8", "tensorwise"]
    assert found["tensorwise"][0] > 10 * found["1x128 tiles"][0]
    assert found["delayed"][0] == found["tensorwise"][0]
    assert found["1x128 tiles"][1] < found["tensorwise"][1] / 1.5
    totals = re.findall(r"^\s+(float32|bf16|fp8 \(bf16 \+ Float8Linear\))\s+(\d+)\s+(\d+)\s+"
                        r"(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert [(name, tuple(map(int, rest))) for name, *rest in totals] == [
        ("float32", (4, 4, 0, 8, 16)), ("bf16", (2, 2, 4, 8, 16)),
        ("fp8 (bf16 + Float8Linear)", (2, 2, 4, 8, 16))]
    assert "parameters across ranks: max |diff| = 0;" in out
    sent = float(re.search(r"One rank sends ([0-9.]+) bytes per parameter", out).group(1))
    assert abs(sent - 2.0) < 0.02  # ring on 2 ranks: the bf16 gradients' 2 bytes
    return gaps, found


@pytest.mark.mpi
def test_quick_run_on_two_ranks():
    out = passed(LESSON, 2)  # the shared run: exit 0 and a PASS line
    assert "FAIL" not in out
    check_numbers(out, 12)


@pytest.mark.mpi
def test_full_run_on_two_ranks():
    out = passed(LESSON, 2, args=())
    assert "FAIL" not in out
    check_numbers(out, 50)


@pytest.mark.mpi
def test_one_rank_skips_data_parallel_and_says_so():
    out = passed(LESSON, 1)
    assert "one rank: run on 2 ranks for data parallel over the FP8 model" in out
    assert "DDP over FP8" not in out
