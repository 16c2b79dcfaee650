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


def drawn_figures(monkeypatch):
    """The Figures ``--png`` saves, kept for a look at their legend and frames."""
    import minipar.figures
    kept, save = [], minipar.figures.save
    monkeypatch.setattr(minipar.figures, "save", lambda fig, path: (kept.append(fig), save(fig, path))[1])
    return kept


def test_dualpipev_draws_its_pairs_as_text_and_png(capsys, tmp_path, monkeypatch):
    """DualPipeV as ZB-V is drawn: the text chart, its figures and a PNG, written and named;
    each F&B pair's halves side by side in the text and framed in the PNG, BW in both legends."""
    pytest.importorskip("matplotlib")
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.actions import FB
    monkeypatch.setenv("COLUMNS", "400")  # one line per rank: the pairs read along it
    figures = drawn_figures(monkeypatch)
    png = tmp_path / "dualpipev.png"
    assert main(["schedule", "--schedule", "dualpipev", "--stages", "4", "--microbatches", "8",
                 "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dualpipev: p=4 ranks, m=8 micro-batches, v=2 chunks\n")
    assert "bubble: theory (p-1)/(3m+p-1) = 3/27 = 0.1111, simulated 0.1111" in out
    assert "peak in-flight micro-batch chunks (each 1/2) per rank: 9 9 9 9" in out
    assert f"wrote {png}" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert "BW backward with its weight gradient" in out
    pairs = [[a.pair for a in acts if a.kind == FB] for acts in build("dualpipev", 4, 8).actions]
    assert ("rank 0's first: F7a BW3b), per rank: "
            + " ".join(str(len(p)) for p in pairs)) in out.replace("\n  ", " ")
    rows = {line.split(" | ")[0]: line.split(" | ")[1].split() for line in out.splitlines()
            if line.startswith("rank ")}
    for r, mine in enumerate(pairs):  # a pair: its F's cell, then at once its BW's
        cells = rows[f"rank {r}"]
        seen = [(cells[i], cells[i + 1]) for i in range(len(cells) - 1)]
        for f, b in mine:
            assert (f.kind, b.kind) == ("F", "BW")
            halves = (f"F{f.mb}{'ab'[f.chunk]}", f"BW{b.mb}{'ab'[b.chunk]}")
            assert halves in seen, (r, halves)
    (fig,) = figures
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "BW whole backward (B + W)" in legend
    assert "F&B: a forward paired\nwith a backward" in legend
    frames = sum(len(c.get_paths()) for c in ax.collections if c.get_zorder() == 4)
    assert frames == sum(map(len, pairs))
    # zb-v, drawn alike, has neither: BW and F&B are named only where a schedule runs them
    assert main(["schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8",
                 "--png", str(tmp_path / "zbv.png")]) == 0
    out = capsys.readouterr().out
    assert "BW" not in out and "F&B" not in out
    legend = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert not any(text.startswith(("BW", "F&B")) for text in legend)


def test_dualpipev_refusals_name_the_options(capsys):
    for args, text in [(["--microbatches", "7"], "argument --microbatches: dualpipev needs at "
                        "least as many micro-batches as stages, m >= 2p"),
                       (["--microbatches", "8", "--chunks", "3"],
                        "argument --chunks: dualpipev holds exactly two chunks per rank")]:
        with pytest.raises(SystemExit) as exit_:
            main(["schedule", "--schedule", "dualpipev", "--stages", "4", *args])
        assert exit_.value.code == 2 and text in capsys.readouterr().err
