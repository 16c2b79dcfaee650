"""``minipar assignment``: list the tasks, make a student tree, grade one (Gradescope-ready).

    minipar assignment list
    minipar assignment make --out DIR [--tasks ID,ID]
    minipar assignment grade [DIR] [--tasks ID,ID] [--json FILE] [--markdown FILE]

Grading exits 0 whenever it ran, whatever the score (Gradescope reads the score from the JSON).
"""
import importlib.util
import pathlib

from minipar import assignments
from minipar.cli.args import UsageError


def add_arguments(parser):
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="the tasks: id, points, title, lesson")
    make = actions.add_parser("make", help="write a student tree with the chosen tasks stubbed")
    make.add_argument("--out", required=True, help="the folder to write (created)")
    make.add_argument("--tasks", help="comma-separated task ids (default: every task)")
    grade = actions.add_parser("grade", help="grade the tree in DIR per task")
    grade.add_argument("dir", nargs="?", default=".", help="the student tree (default: here)")
    grade.add_argument("--tasks", help="comma-separated task ids (default: every task)")
    grade.add_argument("--json", help="write Gradescope's results.json here")
    grade.add_argument("--markdown", help="write the student's report here")
    grade.add_argument("--timeout", type=int, default=assignments.TASK_TIMEOUT,
                       help="seconds per task's tests (default %(default)s)")


def _ids(text):
    ids = [i.strip() for i in (text or "").split(",") if i.strip()]
    try:
        assignments.choose(ids)
    except ValueError as err:
        raise UsageError(f"argument --tasks: {err}") from None
    return ids


def run(args):
    if args.action == "list":
        total = sum(t.points for t in assignments.TASKS)
        print(f"{len(assignments.TASKS)} tasks, {total} points (id, points, title, lesson):")
        for t in assignments.TASKS:
            print(f"{t.id:24s} {t.points:3d}  {t.title} (lesson {t.lesson})")
        return 0
    if args.action == "make":
        ids = _ids(args.tasks)
        tasks = assignments.make(args.out, ids)
        print(f"wrote {args.out}: {len(tasks)} task(s) to do:")
        for t in tasks:
            print(f"  {t.id:24s} {t.points:3d}  {t.title}")
        print(f"grade it with: minipar assignment grade {args.out}")
        return 0
    if args.action == "grade":
        ids = _ids(args.tasks)
        if not (pathlib.Path(args.dir) / "minipar").is_dir():
            raise UsageError(f"argument dir: {args.dir} holds no minipar/ package to grade")
        if importlib.util.find_spec("pytest") is None:  # else every task would score 0
            raise UsageError("argument grade: grading runs the checks with pytest, which is not "
                             "installed: pip install 'minipar[dev]' (or pip install pytest)")
        print(f"grading {args.dir}:")
        results = assignments.grade(args.dir, ids, args.timeout, progress=lambda r: print(
            f"{r['task']:24s} {r['score']:3d} / {r['max_score']:<3d} "
            f"{'ok' if r['passed'] else 'FAILED'} ({r['seconds']} s)", flush=True))
        total = sum(r["score"] for r in results)
        print(f"{'total':24s} {total:3d} / {sum(r['max_score'] for r in results)}")
        assignments.write_reports(results, args.json, args.markdown)
        return 0
    raise UsageError("an action is required: list, make or grade")
