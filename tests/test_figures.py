"""minipar.figures: each chart built under Agg and read back through matplotlib's own objects
(title, axis labels, legend entries, bars, lines); no pixel comparisons. And without matplotlib:
every command still runs and says how to get the pictures."""
import collections
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minipar import figures
from minipar.cli import main
from minipar.parallel.pipeline import bubble_fraction, bubble_theory, build, simulate, validate
from minipar.parallel.pipeline.timeline import Event, work_events

needs_matplotlib = pytest.mark.skipif(not figures.available(), reason=figures.MISSING)


def legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def colour(patch):
    from matplotlib.colors import to_hex
    return to_hex(patch.get_facecolor())


def png_size(path):
    """(width, height) from the PNG's IHDR chunk."""
    return struct.unpack(">II", open(path, "rb").read()[16:24])


def simulated(name, p, m, chunks=None):
    schedule = validate(build(name, p, m, chunks))
    formula, num, den = bubble_theory(schedule)
    return schedule, simulate(schedule), (formula, num / den)


@needs_matplotlib
def test_schedule_chart_has_one_bar_per_action_on_each_rank(tmp_path):
    _, events, theory = simulated("1f1b", 4, 8)
    fig = figures.schedule_chart(events, 4, title="1f1b p=4 m=8", theory=theory)
    ax = fig.axes[0]
    assert ax.get_title() == "1f1b p=4 m=8 — bubble 0.273, theory (p-1)/(m+p-1) = 0.273"
    assert ax.get_xlabel() == "time (units of one stage forward)"
    assert ax.get_ylabel() == "pipeline stage"
    assert legend(ax) == ["F forward", "B backward", "idle (bubble)"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    bars = sorted((round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_width(), colour(b))
                  for b in ax.patches)
    want = sorted((e.rank, e.start, e.duration, {"F": "#4285f4", "B": "#34a853"}[e.kind])
                  for e in work_events(events))
    assert bars == want  # each action a bar on its rank's row, F blue and B green
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("F0") == 4 and labels.count("B7") == 4  # every bar is wide enough here
    path = figures.save(fig, tmp_path / "deep" / "1f1b.png")
    assert png_size(path)[0] >= 1000


@needs_matplotlib
def test_schedule_chart_colours_and_labels_chunks_and_weight_gradients():
    _, events, theory = simulated("zb-h1", 4, 8)
    ax = figures.schedule_chart(events, title="zb-h1", theory=theory).axes[0]
    assert "W weight gradient" in legend(ax)
    assert sum(colour(b) == "#f4b400" for b in ax.patches) == 4 * 8  # W amber
    assert "\ntheory (p-1)/(3m+p-1)" in ax.get_title()  # the long formula on a line of its own
    _, events, theory = simulated("interleaved", 2, 2)
    ax = figures.schedule_chart(events, theory=theory).axes[0]
    assert {"F0.c1", "B1.c1", "F1.c0"} <= {t.get_text() for t in ax.texts}
    assert "darker: a later chunk" in legend(ax)
    assert len(ax.patches) == len(work_events(events))


@needs_matplotlib
def test_schedule_chart_of_a_measured_run_in_seconds():
    events = [Event(0, 100.0, 100.5, "F", 0), Event(0, 100.5, 101.0, "F", 1),
              Event(1, 100.5, 101.0, "RECV_F", 0), Event(1, 101.0, 101.5, "F", 0),
              Event(1, 101.5, 102.5, "B", 0), Event(0, 102.5, 103.0, "OPT_STEP")]
    ax = figures.schedule_chart(events, 2, title="measured", time_unit="s").axes[0]
    assert ax.get_xlabel() == "time (s)"
    assert ax.get_title() == f"measured — bubble {bubble_fraction(events, 2):.3f}"
    assert sorted(b.get_x() for b in ax.patches) == [0.0, 0.5, 1.0, 1.5, 2.5]  # from the first start
    assert legend(ax) == ["F forward", "B backward", "optimizer step", "idle (bubble)"]
    ms = figures.schedule_chart(events, 2, time_unit="ms").axes[0]
    assert ms.get_xlabel() == "time (ms)" and ms.get_xlim() == (0, 3000.0)


@needs_matplotlib
def test_bubble_chart_simulated_beside_theory():
    points = []
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        for m in (4, 8, 16, 32):
            _, events, (_, theory) = simulated(name, 4, m)
            points.append((name, m, bubble_fraction(events, 4), theory))
    ax = figures.bubble_chart(points, kind="simulated").axes[0]
    assert ax.get_xlabel() == "micro-batches m" and ax.get_ylabel() == "bubble (idle fraction)"
    assert ax.get_title()
    assert legend(ax)[:2] == ["gpipe theory", "gpipe simulated"] and len(legend(ax)) == 8
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["zb-h1 simulated"].get_xdata()) == [4, 8, 16, 32]
    assert lines["1f1b simulated"].get_ydata() == pytest.approx(lines["1f1b theory"].get_ydata())
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [4, 8, 16, 32]
    narrow = figures.bubble_chart([("gpipe", m, None, 3 / (m + 3)) for m in (2, 4, 6)]).axes[0]
    assert narrow.get_xscale() == "linear" and list(narrow.get_xticks()) == [2, 4, 6]  # m whole
    assert ax.get_xscale() == "log"


@needs_matplotlib
def test_speedup_chart_has_a_theory_line_per_stage_count():
    grid = {2: {1: 0.9, 2: 1.2, 4: 1.5, 8: 1.7}, 4: {1: 0.95, 2: 1.5, 4: 2.1, 8: 2.6}}
    ax = figures.speedup_chart(grid).axes[0]
    assert ax.get_xlabel() == "micro-batches M" and ax.get_ylabel() == "speed-up over one device"
    assert legend(ax) == ["K=2 theory", "K=2 measured", "K=4 theory", "K=4 measured"]
    theory = {line.get_label(): line for line in ax.lines}["K=4 theory"]
    for m, s in zip(theory.get_xdata(), theory.get_ydata()):
        assert s == pytest.approx(4 * m / (m + 3))
    assert "K·M/(M+K−1)" in ax.get_title()


@needs_matplotlib
def test_busbw_chart_has_a_line_per_algorithm_and_the_model_dashed():
    rows = [{"bytes": b, "algorithm": a, "busbw_GBps": b / 1e6, "model_us": None if a == "mpi" else 10.0}
            for b in (1024, 4096, 16384, 65536) for a in ("mpi", "ring", "tree")]
    ax = figures.busbw_chart(rows, p=4).axes[0]
    assert ax.get_xlabel() == "message size (bytes)" and ax.get_ylabel() == "bus bandwidth (GB/s)"
    assert legend(ax) == ["mpi (MPI's own)", "ring", "ring model", "tree", "tree model"]
    lines = {line.get_label(): line for line in ax.lines}
    assert lines["mpi (MPI's own)"].get_color() == "black"
    model = lines["ring model"]
    assert model.get_linestyle() == "--" and model.get_color() == lines["ring"].get_color()
    assert model.get_ydata()[0] == pytest.approx(1024 / 10e-6 * 2 * 3 / 4 / 1e9)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "linear" and ax.get_title()
    box = ax.get_legend().get_window_extent(ax.figure.canvas.get_renderer())
    assert box.x0 >= ax.get_window_extent().x1  # beside the data, not on it
    wide = [dict(r, busbw_GBps=r["bytes"] ** 2 / 1e9) for r in rows]  # 4096x from least to most
    assert figures.busbw_chart(wide, p=4).axes[0].get_yscale() == "log"  # small messages show


@needs_matplotlib
def test_loss_chart_draws_the_serial_reference_thick_underneath():
    curves = {"serial": [3.0, 2.0, 1.5], "dp ring": [3.0, 2.01, 1.49], "zero-2": [(0, 3.0), (10, 1.0)]}
    ax = figures.loss_chart(curves, title="loss").axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("loss", "step", "loss")
    assert legend(ax) == ["serial", "dp ring", "zero-2"]
    serial, ring, zero = ax.lines
    assert serial.get_linewidth() > 2 * ring.get_linewidth() and serial.get_zorder() < ring.get_zorder()
    assert list(zero.get_xdata()) == [0, 10]
    # curves that coincide are told apart by their markers, set on different steps
    same = figures.loss_chart({f"zero-{k}": [3.0 - s / 40 for s in range(40)] for k in (1, 2, 3)})
    marks = [line.get_markevery() for line in same.axes[0].lines]
    assert len(set(marks)) == 3 and all(line.get_marker() not in (None, "None", "")
                                        for line in same.axes[0].lines), marks
    short = figures.loss_chart({"serial": [3.0, 2.5, 2.2, 2.0]}).axes[0]
    short.figure.canvas.draw()
    assert all(float(t).is_integer() for t in short.get_xticks())  # no step 0.5


@needs_matplotlib
def test_bar_and_memory_charts_write_their_values():
    ax = figures.bar_chart(["a", "b"], {"x": [1.0, 2.0], "y": [3.0, None]}, title="t", ylabel="s",
                           xlabel="c").axes[0]
    assert len(ax.patches) == 3 and legend(ax) == ["x", "y"]
    assert sorted(t.get_text() for t in ax.texts) == ["1", "2", "3"]
    ax = figures.memory_chart([("zero-1", 3 << 20, 2 << 20), ("zero-3", 1 << 20, None)]).axes[0]
    assert ax.get_ylabel() == "memory per rank (MiB)" and legend(ax) == ["measured", "theory"]
    assert sorted(b.get_height() for b in ax.patches) == [1.0, 2.0, 3.0]
    assert ax.get_title() and ax.get_xlabel()


@needs_matplotlib
def test_magnitude_chart_counts_every_nonzero_entry_and_marks_thresholds():
    values = {"fp32": np.array([0.0, 1e-9, 1e-6, 1e-3, -0.5]), "scaled": np.array([2.0, 4.0])}
    ax = figures.magnitude_chart(values, {"fp16 smallest normal": 2.0**-14}).axes[0]
    assert sum(b.get_height() for b in ax.patches) == 6  # the zero is left out
    assert legend(ax) == ["fp32 (4 nonzero)", "scaled (2 nonzero)", "fp16 smallest normal 6.1e-05"]
    assert ax.get_xscale() == "log" and ax.get_title()


@needs_matplotlib
def test_scaling_chart_marks_the_measured_values_on_the_dashed_formula():
    curves = {"cp = 1": ([64, 128, 256, 1024], [10, 20, 40, 160], [10, 20, 40, 160]),
              "cp = 2": ([64, 128, 256, 1024], [5, 10, 20, 80], None)}
    ax = figures.scaling_chart(curves, xlabel="T", ylabel="bytes", byte_ticks=True).axes[0]
    assert legend(ax) == ["cp = 1 formula", "cp = 1 measured", "cp = 2 measured"]
    formula, measured, alone = ax.lines
    assert formula.get_linestyle() == "--" and measured.get_linestyle() == "None"
    assert measured.get_marker() not in (None, "None", "") and alone.get_linestyle() == "-"
    assert formula.get_color() == measured.get_color() != alone.get_color()
    assert list(measured.get_ydata()) == [10, 20, 40, 160]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")  # 16x both ways
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("T", "bytes") and ax.get_title()
    assert ax.yaxis.get_major_formatter()(2048) == "2K"


@needs_matplotlib
def test_ring_chart_has_a_block_per_rank_step_and_pair_coloured_by_kind():
    from minipar.figures.context import BLOCK_COLOURS
    # cp = 2, balanced: RingLog.steps() of ranks 0 and 1 (tests/test_context_parallel.py)
    steps = [[[(0, 0, "diagonal"), (0, 3, "skipped"), (3, 0, "full"), (3, 3, "diagonal")],
              [(0, 1, "skipped"), (0, 2, "skipped"), (3, 1, "full"), (3, 2, "full")]],
             [[(1, 1, "diagonal"), (1, 2, "skipped"), (2, 1, "full"), (2, 2, "diagonal")],
              [(1, 0, "full"), (1, 3, "skipped"), (2, 0, "full"), (2, 3, "skipped")]]]
    ax = figures.ring_chart(steps, [(0, 3), (1, 2)], title="ring").axes[0]
    assert len(ax.patches) == 16 and ax.get_title() == "ring"
    texts = {t.get_text(): t for t in ax.texts}
    assert sorted(texts) == sorted(f"q{i}·k{j}" for rows in steps for blocks in rows
                                   for i, j, _ in blocks)
    # each block in its rank's row and its step's column: (rank, step, colour) -> blocks
    kinds = collections.Counter((round(p.get_y() + p.get_height() / 2),
                                 round(p.get_x() + p.get_width() / 2), colour(p))
                                for p in ax.patches)
    assert kinds[0, 1, BLOCK_COLOURS["skipped"]] == 2 and kinds[1, 0, BLOCK_COLOURS["full"]] == 1
    assert kinds[0, 0, BLOCK_COLOURS["diagonal"]] == 2
    assert legend(ax) == ["whole: k chunk before q's", "diagonal: causal mask",
                          "skipped: k chunk after q's"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0\nq chunks 0, 3",
                                                           "rank 1\nq chunks 1, 2"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top


@needs_matplotlib
def test_save_by_suffix_and_the_same_bytes_twice(tmp_path):
    _, events, theory = simulated("gpipe", 2, 2)
    fig = figures.schedule_chart(events, theory=theory)
    first = figures.save(fig, tmp_path / "a.png")
    second = figures.save(figures.schedule_chart(events, theory=theory), tmp_path / "b.png")
    assert open(first, "rb").read() == open(second, "rb").read()  # no date, no version stamp
    assert open(figures.save(fig, tmp_path / "a.svg")).read().lstrip().startswith("<?xml")
    assert figures.figure_path("out", "bubble") == "out/bubble.png"
    assert figures.figure_path("out", "busbw.svg") == "out/busbw.svg"  # its own suffix kept


@needs_matplotlib
def test_schedule_png_option_draws_the_chart(tmp_path, capsys):
    path = tmp_path / "s.png"
    assert main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                 "--png", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert png_size(path)[0] >= 1000


def test_without_matplotlib_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert not figures.available()
    with pytest.raises(figures.FiguresUnavailable, match=r"pip install 'minipar\[plot\]'"):
        figures.require()
    with pytest.raises(figures.FiguresUnavailable):
        figures.schedule_chart(simulate(build("gpipe", 2, 2)))


def test_without_matplotlib_schedule_prints_the_rest_and_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path, trace = tmp_path / "s.png", tmp_path / "t.json"
    status = main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                   "--png", str(path), "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert status == 1  # the file asked for is not there: a script should notice
    assert "bubble: theory" in out and f"wrote {trace}" in out and f"wrote {path}" not in out
    assert err == f"minipar schedule: --png {path} not written: {figures.MISSING}\n"
    assert trace.exists() and not path.exists()


BLOCK = textwrap.dedent("""
    import sys
    sys.modules["matplotlib"] = None  # as if minipar[plot] were not installed
    from minipar.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("args, status", [
    ("schedule --schedule zb-h1 --stages 4 --microbatches 8", 0),
    ("schedule --schedule zb-h1 --stages 4 --microbatches 8 --json --png {tmp}/z.png", 1),
    ("lessons", 0),
    ("groups --world 8 --tp 2 --pp 2", 0),
])
def test_commands_run_without_matplotlib(args, status, tmp_path):
    done = subprocess.run([sys.executable, "-c", BLOCK] + args.format(tmp=tmp_path).split(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr
    if "--png" in args:
        assert "minipar[plot]" in done.stderr and done.stderr.count("\n") == 1
        assert done.stdout.lstrip().startswith("{")  # --json: standard output stays pure JSON


@needs_matplotlib
def test_the_readme_pictures_are_small_wide_and_the_same_each_run(tmp_path):
    import runpy
    script = runpy.run_path(str(figures_script()))
    for out in ("a", "b"):
        script["main"](["--out", str(tmp_path / out)])
    for name in ("schedule-1f1b.png", "bubble.png"):
        data = (tmp_path / "a" / name).read_bytes()
        assert data == (tmp_path / "b" / name).read_bytes()
        assert png_size(tmp_path / "a" / name)[0] >= 1000 and len(data) < 60_000


def figures_script():
    import pathlib
    return pathlib.Path(__file__).resolve().parent.parent / "scripts" / "figures.py"


@needs_matplotlib
def test_lesson06_figures_say_kb_as_its_table_does_and_mark_coinciding_curves(monkeypatch):
    """Lesson 06's table prints bytes per parameter: its memory figure uses the same unit, and
    its loss figure says that the four curves lie on one another."""
    import importlib.util
    import pathlib
    lessons = pathlib.Path(__file__).resolve().parent.parent / "lessons"
    monkeypatch.syspath_prepend(str(lessons))  # the lesson imports its _kit
    spec = importlib.util.spec_from_file_location("lesson06", lessons / "06_zero.py")
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    drawn = {}
    monkeypatch.setattr(lesson, "figure", lambda d, name, draw: drawn.update({name: draw(figures)}))
    held = {(precision, k, kind): dict(dict.fromkeys(lesson.PARTS, 1000 * k), padded=500)
            for precision in lesson.PRECISIONS for k in (1, 2) for kind in lesson.KINDS}
    curves = {kind: [3.0, 2.5, 2.0] for kind in lesson.KINDS}
    lesson.draw_figures("figs", held, curves, 2)
    assert drawn["06_memory"].axes[0].get_ylabel() == "bytes per parameter, one rank"
    assert "Part 1: bytes per parameter" in pathlib.Path(spec.origin).read_text()
    assert "lie on one another" in drawn["06_loss"].axes[0].get_title()
