"""Timelines: bubble and memory from events, text Gantt and Chrome-trace JSON (the PNG picture:
tests/test_figures.py)."""
import json

import pytest

from minipar.parallel.pipeline import build, simulate
from minipar.parallel.pipeline.timeline import (Event, Tracer, bubble_fraction, bubble_per_rank, chrome_trace,
                                                peak_inflight, text_gantt, write_chrome_trace)


def test_text_gantt_snapshot():
    assert text_gantt(simulate(build("gpipe", 2, 2))) == (
        "rank 0 | F0 F1 .  .  .  B0 B0 B1 B1\n"
        "rank 1 | .  F0 F1 B0 B0 B1 B1 .  .")
    assert text_gantt(simulate(build("zb-h1", 2, 2))) == (
        "rank 0 | F0 F1 .  B0 W0 B1 W1\n"
        "rank 1 | .  F0 B0 F1 B1 W0 W1")
    assert text_gantt(simulate(build("interleaved", 2, 2))).splitlines()[0].startswith("rank 0 | F0a F1a F0b")
    # the rows can be named, e.g. by the world ranks of one pipeline group
    assert text_gantt(simulate(build("gpipe", 2, 2)), labels=["rank 0", "rank 12"]) == (
        "rank 0  | F0 F1 .  .  .  B0 B0 B1 B1\n"
        "rank 12 | .  F0 F1 B0 B0 B1 B1 .  .")


def test_bubble_counts_waiting_receives_as_idle():
    events = [Event(0, 0, 2, "F", 0), Event(1, 0, 1, "RECV_F", 0), Event(1, 1, 2, "F", 0)]
    assert bubble_per_rank(events) == [0.0, 0.5]
    assert bubble_fraction(events) == 0.25


def test_peak_inflight_with_recompute_and_ties():
    events = [Event(0, 0, 1, "F", 0), Event(0, 1, 2, "F", 1), Event(0, 2, 3, "R", 0),
              Event(0, 3, 4, "B", 0), Event(0, 4, 5, "R", 1), Event(0, 5, 6, "B", 1)]
    assert peak_inflight(events) == [1]
    kept = [Event(0, 0, 1, "F", 0), Event(0, 1, 2, "B", 0), Event(0, 2, 3, "F", 1), Event(0, 3, 4, "B", 1)]
    assert peak_inflight(kept) == [1]  # a backward ending frees before the next forward starts


def test_tracer_records_events_like_the_simulator():
    ticks = iter(range(100))
    tracer = Tracer(rank=3, clock=lambda: next(ticks))
    with tracer.record("F", mb=2, chunk=1):
        pass
    assert tracer.events == [Event(3, 1, 2, "F", 2, 1)]


def test_chrome_trace_structure(tmp_path):
    events = simulate(build("1f1b", 2, 2))
    path = tmp_path / "t.json"
    write_chrome_trace(events, path)
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {e["tid"] for e in complete} == {0, 1} and {e["pid"] for e in complete} == {0}
    names = {(e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    f0 = next(e for e in complete if e["name"] == "F0" and e["tid"] == 1)
    assert (f0["ts"], f0["dur"], f0["cat"], f0["args"]) == (1e6, 1e6, "F", {"mb": 0, "chunk": 0})
    assert all(e["dur"] > 0 for e in complete)
    assert chrome_trace(events, to_us=1.0)["traceEvents"][-1]["dur"] < 10


def test_empty_and_unknown_inputs():
    assert text_gantt([]) == ""
    with pytest.raises(ValueError):
        bubble_fraction([])


def test_text_gantt_folds_to_a_width_with_a_legend():
    events = simulate(build("1f1b", 4, 8))  # 33 time steps, 3 characters a cell
    whole = text_gantt(events)
    folded = text_gantt(events, width=60, legend=True)
    assert max(map(len, whole.splitlines())) > 60
    assert max(map(len, folded.splitlines())) <= 60
    heads = [line.split("time steps ")[1] for line in folded.splitlines() if "time steps" in line]
    assert heads == ["0-16 of 33", "17-32 of 33"]
    cells = {}  # every rank's row, unfolded again, is the unfolded chart's row
    for line in folded.splitlines():
        if line.startswith("rank "):
            name, _, rest = line.partition(" | ")
            cells.setdefault(name, []).extend(rest.split())
    assert [" ".join(c) for c in cells.values()] == [
        " ".join(line.partition(" | ")[2].split()) for line in whole.splitlines()]
    assert "B backward" in folded and "W weight gradient" in folded
    assert text_gantt(events, width=1000) == whole  # wide enough: not folded


def test_chrome_trace_names_chunks():
    names = {e["name"] for e in chrome_trace(simulate(build("interleaved", 2, 2)))["traceEvents"]
             if e["ph"] == "X"}
    assert {"F0.c0", "F0.c1", "B1.c1"} <= names and "F0" not in names
    assert "F0" in {e["name"] for e in chrome_trace(simulate(build("gpipe", 2, 2)))["traceEvents"]}
