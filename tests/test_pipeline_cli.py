"""``minipar schedule``: the drawing, the figures and the --json keys."""
import json
import time

import pytest

from minipar.cli import main
from minipar.parallel.pipeline import BUILDERS


@pytest.mark.parametrize("name", list(BUILDERS))
def test_json_figures_for_p4_m8(name, capsys):
    assert main(["schedule", "--schedule", name, "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"bubble_theory", "bubble_simulated", "peak_inflight"} <= set(out)
    # with the textbook's costs the simulator's timeline is the formula's, to rounding
    assert out["bubble_simulated"] == pytest.approx(out["bubble_theory"], abs=1e-12)
    assert len(out["peak_inflight"]) == 4


@pytest.mark.parametrize("name", list(BUILDERS))
def test_eight_stages_draw_and_write_files(name, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    args = ["schedule", "--schedule", name, "--stages", "8", "--microbatches", "16",
            "--trace", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("\nrank 7 ") >= 1 and out.count("\nrank ") == 8 * out.count("\nrank 7 ")
    assert max(map(len, out.splitlines())) <= 100  # folded to the terminal's width
    assert "bubble: theory" in out and "simulated" in out
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_text_output_and_clear_errors(capsys):
    assert main(["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "3/27" in out and "peak in-flight micro-batches per rank: 4 3 2 1" in out
    with pytest.raises(SystemExit) as exit_:  # an argparse error: status 2, the line on stderr
        main(["schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6"])
    assert exit_.value.code == 2
    assert "multiple of p=4" in capsys.readouterr().err
    assert main(["schedule", "--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--remat",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_inflight"] == [1, 1]


def test_sixty_four_stages_by_512_micro_batches_answer_in_seconds(capsys):
    """Megatron-LM's 64-stage pipeline at 512 micro-batches: the bound is the work (stages ×
    micro-batches × chunks), not the size of either; built, validated and simulated in a few
    seconds (the bound here allows a machine shared by several test runs)."""
    start = time.perf_counter()
    assert main(["schedule", "--schedule", "1f1b", "--stages", "64", "--microbatches", "512",
                 "--json"]) == 0
    assert time.perf_counter() - start < 60
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_theory"] == pytest.approx(63 / 575)
    assert out["bubble_simulated"] == pytest.approx(63 / 575)


def test_a_text_chart_too_long_to_read_is_left_out_and_said(capsys):
    """naive at 32 × 128 runs each micro-batch through all stages alone: 12288 time steps, too
    many cells to print; the figures are still printed."""
    assert main(["schedule", "--schedule", "naive", "--stages", "32", "--microbatches", "128"]) == 0
    out = capsys.readouterr().out
    assert ("(the text chart, 32 ranks × 12288 time steps, is left out: --png or --trace "
            "draws it)") in out
    assert "\nrank 0 |" not in out and "bubble: theory (p-1)/p = 31/32" in out
