"""Lesson 11 (3D parallelism, the flagship demo) runs under mpiexec and checks itself."""
import json
import os
import re

import pytest

from minipar.testing import run_on_ranks
from test_lessons_pass import passed

LESSON = os.path.join(os.path.dirname(__file__), "..", "lessons", "11_3d_parallel.py")


@pytest.mark.mpi
def test_lesson11_quick_2x2x2():
    """The lesson asserts by itself that its losses equal serial training's and fall."""
    passed("11_3d_parallel.py", 8)  # the shared run: exit 0 and a PASS line


@pytest.mark.mpi
def test_lesson11_names_world_ranks_and_how_the_data_groups_move():
    out = passed("11_3d_parallel.py", 8)  # the shared run
    # rank 0's pipeline group is world ranks 0 and 4: the timeline's rows say so
    gantt = [line.split(" | ")[0].strip() for line in out.splitlines() if " | " in line]
    assert gantt[:2] == ["rank 0", "rank 4"], gantt
    # the text about the data groups agrees with the message count in the table above it
    [messages] = re.findall(r"^\s*data\s+(\d+)\s+[\d.]+$", out, re.M)
    assert ("send no message" in out) == (messages == "0"), out


@pytest.mark.mpi
def test_lesson11_quick_on_4_ranks_writes_a_chrome_trace(tmp_path):
    path = tmp_path / "timeline.json"
    run_on_ranks(LESSON, 4, args=("--quick", "--tp", "2", "--pp", "2", "--trace", str(path)),
                 timeout=240)
    events = json.loads(path.read_text())["traceEvents"]
    work = [e for e in events if e.get("ph") == "X"]
    assert {e["tid"] for e in work} == {0, 1, 2, 3}  # one row per rank
    assert {e["name"][0] for e in work} >= {"F", "B"}
