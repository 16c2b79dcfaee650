"""``minipar lesson NAME [-n N] [-- ARGS]``: run one lesson with the right launcher flags.

    minipar lesson 4                   mpiexec -n 4 python lessons/04_allreduce.py
    minipar lesson allreduce -n 2      the same lesson on 2 ranks
    minipar lesson 08 -- --quick       arguments after -- go to the lesson

NAME is a lesson number (``4``, ``04``) or part of its name. N defaults to the count on the
lesson's own run line (its docstring); a lesson whose run line is ``python ...`` runs as one plain
process unless ``-n`` is given; an ``-n`` the lesson refuses is refused before launch. The launch
goes through minipar.testing.launch_command (the launcher profile: ``$MINIPAR_MPIEXEC``,
``$MINIPAR_MPIEXEC_ARGS``, Open MPI's oversubscription and root flags), with one BLAS thread per
rank; the exit status is the lesson's own. On a terminal the ranks are told so (progress bars,
text charts at its width), since mpiexec gives them pipes.
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys

from minipar.cli.args import UsageError, positive_int
from minipar.cli.lessons import asked_counts, command, lessons, rank_counts
from minipar.console import terminal_env


def add_arguments(parser):
    parser.add_argument("name", metavar="NAME", help="lesson number (4, 04) or part of its name")
    parser.add_argument("-n", "--nprocs", type=positive_int, default=None,
                        help="ranks to launch (default: the lesson's own run line)")
    parser.add_argument("lesson_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                        help="arguments for the lesson (e.g. -- --quick); NAME --help shows "
                             "the lesson's own help")


def split_rest(rest, nprocs):
    """(nprocs, lesson arguments) from what follows NAME: argparse hands ``-n N`` there to the
    remainder (``NAME -n 4 -- --quick``), so a leading ``-n N`` and one ``--`` are taken here."""
    rest = list(rest)
    while rest and (rest[0] in ("-n", "--nprocs") or rest[0].startswith("--nprocs=")):
        flag = rest.pop(0)
        value = flag.split("=", 1)[1] if "=" in flag else (rest.pop(0) if rest else "")
        try:
            nprocs = positive_int(value)
        except Exception as err:
            raise UsageError(f"argument -n/--nprocs: {err}") from None
    if rest[:1] == ["--"]:
        rest.pop(0)
    return nprocs, rest


def find(name, found=None):
    """The (path, summary, run line) of the one lesson NAME names, or UsageError listing them."""
    found = lessons() if found is None else found
    key = name.strip().lower()
    if key.isdigit():
        matches = [item for item in found if int(item[0].name[:2]) == int(key)]
    else:
        matches = [item for item in found if key in item[0].stem.lower()]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(item[0].stem for item in found) or "none found"
    what = "matches several lessons" if matches else "is not a lesson"
    raise UsageError(f"argument NAME: {name!r} {what}; choose from: {names}")


def default_ranks(run_line):
    """The N of ``mpiexec -n N ...`` on a lesson's run line; None for ``python ...``."""
    match = re.search(r"^mpiexec\b.*?\s-n\s+(\d+)", run_line)
    return int(match.group(1)) if match else None


def check_ranks(path, run_line, nprocs, lesson_args=()):
    """UsageError when the lesson's own ``mpi_world`` would refuse ``nprocs`` ranks: said before
    anything is launched (``-n 1000`` would start 1000 processes only to hear the lesson refuse).
    Counts computed from the lesson's arguments are asked of the lesson with those arguments."""
    if nprocs is None:
        return
    counts = rank_counts(path) or asked_counts(path, lesson_args, lesson_env())
    if counts is None:
        return
    ranks, at_least = counts

    def runs_on(n):
        return n in ranks if ranks else n >= at_least

    if runs_on(nprocs):
        return
    if ranks:
        what = ", ".join(map(str, ranks[:-1])) + (" or " if len(ranks) > 1 else "") + str(ranks[-1])
    else:
        what = f"{at_least} or more"
    what += " rank" if ranks == (1,) else " ranks"
    line = f"minipar lesson {path.name[:2]}"
    usual = default_ranks(run_line)  # the count to suggest: the run line's, when it is one
    if usual is not None or ranks != (1,):  # a lesson without MPI needs no -n
        line += f" -n {usual if usual and runs_on(usual) else (ranks or [at_least])[0]}"
    if lesson_args:  # the counts may depend on them (lesson 11's --tp, --pp)
        line += " -- " + shlex.join(lesson_args)
    raise UsageError(f"argument -n/--nprocs: lesson {path.name[:2]} runs on {what}, not "
                     f"{nprocs}: {line}")


def build_command(path, run_line, nprocs, lesson_args):
    """The argv that runs the lesson: plain ``python`` or the launcher profile."""
    from minipar.testing import launch_command

    program = [sys.executable, str(path), *lesson_args]
    nprocs = nprocs or default_ranks(run_line)
    return program if nprocs is None else launch_command(nprocs, *program)


def lesson_env():
    """The environment a lesson runs in: one BLAS thread per rank, this minipar first on the
    path, and the terminal's width when there is one."""
    from minipar.testing import RANK_ENV

    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in RANK_ENV.items()}}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update(terminal_env(env))
    return env


def run(args):
    path, _, run_line = find(args.name)
    nprocs, lesson_args = split_rest(args.lesson_args, args.nprocs)
    check_ranks(path, run_line, nprocs, lesson_args)
    try:
        argv = build_command(path, run_line, nprocs, lesson_args)
    except RuntimeError as err:  # no mpiexec
        print(f"minipar lesson: {err}", file=sys.stderr)
        return 1
    env = lesson_env()
    print("$ " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as err:
        print(f"minipar lesson: cannot start {argv[0]}: {err} (minipar doctor checks the setup)",
              file=sys.stderr)
        return 1
    try:
        status = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        status = proc.wait()
    return 128 - status if status < 0 else status
