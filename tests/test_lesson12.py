"""Lesson 12 runs end to end on 2 ranks (--quick) and shows the numbers it promises; --plot
writes its two figures."""
import ast
import pathlib
import re

import pytest

from test_lessons_pass import passed

LESSON = pathlib.Path(__file__).resolve().parent.parent / "lessons" / "12_expert_parallel.py"


def test_minipar_lessons_lists_it_with_its_run_line():
    from minipar.cli.lessons import command

    doc = ast.get_docstring(ast.parse(LESSON.read_text()))
    assert doc.splitlines()[0].startswith("Lesson 12: expert parallelism")
    assert command(doc, LESSON.name) == "mpiexec -n 2 python lessons/12_expert_parallel.py"


@pytest.mark.mpi
def test_quick_run_on_two_ranks():
    out = passed(LESSON.name, 2)  # the shared run: exit 0 and a PASS line
    assert "rank 0 holds experts [0, 1], rank 1 holds experts [2, 3]" in out
    assert re.search(r"token \d+ -> e\d \(gate [0-9.]+, dropped\)", out)  # a drop is shown
    assert "from rank 1" in out and "on rank 1" in out  # the counts matrix
    sent, predicted = re.search(r"rank 0 sent ([\d,]+) B \(predicted ([\d,]+) B\)", out).groups()
    assert sent == predicted
    diffs = [float(d) for d in re.findall(r"max \|diff\| = ([0-9.e+-]+)", out)]
    assert len(diffs) == 3 and max(diffs) < 1e-10  # output, dx, gradients vs serial
    aux = {c: (float(a), float(b)) for c, a, b in
           re.findall(r"aux_coeff=([0-9.]+): .* l_aux ([0-9.]+) -> ([0-9.]+)", out)}
    assert aux["1.0"][1] < aux["1.0"][0] and aux["1.0"][1] < aux["0.0"][1]


@pytest.mark.mpi
def test_plot_writes_both_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from test_lessons_plots import figures_named, run

    done = run(LESSON.name, 2, tmp_path / "figs")
    names = ["12_tokens_per_expert.png", "12_balance.png"]
    assert figures_named(done.stdout) == [str(tmp_path / "figs" / n) for n in names]
    for n in names:
        assert (tmp_path / "figs" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
