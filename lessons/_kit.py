"""What every lesson shares: its command line, the rank-count check, narration, the PASS line.

    from _kit import arguments, finish, mpi_world, say

    args = arguments(__doc__, ("--steps", 400, "training steps"), quick="a few steps")
    world = mpi_world(__doc__, ranks=(2, 4))   # a wrong mpiexec -n: one line, exit status 2
    say("Part 1. ...", "a second line")        # printed by rank 0 only
    return finish(f"loss {loss:.3f} < 1.6", ok=loss < 1.6)   # PASS: ... (FAIL: ..., status 1)

A lesson imports this file as ``from _kit import ...``: Python puts a script's own folder first
on sys.path wherever it is started from, and minipar.testing.run_on_ranks does the same.
"""
import argparse
import os
import re
import shlex
import sys

from minipar.cli.lessons import command  # the run-line parser of 'minipar lessons'

_rank = 0  # this process's rank once mpi_world() has run; a lesson without MPI is rank 0


def arguments(doc, *options, quick="a smoke run of a few seconds", argv=None):
    """The parsed command line: the docstring's first line as the description, the lesson's own
    ``(flag, default, help)`` options (typed like the default, a string when it is None), and
    ``--quick`` unless ``quick`` is None."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, default, *help_text in options:
        parser.add_argument(flag, type=str if default is None else type(default), default=default,
                            help=help_text[0] if help_text else None)
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)
    return parser.parse_args(argv)


def mpi_world(doc, ranks=None, at_least=1):
    """The world communicator, when its size is one of ``ranks`` (or at least ``at_least``).

    Otherwise rank 0 prints one line naming the rank counts the lesson runs on and the command
    to run (the docstring's, at an accepted count, with this run's arguments), and every rank
    exits with status 2, argparse's status for a wrong command line.
    """
    global _rank
    from minipar import comm  # here, so that the lessons without MPI never load it

    def runs_on(n):
        return n in ranks if ranks else n >= at_least

    world = comm.world()
    _rank = world.rank
    if runs_on(world.size):
        return world
    if world.rank == 0:
        print(f"{os.path.basename(sys.argv[0])} runs on {_counts(ranks, at_least)}, not "
              f"{world.size}: {_command(doc, runs_on, (ranks or [at_least])[0])}",
              file=sys.stderr, flush=True)
    raise SystemExit(2)


def _counts(ranks, at_least):
    """'exactly 2 ranks', '2 or 4 ranks', '1, 2, 3, 4, 6 or 8 ranks', '2 or more ranks'."""
    if not ranks:
        return f"{at_least} or more ranks"
    if len(ranks) == 1:
        return f"exactly {ranks[0]} ranks"
    return f"{', '.join(map(str, ranks[:-1]))} or {ranks[-1]} ranks"


def _command(doc, runs_on, fallback):
    """The docstring's run line with this run's arguments; its ``-n`` set to ``fallback`` when
    the lesson does not run on the docstring's count (lesson 11 with other --tp/--pp)."""
    line = command(doc, os.path.basename(sys.argv[0]))
    n = re.search(r"-n (\d+)", line)
    if n and not runs_on(int(n.group(1))):
        line = line.replace(n.group(0), f"-n {fallback}", 1)
    return shlex.join([*shlex.split(line), *sys.argv[1:]])


def say(*lines):
    """Print each argument on a line of its own, from rank 0 only (every rank runs the lesson)."""
    if _rank == 0:
        print(*lines, sep="\n", flush=True)


def finish(claim, ok=True):
    """The closing line, ``PASS: claim`` (or ``FAIL: claim``) from rank 0; the exit status."""
    say(f"{'PASS' if ok else 'FAIL'}: {claim}")
    return 0 if ok else 1
