"""How fast a class hears back: the feedback times of issue 37, each the median of 3 runs.

    python scripts/bench_class.py                 (every lesson and task: about 15 minutes)
    python scripts/bench_class.py --lessons 04,09 --tasks ring-all-reduce --repeat 1

Times, beside the goal each should meet on a quiet 2-core machine: ``minipar --help`` (with
``python -c pass``, the interpreter's own start, measured beside it); grading one task of the
reference tree (``minipar assignment grade``, one task a run); every lesson's ``--quick`` at
its own rank count; and a student tree whose ring deadlocks (every rank receives first), its
lesson 04 ending by the tree's watchdog with the who-waits-on-whom lines. Each row prints the
median, the range, the goal, and the median over the goal.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread per rank, as the lessons run
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minipar import assignments  # noqa: E402
from minipar.cli.lessons import LESSON_DIR  # noqa: E402

GOALS = {"help": 1.0, "grade": 15.0, "lesson": 20.0, "deadlock": 20.0}
MINIPAR = [sys.executable, "-m", "minipar.cli"]
# the deadlocking ring a student might write: every rank receives before it sends
DEADLOCK = ["send, recv = (r + shift - s) % p, (r + shift - s - 1) % p",
            "lo, hi = bounds[recv], bounds[recv + 1]", "got = tmp[:hi - lo]", "c.Recv(got, left)",
            "c.Send((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right)",
            "reduce(src[lo:hi], got, out=buf[lo:hi])"]


def timed(command, cwd=ROOT, env=None, want=None):
    """Seconds ``command`` ran; a RuntimeError when it failed (or lacks ``want``)."""
    start = time.perf_counter()
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=600)
    seconds = time.perf_counter() - start
    output = run.stdout + run.stderr
    if (want is None and run.returncode != 0) or (want is not None and want not in output):
        raise RuntimeError(f"{' '.join(map(str, command))} (status {run.returncode}):\n"
                           f"{output[-2000:]}")
    return seconds


def deadlocked_tree(folder):
    """A tree with ring-all-reduce written wrong: each rank receives first."""
    tree = folder / "hw"
    assignments.make(tree, ["ring-all-reduce"])
    path = tree / "minipar/comm/patterns.py"
    lines = path.read_text().split("\n")
    [i] = [k for k, line in enumerate(lines) if "Task ring-all-reduce" in line]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i:i + 1] = [indent + line for line in DEADLOCK]
    path.write_text("\n".join(lines))
    return tree


def rows(args, folder):
    """(name, goal kind, a function timing one run) for each measurement asked for."""
    yield "python -c pass (the interpreter alone)", None, lambda: timed([sys.executable, "-c",
                                                                           "pass"])
    yield "minipar --help", "help", lambda: timed(MINIPAR + ["--help"])
    for task in args.tasks:
        yield f"grade {task} (reference)", "grade", lambda task=task: timed(
            MINIPAR + ["assignment", "grade", str(ROOT), "--tasks", task], want=" ok (")
    for number in args.lessons:
        yield f"lesson {number} --quick", "lesson", lambda n=number: timed(
            MINIPAR + ["lesson", n, "--", "--quick"])
    tree = deadlocked_tree(folder)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("MINIPAR_TIMEOUT", None)  # the tree's own default
    yield "deadlocked tree: lesson 04 --quick ends", "deadlock", lambda: timed(
        MINIPAR + ["lesson", "04", "--", "--quick"], cwd=tree, env=env,
        want="minipar watchdog: no progress")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per row (the median shown)")
    parser.add_argument("--lessons", help="comma-separated lesson numbers (default: all)")
    parser.add_argument("--tasks", help="comma-separated task ids (default: all)")
    args = parser.parse_args()
    args.lessons = args.lessons.split(",") if args.lessons else sorted(
        p.name[:2] for p in pathlib.Path(LESSON_DIR).glob("[0-9][0-9]_*.py"))
    args.tasks = args.tasks.split(",") if args.tasks else [t.id for t in assignments.TASKS]
    print(f"{'measurement':44s} {'median s':>9s} {'range':>13s} {'goal s':>7s} {'/goal':>6s}")
    missed = []
    with tempfile.TemporaryDirectory(prefix="minipar-bench-class-") as folder:
        for name, kind, run in rows(args, pathlib.Path(folder)):
            times = [run() for _ in range(args.repeat)]
            median, goal = statistics.median(times), GOALS.get(kind)
            if goal and median > goal:
                missed.append(name)
            print(f"{name:44s} {median:9.2f} {min(times):6.2f}-{max(times):<6.2f} "
                  + (f"{goal:7.0f} {median / goal:6.2f}" if goal else f"{'':7s} {'':6s}"),
                  flush=True)
    print(f"goals missed: {', '.join(missed)}" if missed else "every goal met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
