"""Lesson 02 (gradient checkpointing) runs and prints the figures it promises."""
import pathlib
import re

from test_lessons_pass import passed

LESSON = pathlib.Path(__file__).resolve().parent.parent / "lessons" / "02_checkpointing.py"


def test_quick_run_prints_memory_time_and_identical_gradients():
    out = passed(LESSON.name, 1)  # the shared run: exit 0 and a PASS line
    rows = {line.split()[0]: line for line in out.splitlines()
            if re.match(r"^(none|every|sqrt).*\de[+-]\d\d$", line.rstrip())}  # table rows
    assert set(rows) == {"none", "every", "sqrt(n)"}
    for line in rows.values():
        assert line.rstrip().endswith("0.0e+00")  # max |dgrad| against the plain run
    # columns: peak MB, of plain, theory, step ms, ...
    of_plain = {name: float(re.findall(r"\d+\.\d+", line)[1]) for name, line in rows.items()}
    assert of_plain["none"] == 1.0
    assert of_plain["sqrt(n)"] <= 0.6 and of_plain["every"] < of_plain["sqrt(n)"]
    assert "plain forward" in out
