"""The ``minipar`` command: its subcommands are registered and ``lessons`` lists every lesson."""
import pathlib

import pytest

from minipar.cli import SUBCOMMANDS, build_parser, main

LESSONS = sorted(p.name for p in (pathlib.Path(__file__).parent.parent / "lessons").glob("[0-9]*.py"))


def test_every_subcommand_builds():
    parser = build_parser()
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit):  # --help exits 0 after printing
            parser.parse_args([name, "--help"])


def test_lessons_lists_each_lesson_with_its_run_line(capsys):
    assert main(["lessons"]) == 0
    out = capsys.readouterr().out
    assert LESSONS, "the lessons folder is empty"
    for name in LESSONS:
        assert name in out
    assert "$ mpiexec -n 4 python lessons/04_allreduce.py\n" in out


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 0
    assert "lessons" in capsys.readouterr().out
