"""The terminal helpers: spread of repeated runs, the load note, progress only where it is wanted."""
import io

import pytest

from minipar import console


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_spread_is_median_min_max():
    assert console.spread([0.41, 0.38, 0.45]) == "0.410 [0.380-0.450]"
    assert console.spread([2.0], "{:.1f}") == "2.0"
    assert console.spread([3, 1, 2, 10], "{:.0f}") == "2 [1-10]"  # median of an even count: 2.5 -> 2
    with pytest.raises(ValueError):
        console.spread([])


def test_load_note_only_when_the_load_exceeds_the_cores():
    assert console.load_note(cores=2, load=1.9) is None
    note = console.load_note(cores=2, load=3.5)
    assert "load average 3.5 on 2 cores" in note and "noisy" in note


def test_progress_is_quiet_off_a_terminal_and_off_rank_0(monkeypatch):
    monkeypatch.delenv("MINIPAR_PROGRESS", raising=False)
    items = [1, 2, 3]
    assert console.progress(items, "x", stream=io.StringIO()) is items
    assert console.progress(items, "x", rank=1, stream=Terminal()) is items
    monkeypatch.setenv("MINIPAR_PROGRESS", "0")
    assert console.progress(items, "x", stream=Terminal()) is items


def test_progress_on_a_terminal_with_and_without_tqdm(monkeypatch):
    monkeypatch.delenv("MINIPAR_PROGRESS", raising=False)
    pytest.importorskip("tqdm")
    out = Terminal()
    assert list(console.progress(range(5), "training", stream=out)) == list(range(5))
    assert "training" in out.getvalue()
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # tqdm missing
    out = Terminal()
    ticks = iter(range(100))
    monkeypatch.setattr(console.time, "perf_counter", lambda: next(ticks))
    assert list(console.progress(range(3), "fit", stream=out)) == [0, 1, 2]
    assert "fit: 1/3" in out.getvalue() and out.getvalue().endswith("\r")


def test_progress_forced_on_for_a_pipe(monkeypatch):
    monkeypatch.setenv("MINIPAR_PROGRESS", "1")
    out = io.StringIO()
    assert list(console.progress(range(2), "sweep", stream=out)) == [0, 1]
