"""The benchmarks' pictures: each figure drawn from the rows the benchmark measured, checked
through matplotlib's own objects (title, axis labels, legend entries, lines and bars), and each
``--plot`` run end to end at a small size: the file is written, its path printed after the
output, which is otherwise what it was. Without matplotlib, ``--plot`` says how to get it.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from minipar import bench, figures
from minipar.testing import RANK_ENV, run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZES = [1024, 65536]
TABLE_HEADER = (f"#{'bytes':>10s} {'algorithm':>18s} {'time_us':>10s} {'algbw':>7s} "
                f"{'busbw':>7s} {'vs_mpi':>7s} {'model_us':>10s} {'meas/mod':>8s} {'wrong':>5s}")


def run(command, timeout=120):
    """(exit status, stdout, stderr) of a command run from the repository, as a student's shell."""
    env = {**os.environ, **RANK_ENV, "PYTHONPATH": str(ROOT)}
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    return done.returncode, done.stdout, done.stderr


def script(name):
    """A benchmark script's module (the scripts are files, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("script_" + name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_bench_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(figures, "available", lambda: False)
    assert bench.plot([], 2, str(tmp_path / "b.png"), sys.stdout) is None
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == figures.MISSING
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("name", ["bench_pipeline", "bench_dp", "bench_autograd"])
def test_scripts_plot_without_matplotlib_says_how_to_get_it(name, monkeypatch, capsys, tmp_path):
    """The scripts draw after their numbers are printed; without matplotlib, one line."""
    module = script(name)
    monkeypatch.setattr(figures, "available", lambda: False)
    assert not module.draw(str(tmp_path), {})
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == figures.MISSING and not os.listdir(tmp_path)


@pytest.mark.mpi
def test_minipar_bench_plot_writes_the_figure_after_the_unchanged_table(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "busbw.png"
    status, out, err = run([sys.executable, "-m", "minipar.cli", "bench", "allreduce", "-n", "2",
                            "--sizes", ",".join(map(str, SIZES)), "--algorithms", "ring",
                            "--plot", str(target)])
    assert status == 0, err
    lines = out.splitlines()
    assert lines[-1] == f"figure: {target}"
    assert target.stat().st_size > 10_000 and target.read_bytes()[:4] == b"\x89PNG"
    assert TABLE_HEADER in lines
    after = lines[lines.index(TABLE_HEADER) + 1:-1]
    rows = [line.split() for line in after if not line.startswith("#")]
    assert [(int(r[0]), r[1], len(r)) for r in rows] == [
        (1024, "mpi", 9), (1024, "ring", 9), (65536, "mpi", 9), (65536, "ring", 9)]
    assert after[-1].startswith("# measured / model from 64KiB up: held out -; table ")


@pytest.mark.mpi
def test_busbw_chart_of_the_rows_and_the_script_plot_dir(tmp_path):
    """scripts/bench_allreduce.py --json --plot DIR: standard output is the JSON document, the
    figure's path goes to standard error; the chart drawn from the document's rows has a line
    per algorithm and one for the model's prediction of each."""
    pytest.importorskip("matplotlib")
    status, out, err = run([sys.executable, "scripts/bench_allreduce.py", "-n", "2", "--sizes",
                            ",".join(map(str, SIZES)), "--algorithms", "ring,recursive_doubling",
                            "--json", "--plot", str(tmp_path)])
    assert status == 0, err
    rows = json.loads(out)["rows"]  # the whole of standard output is the document
    target = tmp_path / "allreduce_busbw.png"
    assert f"figure: {target}" in err.splitlines() and target.exists()

    ax = figures.busbw_chart(rows, 2, title="all-reduce on 2 ranks").axes[0]
    assert ax.get_title() == "all-reduce on 2 ranks"
    assert ax.get_xlabel() == "message size (bytes)" and ax.get_ylabel() == "bus bandwidth (GB/s)"
    assert legend(ax) == ["mpi (MPI's own)", "ring", "ring model", "recursive_doubling",
                          "recursive_doubling model"]
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["ring"].get_xdata()) == SIZES
    assert list(lines["ring"].get_ydata()) == [r["busbw_GBps"] for r in rows
                                               if r["algorithm"] == "ring"]
    assert lines["mpi (MPI's own)"].get_color() == "black"
    assert lines["ring model"].get_linestyle() == "--"



@pytest.mark.mpi
def test_pipeline_figures_of_a_measured_run():
    """bench_pipeline.py's three figures from its own measurement at a tiny unit: the bubble of
    each schedule against m beside its theory, the K x M grid, and the 1F1B step's timeline,
    one bar per F, B and optimizer step on each rank's row."""
    pytest.importorskip("matplotlib")
    pipeline = script("bench_pipeline")
    target = str(ROOT / "scripts" / "bench_pipeline.py")
    rows = run_on_ranks(f"{target}:measure_schedules", 4, args=(0.002, 4, [4, 8], 1),
                        heavy_yield=True, timeout=180)[0]
    grid = {2: dict(run_on_ranks(f"{target}:measure_throughput", 2, args=(0.004, 2, [1, 4], 1),
                                 heavy_yield=True, timeout=120)[0])}
    charts = pipeline.charts(4, 8, 0.002, rows, grid)
    assert list(charts) == ["pipeline_bubble", "pipeline_speedup", "pipeline_1f1b"]

    ax = charts["pipeline_bubble"].axes[0]
    assert ax.get_xlabel() == "micro-batches m" and ax.get_ylabel() == "bubble (idle fraction)"
    assert "measured" in ax.get_title()
    assert legend(ax) == [f"{s} {kind}" for s in ("gpipe", "1f1b", "interleaved v=2", "zb-h1",
                                                   "zb-v", "zb-interleaved v=2")
                          for kind in ("theory", "measured")]
    measured = {line.get_label(): line for line in ax.lines}["1f1b measured"]
    assert list(measured.get_xdata()) == [4, 8]

    ax = charts["pipeline_speedup"].axes[0]
    assert ax.get_ylabel() == "speed-up over one device"
    assert legend(ax) == ["K=2 theory", "K=2 measured"]

    ax = charts["pipeline_1f1b"].axes[0]
    assert ax.get_title().startswith("1F1B measured, p = 4, m = 8") and "theory" in ax.get_title()
    assert ax.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert legend(ax)[:3] == ["F forward", "B backward", "optimizer step"]
    per_rank = [round(bar.get_y() + bar.get_height() / 2) for bar in ax.patches]
    assert [per_rank.count(r) for r in range(4)] == [8 + 8 + 1] * 4  # F and B of 8, the step


@pytest.mark.mpi
def test_dp_throughput_bars_and_spread_lines(tmp_path, capsys):
    """bench_dp.py on 1 and 2 ranks at a tiny size: a bar per run and rank count, each the
    throughput in the report's table; the hooks' rows on 2 ranks with the bytes each sends;
    with two launches the spread lines come after the report's existing lines; --plot's path
    printed last."""
    pytest.importorskip("matplotlib")
    import argparse
    dp = script("bench_dp")
    args = argparse.Namespace(steps=1, rounds=1, batches="16", algorithm="ring", no_torch=True,
                              plot=str(tmp_path))
    defaults, sent = {}, {}
    launches = {n: dp.launch(n, args, defaults, sent)[16] for n in (1, 2)}
    hooks = ["fp16 hook", "PowerSGD r1", "top-k 1%", "signs"]
    assert list(launches[2]) == ["no comm", "overlap on", "overlap off", *hooks]
    assert set(sent[1].values()) == {0} and sent[2]["no comm"] == 0  # nothing to send
    params = sum(a * b + b for a, b in zip(dp.SIZES, dp.SIZES[1:]))
    assert sent[2]["overlap on"] == sent[2]["overlap off"] == 4 * params  # ring, 2 ranks: n s
    assert 2 * sent[2]["fp16 hook"] == sent[2]["overlap on"]
    assert all(sent[2][h] < 0.05 * sent[2]["overlap on"] for h in hooks[1:])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert [defaults[n][0] for n in (1, 2)] == [cores > 1, cores > 2]  # DDP's overlap="auto"
    repeats = [launches, launches]
    ax = dp.throughput_chart(16, repeats).axes[0]
    assert ax.get_ylabel() == "throughput (samples/s)" and "16 samples per rank" in ax.get_title()
    assert legend(ax) == ["1 rank", "2 ranks"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["no comm", "overlap on", "overlap off"]
    heights = [round(bar.get_height(), 6) for bar in ax.patches]
    assert heights == [round(16 * n / launches[n][name], 6)
                       for n in (1, 2) for name in ("no comm", "overlap on", "overlap off")]

    capsys.readouterr()
    dp.report(16, repeats, args, [0.0, 0.0], sent[2])
    dp.draw(str(tmp_path), {16: repeats})
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("no comm") and lines[10].startswith("hooks on 2 ranks")
    assert [line.split()[-1] for line in lines[3:10]] == [str(sent[2][name]) for name in
                                                          launches[2]]
    assert lines[6].split()[2:4] == ["-", "-"]  # a hook on 1 rank: nothing to compress
    assert lines[11].startswith("2-rank / 1-rank throughput")
    assert lines[-9] == "ms/step over the 2 launches, median [min-max]:"
    assert lines[-8].split()[:4] == ["no", "comm", "1", "rank(s)"]
    assert lines[-2].split()[:3] == ["signs", "2", "rank(s)"]  # a hook: 2 ranks only
    assert lines[-1] == f"figure: {tmp_path / 'dp_throughput_b16.png'}"
    assert (tmp_path / "dp_throughput_b16.png").exists()


def test_autograd_plot_after_the_table_and_the_ratio_chart(tmp_path, capsys):
    """bench_autograd.py --plot DIR at 3 repeats: the table as it was, the spread lines, then
    the figure's path; and the ratio chart of a run with PyTorch, beside each goal."""
    pytest.importorskip("matplotlib")
    autograd = script("bench_autograd")
    autograd.main(["--repeats", "3", "--plot", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["workload", "minipar", "ms", "PyTorch", "ms", "ratio", "goal"]
    assert [line.split()[0] for line in lines[3:5]] == ["gpt-block", "tiny-mlp"]
    assert lines[5] == "ms per step over the 3 steps, median [min-max]:"
    assert lines[6].split()[:2] == ["gpt-block", "minipar"] and "[" in lines[6]
    assert "issue 27 goals, measured in this run:" in lines
    i = lines.index("where minipar's step went, median ms (each phase timed apart):")
    assert [line.split()[:2] for line in lines[i + 1:i + 3]] == [["gpt-block", "forward"],
                                                                ["tiny-mlp", "forward"]]
    figure_lines = [line for line in lines if line.startswith("figure: ")]
    assert lines[-len(figure_lines):] == figure_lines
    assert f"figure: {tmp_path / 'autograd_times.png'}" in figure_lines
    assert all(os.path.exists(line[len("figure: "):]) for line in figure_lines)

    results = {"gpt-block": {"minipar": [12.0, 13.0, 14.0], "PyTorch": [10.0, 10.0, 11.0]},
               "tiny-mlp": {"minipar": [0.6, 0.7, 0.8], "PyTorch": [0.5, 0.5, 0.5]}}
    charts = autograd.charts(results)
    ax = charts["autograd_times"].axes[0]
    assert legend(ax) == ["minipar", "PyTorch"] and ax.get_yscale() == "log"
    assert [round(bar.get_height(), 6) for bar in ax.patches] == [13.0, 0.7, 10.0, 0.5]
    ax = charts["autograd_ratio"].axes[0]
    assert ax.get_ylabel() == "minipar / PyTorch (step time)"
    assert legend(ax) == ["minipar / PyTorch", "goal (at most)"]
    assert [round(bar.get_height(), 6) for bar in ax.patches] == [1.3, 1.4, 1.2, 2.0]
