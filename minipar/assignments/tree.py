"""The student tree's own files: its README, its install metadata, the record of its tasks.

``make`` (minipar/assignments/__init__.py) copies the package and the lessons, then calls
``write`` here, so that the tree stands alone: ``pip install -e .`` inside it makes its
``minipar`` (the command included) the one that runs, and ``grade`` without ``--tasks`` reads
the assignment's tasks from ``assignment.json`` (``recorded``).

    refuse_to_overwrite(out, force)          # before anything is written
    write(out, tasks, lessons=out / "lessons", source=ROOT)
    recorded(tree)                           # ["ring-all-reduce", ...], or None: a reference tree
"""
import configparser
import importlib.metadata
import io
import json
import pathlib

RECORD = "assignment.json"  # {"tasks": [ids...], "points": total}; the grader reads "tasks"
# the tree's watchdog default: a deadlocked lesson prints who waits on whom in about 15 s, not
# after the library's two minutes (a graded run sets its own, sandbox.STUCK_TIMEOUT)
WATCHDOG = ("minipar/comm/watch.py", 'DEFAULT_TIMEOUT = "120"', 'DEFAULT_TIMEOUT = "12"')
# the reference's setup.cfg, less what only its own checkout needs: of its test suite's settings
# the markers stay (the tests the tree ships use them), its paths and options go
KEPT_OPTIONS = {"tool:pytest": ("markers",)}
PYPROJECT = '[build-system]\nrequires = ["setuptools>=61", "wheel"]\n' \
            'build-backend = "setuptools.build_meta"\n'

README = """\
# Assignment: {count} task(s), {points} points

This folder is a copy of minipar with the pieces below cut out. Each is one line,
`raise NotImplementedError("Task <id>: ...")`, where the solution goes; the signature, the
docstring and the comments above it say what to write. The rest of the library is complete,
so the lessons run up to the piece you are writing.

| task | points | what to write | lesson | file(s) |
|---|---|---|---|---|
{rows}

## Set up (once)

```bash
python -m venv .venv && source .venv/bin/activate
pip install -e ".[mpi]" pytest    # this folder's minipar, MPI from PyPI, pytest
python -c "import minipar; print(minipar.__file__)"    # a path in this folder
```

`pip install -e .` makes this folder's `minipar` the one Python imports and the `minipar`
command the one that runs, even where another minipar was installed before. A lesson run with
another minipar says so in its first line. Without installing, `python -m minipar.cli` run
from this folder is the same command.

A call that makes no progress for 12 s (a deadlock in your code) ends the run with the
watchdog's lines saying which rank waits on which; `MINIPAR_TIMEOUT=120` (seconds; `0`: off,
for a debugger) gives a slow machine longer.

{tasks}
## Grade and hand in

```bash
minipar assignment grade .    # every task of this assignment (assignment.json)
```

The grader runs each task's checks on your code, all or nothing per task, and shows for each
failing task its first failing check. Your teacher grades with their own copy of the checks,
so editing `minipar/assignments/checks.py` changes nothing.

To hand in, write the zip with

```bash
minipar assignment pack .    # writes ../{folder}.zip; hand in that file
```

It leaves out what is not your work: `.venv/` (any virtual environment), `__pycache__/` and
other caches, `build/`, `dist/`, `*.egg-info` and `.git/`; the zip is under a megabyte. A zip
you make yourself is graded the same way (the grader leaves those folders out of it before it
checks its size), but with `.venv/` inside it is hundreds of megabytes to upload.
"""
README_TASK = """\
## `{id}` ({points} points): {title}

Read lesson {lesson} ({lesson_file}), then the stub in {files}.

```bash
python -m pytest -q minipar/assignments/checks.py -k "{tests}"
minipar lesson {lesson} -- --quick    # the lesson, on its own rank count
minipar assignment grade . --tasks {id}
```
"""


def refuse_to_overwrite(out, force=False):
    """A FileExistsError when ``out`` is a file, or a folder with something in it, unless
    ``force``: a second ``make`` over a handed-out tree would erase a student's work."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder to write the tree into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty: choose a new folder, or pass --force to "
                              f"write the tree over what is there")


def write(out, tasks, lessons=None, source=None):
    """The README, setup.cfg, pyproject.toml and assignment.json of the tree at ``out``, whose
    stripped tasks are ``tasks`` (minipar.assignments.Task rows) and lessons are in ``lessons``;
    and its watchdog's default (WATCHDOG)."""
    out = pathlib.Path(out)
    (out / "README.md").write_text(readme(tasks, lessons, out.resolve().name))
    (out / "setup.cfg").write_text(setup_cfg(source))
    (out / "pyproject.toml").write_text(PYPROJECT)
    record = {"tasks": [t.id for t in tasks], "points": sum(t.points for t in tasks)}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    watchdog = out / WATCHDOG[0]
    text = watchdog.read_text()
    if WATCHDOG[1] not in text:
        raise ValueError(f"{WATCHDOG[0]} has no line {WATCHDOG[1]!r} to set the tree's watchdog")
    watchdog.write_text(text.replace(WATCHDOG[1], WATCHDOG[2]))


def recorded(tree):
    """The task ids ``tree`` records, or None when it records none (a reference tree); a record
    that cannot be read is a ValueError saying what is wrong with it."""
    path = pathlib.Path(tree) / RECORD
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["tasks"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read its task list ({type(err).__name__}: {err})") from None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f'"tasks" must be a list of task ids, not {ids!r}')
    return ids


def setup_cfg(source=None):
    """The tree's setup.cfg: the reference's own (its name, requirements, extras and the
    ``minipar`` console script), or, for a reference installed from a wheel (no setup.cfg
    beside the package), the same rebuilt from its installed metadata."""
    config = configparser.ConfigParser(interpolation=None)
    if not (source and config.read(pathlib.Path(source) / "setup.cfg")):
        config.read_dict(_installed_metadata())
    for section, kept in KEPT_OPTIONS.items():
        for option in config.options(section) if config.has_section(section) else ():
            if option not in kept:
                config.remove_option(section, option)
    config["metadata"]["description"] = "a minipar assignment: the library with tasks to fill in"
    text = io.StringIO()
    config.write(text)
    return "# written by `minipar assignment make`: pip install -e . runs this tree's minipar\n" \
        + text.getvalue()


def _installed_metadata():
    dist = importlib.metadata.distribution("minipar")
    plain, extras = [], {}
    for requirement in dist.requires or []:
        name, _, marker = (part.strip() for part in requirement.partition(";"))
        if "extra ==" in marker:  # 'extra == "mpi"'
            extras.setdefault(marker.split("==")[1].strip(" '\""), []).append(name)
        else:
            plain.append(name)
    scripts = [f"{e.name} = {e.value}" for e in dist.entry_points if e.group == "console_scripts"]
    return {"metadata": {"name": dist.metadata["Name"], "version": dist.version},
            "options": {"packages": "find:", "install_requires": _lines(plain),
                        "include_package_data": "True"},
            "options.packages.find": {"include": "minipar*"},
            "options.extras_require": {k: _lines(v) for k, v in extras.items()},
            "options.entry_points": {"console_scripts": _lines(scripts)}}


def _lines(items):
    """A multi-line setup.cfg value: one item a line, after the key's line."""
    return "\n" + "\n".join(items)


def readme(tasks, lessons=None, folder="hw"):
    """The student's README: the tasks and their points, how to install the tree, then per task
    what to read and how to run its checks, its lesson and the grader; how to hand it in."""
    rows = [f"| `{t.id}` | {t.points} | {t.title} | {_lesson(t, lessons)} | {_files(t)} |"
            for t in tasks]
    sections = [README_TASK.format(id=t.id, points=t.points, title=t.title, lesson=t.lesson,
                                   lesson_file=_lesson(t, lessons), files=_files(t),
                                   tests=" or ".join(t.tests)) for t in tasks]
    return README.format(count=len(tasks), points=sum(t.points for t in tasks),
                         rows="\n".join(rows), tasks="\n".join(sections), folder=folder)


def _files(task):
    return ", ".join(f"`{name}`" for name in task.files)


def _lesson(task, lessons):
    """`lessons/04_allreduce.py` for a task of lesson 04 (its number when the file is absent)."""
    found = sorted(pathlib.Path(lessons).glob(f"{task.lesson}_*.py")) if lessons else []
    return f"`lessons/{found[0].name}`" if found else f"lesson {task.lesson}"
