"""What every lesson shares: its command line, the rank-count check, narration, the PASS line.

    from _kit import arguments, check, finish, mpi_world, say

    args = arguments(__doc__, ("--steps", 400, "training steps"), quick="a few steps", plot=True)
    world = mpi_world(__doc__, ranks=(2, 4))   # a wrong mpiexec -n: one line, exit status 2
    say("Part 1. ...", "a second line")        # printed by rank 0 only
    for step in progress(range(400), "training"): ...   # a bar on rank 0's terminal only
    check("loss below 1.6", loss < 1.6, expected="< 1.6", measured=f"{loss:.3f}")
    figure(args.plot, "08_bubble", lambda figures: figures.bubble_chart(points))  # --plot DIR
    return finish("the tiny GPT learns")      # PASS: ... (FAIL: ..., status 1)

A lesson imports this file as ``from _kit import ...``: Python puts a script's own folder first
on sys.path wherever it is started from, and minipar.testing.run_on_ranks does the same.
"""
import argparse
import json
import os
import re
import shlex
import sys

_world = None  # the communicator once mpi_world() has run; a lesson without MPI has none
_checks = []  # (claim, ok, expected, measured) recorded by check(), judged by finish()
_said_missing = False  # figure() prints how to get matplotlib once per run


def arguments(doc, *options, quick="a smoke run of a few seconds", argv=None, plot=False):
    """The parsed command line: the docstring's first line as the description, the lesson's own
    ``(flag, default, help)`` options (typed like the default, a string when it is None),
    ``--quick`` unless ``quick`` is None, and ``--plot DIR`` when ``plot`` (see figure())."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, default, *help_text in options:
        parser.add_argument(flag, type=str if default is None else type(default), default=default,
                            help=help_text[0] if help_text else None)
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)
    if plot:
        parser.add_argument("--plot", metavar="DIR", default=None,
                            help="draw this lesson's figures as PNG files into DIR "
                                 "(needs matplotlib: pip install 'minipar[plot]')")
    from minipar.distributed.process_group import launched_rank
    # under mpiexec every rank parses the command line: rank 0's --help is enough
    if (launched_rank() or 0) != 0:
        parser.print_help = lambda file=None: None
    args = parser.parse_args(argv)
    note_other_minipar()
    return args


def note_other_minipar():
    """One line on standard error (rank 0) when the lesson imported a minipar other than the
    one beside its folder, or than the student tree's it was started in: a student tree's
    lesson running an installed reference, or the reference's lesson started inside a student
    tree, would otherwise print PASS over the student's stubs."""
    module = sys.modules.get("minipar")
    if module is None:  # a lesson without minipar
        return None
    from minipar.assignments.tree import RECORD
    from minipar.distributed.process_group import launched_rank
    used = os.path.dirname(os.path.realpath(module.__file__))
    trees = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    if os.path.isfile(RECORD):  # started inside a student tree
        trees.append(os.getcwd())
    for tree in trees:
        beside = os.path.join(tree, "minipar")
        # lessons installed as data files have no package beside them
        if os.path.isfile(os.path.join(beside, "__init__.py")) and \
                os.path.realpath(beside) != used:
            line = (f"note: this lesson runs the minipar in {used}, not the one in {beside}; "
                    f"to run that one: pip install -e {tree} (or PYTHONPATH={tree})")
            if (launched_rank() or 0) == 0:
                print(line, file=sys.stderr, flush=True)
            return line
    return None


def mpi_world(doc, ranks=None, at_least=1):
    """The world communicator, when its size is one of ``ranks`` (or at least ``at_least``);
    rank 0 then prints where the ranks run in one line (``header``).

    Otherwise rank 0 prints one line, "lesson 11 needs 8 ranks (or 4): minipar lesson 11 -n 8",
    naming the count to use (the docstring's when the lesson runs on it), the others it runs on,
    and the command with this run's arguments; the other ranks print nothing, and every rank
    exits with status 2, argparse's status for a wrong command line.
    """
    global _world
    from minipar.cli.lessons import RANK_COUNTS_ENV, RANK_COUNTS_MARK
    if os.environ.get(RANK_COUNTS_ENV):  # minipar lesson asks before launching (asked_counts)
        print(RANK_COUNTS_MARK + json.dumps({"ranks": list(ranks or ()), "at_least": at_least}),
              flush=True)
        raise SystemExit(0)
    from minipar import comm  # here, so that the lessons without MPI never load it

    def runs_on(n):
        return n in ranks if ranks else n >= at_least

    world = comm.world()
    _world = world
    if runs_on(world.size):
        line = header(world)
        if world.rank == 0:
            print(line, flush=True)
        return world
    if world.rank == 0:
        print(_advice(doc, runs_on, ranks, at_least), file=sys.stderr, flush=True)
    raise SystemExit(2)


def header(world):
    """'4 ranks on 1 node(s), device cpu', or on GPUs '... device gpu: rank 0 -> GPU 0, rank 1
    -> GPU 1, ...' (each rank's GPU, picked from its node-local rank by comm.world()).
    Collective: every rank tells rank 0 its GPU (None on the CPU)."""
    from minipar import backend

    line = f"{world.size} ranks on {world.local.nodes} node(s), device {backend.device()}"
    gpus = world.gather_object(world.gpu)
    if world.rank == 0 and any(g is not None for g in gpus):
        line += ": " + ", ".join(f"rank {r} -> GPU {g}" for r, g in enumerate(gpus))
    return line


def _advice(doc, runs_on, ranks, at_least):
    """'lesson 11 needs 8 ranks (or 4): minipar lesson 11 -n 8 -- --quick'."""
    name = os.path.basename(sys.argv[0])
    number = name[:2] if name[:2].isdigit() else name
    n = re.search(r"^\s*(?:mpiexec|minipar lesson \S+) -n (\d+)", doc, re.M)  # the run line
    best = int(n.group(1)) if n and runs_on(int(n.group(1))) else (ranks or [at_least])[0]
    if ranks:
        others = [str(r) for r in ranks if r != best]
        counts = f"{best} ranks" + (f" (or {', '.join(others)})" if others else "")
    else:
        counts = f"{at_least} or more ranks"
    line = ["minipar", "lesson", number, "-n", str(best)]
    if sys.argv[1:]:
        line += ["--", *sys.argv[1:]]
    return f"lesson {number} needs {counts}: {shlex.join(line)}"


def say(*lines):
    """Print each argument on a line of its own, from rank 0 only (every rank runs the lesson)."""
    if _world is None or _world.rank == 0:
        print(*lines, sep="\n", flush=True)


def check(claim, ok, expected=None, measured=None):
    """Record one claim of the lesson; finish() passes only if every recorded claim holds.
    A failed claim is printed with what was expected and what was measured."""
    _checks.append((claim, bool(ok), expected, measured))
    return bool(ok)


def finish(claim, ok=True):
    """The closing line from rank 0, ``PASS: claim`` when ``ok`` and every check() held on
    every rank (each failed check first, with expected and measured), else ``FAIL: claim``;
    returns the exit status, 0 or 1, the same on every rank."""
    failed = [c for c in _checks if not c[1]]
    for name, _, expected, measured in failed:
        print(f"FAIL: {name}: expected {expected}, measured {measured}"
              + (f" (rank {_world.rank})" if _world is not None and _world.size > 1 else ""),
              flush=True)
    ok = bool(ok) and not failed
    if _world is not None:
        ok = all(_world.all_gather_object(ok))
    held = [c[0] for c in _checks if c[1]]
    say(*(f"  ok: {name}" for name in held), f"{'PASS' if ok else 'FAIL'}: {claim}")
    return 0 if ok else 1


# A measured pipeline bubble against the textbook's plus what this run's messages cost: within
# this fraction of that expectation. The expectation replays the schedule with the textbook's
# F/B/W costs and each message at this run's own mean send, receive and wake-up seconds, so
# what the band leaves to noise is a wake-up delayed on the critical path beyond the mean. At
# lessons 08 and 09's rank counts (2, 4, 8; quick and full) the bubble measured within 2 % of it
# on a quiet 2-core machine, within 17 % (worst of 24) with 4 busy processes more on the two
# cores: 0.3 leaves room for that. Relative, the band is always tighter than the bubble it
# bounds (0.014 at the smallest, zb-h1's 0.047 on 2 ranks), and a check fails on a bubble
# above 1.3x, or below 0.7x, what theory and the messages give.
BUBBLE_BAND = 0.3


def message_costs(schedule, events):
    """(mean seconds of a send, of a receive whose data had arrived, of a wake-up: a waiting
    receive's end after its send's end) in one measured step; each rank's events are its
    schedule's actions in order."""
    import statistics

    from minipar.parallel.pipeline.actions import RECVS, SENDS, message_key
    sends, recvs = {}, []
    for r, actions in enumerate(schedule.actions):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        for a, e in zip(actions, mine):
            if a.kind in SENDS:
                sends[message_key(a)] = e
            elif a.kind in RECVS:
                recvs.append((a, e))
    pairs = [(e, sends[message_key(a)]) for a, e in recvs]
    waited = [e.end - s.end for e, s in pairs if e.start < s.end]
    ready = [e.duration for e, s in pairs if e.start >= s.end]

    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0
    return mean([e.duration for e in sends.values()]), mean(ready), mean(waited)


def bubble_with_messages(schedule, events, unit):
    """(the bubble the schedule has with its textbook costs, ``unit`` seconds per stage
    forward, and every message at this run's mean costs (``message_costs``), those costs)."""
    from minipar.parallel.pipeline.simulate import simulate, unit_cost
    from minipar.parallel.pipeline.timeline import bubble_fraction
    send, ready, wake = message_costs(schedule, events)
    textbook = unit_cost(schedule)
    seconds = {"SEND_F": send, "SEND_B": send, "RECV_F": ready, "RECV_B": ready}
    replay = simulate(schedule, lambda a: seconds.get(a.kind, unit * textbook(a)),
                      lambda a: wake)
    return bubble_fraction(replay, schedule.ranks), (send, ready, wake)


def check_bubble(label, measured, theory, expected):
    """The claim: the measured bubble lies within BUBBLE_BAND of ``expected`` (theory plus
    this run's messages, ``bubble_with_messages``)."""
    return check(f"{label}: measured bubble within {BUBBLE_BAND:.0%} of theory {theory:.3f} "
                 f"+ messages {expected - theory:.3f}",
                 abs(measured - expected) <= BUBBLE_BAND * expected,
                 f"{expected:.3f} ± {BUBBLE_BAND * expected:.3f}", f"{measured:.3f}")


def _rank():
    return _world.rank if _world is not None else 0


def progress(iterable, desc, total=None):
    """``iterable`` with a progress bar on rank 0's terminal (standard error): nothing in a log
    file, a pipe or a test run (minipar.console.progress)."""
    from minipar.console import progress as bar
    return bar(iterable, desc, total=total, rank=_rank())


def note_load():
    """Before timing anything: a line on standard error (rank 0) when the machine is busier
    than its cores, so noisy timings read as noise."""
    from minipar.console import note_load as note
    return note(rank=_rank())


def figure(directory, name, draw):
    """Draw one figure of the lesson, on rank 0, into ``directory/name.png`` and print
    ``figure: PATH``. ``draw(figures)`` gets the minipar.figures module and returns the Figure;
    it runs only when ``directory`` is given (``--plot DIR``) and matplotlib is installed.
    Without matplotlib the lesson says how to get it, once, and goes on. Returns the path or
    None."""
    global _said_missing
    if directory is None or _rank() != 0:
        return None
    from minipar import figures
    if not figures.available():
        if not _said_missing:
            print(figures.MISSING, file=sys.stderr, flush=True)
            _said_missing = True
        return None
    return figures.write_figures(directory, lambda: {name: draw(figures)})[0]
