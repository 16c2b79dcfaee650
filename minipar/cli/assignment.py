"""``minipar assignment``: list the tasks, make a student tree, grade one (Gradescope-ready).

    minipar assignment list
    minipar assignment make --out DIR [--tasks ID,ID] [--force]
    minipar assignment pack [DIR] [--out ZIP]
    minipar assignment grade [DIR|ZIP] [--tasks ID,ID | --all] [--json FILE] [--markdown FILE]

Grading exits 0 whenever it ran, whatever the score (Gradescope reads the score from the JSON);
a submission it cannot grade (no tree, two trees, a bad zip) exits 1 and still writes the
reports, scoring 0 on every task, the reason in each task's output. Files at the tree's top
that could fool pytest are set aside (never copied into the sandbox) and named in both reports.
Without --tasks it grades the tasks the tree records (assignment.json).
"""
import importlib.util
import pathlib

from minipar import assignments
from minipar.assignments import grader, submission, tree
from minipar.cli.args import UsageError


def add_arguments(parser):
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="the tasks: id, points, title, lesson")
    make = actions.add_parser("make", help="write a student tree with the chosen tasks stubbed")
    make.add_argument("--out", required=True, help="the folder to write (created)")
    make.add_argument("--tasks", help="comma-separated task ids (default: every task)")
    make.add_argument("--force", action="store_true",
                      help="write into --out even when it holds something (overwrites the tree)")
    pack = actions.add_parser("pack", help="write the zip to hand in: the tree less its "
                                           "virtual environments, caches and build folders")
    pack.add_argument("dir", nargs="?", default=".", help="the student tree (default: here)")
    pack.add_argument("--out", help="the zip to write (default: DIR's name .zip, beside DIR)")
    grade = actions.add_parser("grade", help="grade the tree in DIR (or a zip of it) per task")
    grade.add_argument("dir", nargs="?", default=".",
                       help="the student tree, a folder holding it, or a zip (default: here)")
    chosen = grade.add_mutually_exclusive_group()
    chosen.add_argument("--tasks", help="comma-separated task ids (default: the tasks the tree "
                                        "records in assignment.json, else every task)")
    chosen.add_argument("--all", action="store_true", help="every task, whatever the tree records")
    grade.add_argument("--json", help="write Gradescope's results.json here")
    grade.add_argument("--markdown", help="write the student's report here")
    grade.add_argument("--timeout", type=int, default=assignments.TASK_TIMEOUT,
                       help="seconds per task's tests (default %(default)s)")


def _ids(text):
    """The ids of ``--tasks``, None when it names none."""
    ids = [i.strip() for i in (text or "").split(",") if i.strip()]
    try:
        assignments.choose(ids)
    except ValueError as err:
        raise UsageError(f"argument --tasks: {err}") from None
    return ids or None


def run(args):
    if args.action == "list":
        total = sum(t.points for t in assignments.TASKS)
        print(f"{len(assignments.TASKS)} tasks, {total} points (id, points, title, lesson):")
        for t in assignments.TASKS:
            print(f"{t.id:24s} {t.points:3d}  {t.title} (lesson {t.lesson})")
        return 0
    if args.action == "make":
        ids = _ids(args.tasks)
        try:
            tasks = assignments.make(args.out, ids, force=args.force)
        except FileExistsError as err:
            raise UsageError(f"argument --out: {err}") from None
        print(f"wrote {args.out}: {len(tasks)} task(s) to do:")
        for t in tasks:
            print(f"  {t.id:24s} {t.points:3d}  {t.title}")
        print(f"grade it with: minipar assignment grade {args.out}")
        return 0
    if args.action == "pack":
        return _pack(args)
    if args.action == "grade":
        ids = _ids(args.tasks)
        if importlib.util.find_spec("pytest") is None:  # else every task would score 0
            raise UsageError("argument grade: grading runs the checks with pytest, which is not "
                             "installed: pip install 'minipar[dev]' (or pip install pytest)")
        # a grading that dies leaves no report rather than a stale or planted one
        assignments.clear_reports(args.json, args.markdown)
        with submission.opened(args.dir) as (found, reason):
            reason = reason or (found and grader.refusal(found))
            note = grader.set_aside_note(found) if found and not reason else ""
            if note:
                print(note)
            results, reason = _grade(None if reason else found, reason, ids, args)
        total = sum(r["score"] for r in results)
        print(f"{'total':24s} {total:3d} / {sum(r['max_score'] for r in results)}")
        assignments.write_reports(results, args.json, args.markdown, note)
        return 1 if reason else 0
    raise UsageError("an action is required: list, make, pack or grade")


def _pack(args):
    folder = pathlib.Path(args.dir).resolve()
    why = grader.refusal(folder)
    if why:
        raise UsageError(f"argument dir: {folder} is not a tree to hand in: {why}")
    out = pathlib.Path(args.out) if args.out else folder.parent / f"{folder.name}.zip"
    try:
        files, size = submission.pack(folder, out)
    except submission.Unusable as err:
        raise UsageError(f"argument dir: {err}") from None
    print(f"wrote {out}: {files} files, {size / 1024:.0f} KB (virtual environments, caches and "
          f"build folders left out); hand in this file")
    return 0


def _grade(found, reason, ids, args):
    """Grade the tree ``found`` on ``ids``, else on the tasks it records (all with --all or no
    record); a submission that cannot be graded scores 0 on each, ``reason`` as the output.
    (results, the reason it was not graded or None)."""
    if found is not None and not ids and not args.all:
        try:
            ids = tree.recorded(found)
            assignments.choose(ids)
        except ValueError as err:  # a record the student edited: the teacher names the tasks
            found, ids, reason = None, None, f"{tree.RECORD} in the tree: {err}"
    if found is None:
        print(f"cannot grade {args.dir}: {reason}")
        results = assignments.unscored(assignments.choose(ids), f"not graded: {reason}")
        for result in results:
            _show(result)
        return results, reason
    print(f"grading {found}:")
    return assignments.grade(found, ids, args.timeout, progress=_show), None


def _show(result):
    print(f"{result['task']:24s} {result['score']:3d} / {result['max_score']:<3d} "
          f"{'ok' if result['passed'] else 'FAILED'} ({result['seconds']} s)", flush=True)
