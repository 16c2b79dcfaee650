"""``--plot DIR`` on the lessons: each figure is written there and named on a ``figure:`` line;
without matplotlib the lesson still passes and says once how to get the pictures."""
import subprocess

import pytest

from minipar.figures import MISSING
from test_lessons_pass import ROOT, command, lesson_env


def run(name, nprocs, directory, pythonpath=()):
    env = lesson_env(pythonpath)  # the device this run was given
    done = subprocess.run(command(name, nprocs, ("--quick", "--plot", str(directory))),
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("PASS: "), done.stdout
    return done


def figures_named(out):
    return [line.split("figure: ", 1)[1] for line in out.splitlines()
            if line.startswith("figure: ")]


@pytest.mark.mpi
@pytest.mark.parametrize("name, nprocs, expected", [
    ("02_checkpointing.py", 1, ["02_memory.png", "02_step_time.png"]),
    ("06_zero.py", 2, ["06_memory.png", "06_loss.png"]),
    ("13_mixed_precision.py", 2, ["13_loss.png", "13_gradients.png"]),
    ("14_long_context.py", 4, ["14_memory.png", "14_ring.png", "14_work.png"]),
    ("15_compressed_communication.py", 2, ["15_loss.png", "15_loss_bytes.png"]),
    ("16_planning.py", 4, ["16_plan.png"]),
    ("17_fp8.py", 2, ["17_loss.png", "17_outliers.png"]),
])
def test_plot_writes_each_figure_and_names_it(name, nprocs, expected, tmp_path):
    pytest.importorskip("matplotlib")
    done = run(name, nprocs, tmp_path / "figs")  # a folder that does not exist yet
    assert figures_named(done.stdout) == [str(tmp_path / "figs" / f) for f in expected]
    for f in expected:
        assert (tmp_path / "figs" / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert MISSING not in done.stderr


@pytest.mark.mpi
def test_without_matplotlib_the_lesson_passes_and_says_how_to_get_pictures(tmp_path):
    broken = tmp_path / "no_matplotlib" / "matplotlib"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    done = run("02_checkpointing.py", 1, tmp_path / "figs", pythonpath=[broken.parent])
    assert done.stderr.count(MISSING) == 1  # once, although the lesson has two figures
    assert figures_named(done.stdout) == []
    assert not (tmp_path / "figs").exists()
