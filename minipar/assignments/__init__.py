"""Assignments: the reference source with its solutions cut out, and the grader that scores them.

A solution region in the library is a run of whole statements between two comment lines in
nbgrader's convention: three hashes, ``BEGIN SOLUTION`` and the task's id (``ring-all-reduce``)
opening it, three hashes and ``END SOLUTION`` closing it, at the statements' indentation. The
markers appear nowhere else (this module spells them in two pieces).

``make`` copies the package and the lessons into a student tree where each chosen task's
regions become ``raise NotImplementedError("Task <id>: <title> (see lesson NN)")`` at their
indentation (signatures, docstrings and the comments before them stay); the other tasks keep
their solution, the markers removed; tree.py adds the README, setup.cfg and task record; then
the docs pages, tests and scripts the tree's files name come too (``ship_references``).
``grade`` runs each task's checks in a sandbox (grader.py), all or nothing per task: its points
when every one of its checks passes, else 0 (partial credit would reward a stub passing one).
"""
import dataclasses
import json
import pathlib
import posixpath
import re
import shutil

from minipar.assignments import grader, tree
from minipar.assignments.grader import (BUDGET, CHECKS, TASK_TIMEOUT, clear_reports,  # noqa: F401
                                        grade_task, gradescope, markdown, refusal, unscored,
                                        write_reports)
from minipar.assignments.sandbox import STUCK_TIMEOUT  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the tree this minipar was loaded from
BEGIN, END = "### BEGIN " + "SOLUTION", "### END " + "SOLUTION"  # split: no false region here
# the folders of the reference's checkout a tree holds only what its files name from: a path
# from the root (not the tail of a URL or another path), a markdown page's relative link, a
# shell script's sibling, a test's helper module
SHIPPED = ("docs", "tests", "scripts")
NAMED = re.compile(r"(?<![\w./:@~$-])((?:docs|tests|scripts)/[\w./-]*\w)")
LINKED = re.compile(r"\]\(([\w./-]+)[#)]")
BESIDE = re.compile(r'\$\(dirname "\$0"\)/([\w.-]+)')
IMPORTED = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.M)


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    points: int
    title: str
    lesson: str
    tests: tuple  # test names in checks.py (a name covers every parameter)
    files: tuple  # the library files holding its regions

    def stub(self):
        message = f"Task {self.id}: {self.title} (see lesson {self.lesson})"
        return f"raise NotImplementedError({json.dumps(message, ensure_ascii=False)})"


def _t(id, points, title, lesson, tests, *files):
    return Task(id, points, title, lesson, tuple(tests), files)


TASKS = (
    _t("op-backward", 5, "matmul's backward, dA = g Bᵀ and dB = Aᵀ g", "01",
       ["test_op_backward_matmul_matches_finite_differences"], "minipar/ops.py"),
    _t("layer-norm", 5, "layer norm's backward", "01",
       ["test_layer_norm_backward_matches_finite_differences"], "minipar/functional.py"),
    _t("checkpoint-sequential", 5, "checkpoint_sequential: segments, recompute all but the last",
       "02", ["test_checkpoint_sequential_same_gradients_as_plain_run"], "minipar/checkpoint.py"),
    _t("ring-all-reduce", 10, "the ring reduce-scatter of the ring all-reduce", "04",
       ["test_ring_all_reduce_equals_the_sum"], "minipar/comm/patterns.py"),
    _t("recursive-halving", 10, "the recursive-halving reduce-scatter (Rabenseifner)", "04",
       ["test_recursive_halving_all_reduce_equals_the_sum"], "minipar/comm/patterns.py"),
    _t("ddp-buckets", 5, "DDP's gradient buckets, in reverse order, capped in bytes", "05",
       ["test_ddp_buckets_follow_pytorchs_rule"], "minipar/parallel/data/buckets.py"),
    _t("zero-sharded-step", 5, "ZeRO's step: each rank updates its shard, then all-gather",
       "06", ["test_zero_sharded_step_equals_a_plain_step"], "minipar/parallel/data/zero.py"),
    _t("one-f-one-b", 5, "one rank's 1F1B order: warm-up, steady state, drain", "09",
       ["test_one_f_one_b_order_and_in_flight"], "minipar/parallel/pipeline/schedules.py"),
    _t("zero-bubble-w", 5, "zero bubble's W pass: the weight gradients B deferred", "09",
       ["test_zero_bubble_w_gives_the_plain_gradients"], "minipar/graph.py"),
    _t("megatron-f-g", 5, "Megatron's conjugate f and g operators", "10",
       ["test_megatron_f_g_are_conjugate"], "minipar/parallel/tensor/mappings.py"),
    _t("vocab-cross-entropy", 10, "the vocab-parallel cross-entropy: max, sum, target logit",
       "10", ["test_vocab_cross_entropy_equals_the_full_loss"],
       "minipar/parallel/tensor/embedding.py"),
    _t("rank-grid", 5, "rank <-> (tp, dp, pp) coordinates of the 3-D grid", "11",
       ["test_rank_grid_coords_and_rank_are_inverse"], "minipar/parallel/groups.py"),
    _t("moe-top-k", 5, "MoE's softmax top-k gate and capacity drop in token order", "12",
       ["test_moe_top_k_gates_and_capacity_drops"], "minipar/nn/moe.py"),
    _t("loss-scale-update", 5, "the dynamic loss scale: back off on inf or NaN, grow when clean",
       "13", ["test_loss_scale_update_follows_the_rule"], "minipar/amp/grad_scaler.py"),
    _t("online-softmax-merge", 5, "merge a block of attention into the running max, sum, output",
       "14", ["test_online_softmax_merge_equals_softmax_at_once"],
       "minipar/parallel/context/ring.py"),
    _t("ulysses-all-to-all", 5, "Ulysses' all-to-all: my tokens of all heads <-> all tokens of "
       "H/P heads", "14", ["test_ulysses_all_to_all_equals_attention_over_the_whole_sequence"],
       "minipar/parallel/context/ulysses.py"),
    _t("fp8-tile-scale", 5, "FP8's fine-grained scales: amax per 1x128 tile (128x128 block), "
       "then quantise", "17", ["test_fp8_tile_scale_equals_deepseeks_definition"],
       "minipar/amp/float8_recipes.py"),
)
BY_ID = {t.id: t for t in TASKS}


def choose(ids=None):
    """The tasks named by a list of ids (None: all), in table order; an unknown id is an error."""
    if not ids:
        return list(TASKS)
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        raise ValueError(f"unknown task {', '.join(unknown)}; the tasks are {', '.join(BY_ID)}")
    return [t for t in TASKS if t.id in ids]


# --- making a student tree ----------------------------------------------------------------------
def regions(text):
    """(task id, first line, last line) of every marked region, 0-based, markers included."""
    found, open_at = [], None
    for i, line in enumerate(text.split("\n")):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if open_at is not None:
                raise ValueError(f"line {i + 1}: {BEGIN} inside another region")
            open_at, task = i, stripped[len(BEGIN):].strip()
            if task not in BY_ID:
                raise ValueError(f"line {i + 1}: region names unknown task {task!r}")
        elif stripped == END:
            if open_at is None:
                raise ValueError(f"line {i + 1}: {END} without a {BEGIN}")
            found.append((task, open_at, i))
            open_at = None
    if open_at is not None:
        raise ValueError(f"line {open_at + 1}: {BEGIN} never closed")
    return found


def strip(text, stripped_ids):
    """The source with the regions of ``stripped_ids`` replaced by their stub, others unmarked."""
    lines = text.split("\n")
    for task, first, last in reversed(regions(text)):
        if task in stripped_ids:
            indent = re.match(r"\s*", lines[first]).group(0)
            lines[first:last + 1] = [indent + BY_ID[task].stub()]
        else:
            lines[first:last + 1] = lines[first + 1:last]
    return "\n".join(lines)


def make(out, ids=None, source=ROOT, force=False):
    """Write a student tree to ``out`` with the tasks ``ids`` (default all) stripped, and its
    README, install metadata and task record (assignment.json), and the docs, tests and scripts
    its files name (``ship_references``); a FileExistsError, with nothing written, when ``out``
    holds anything already, unless ``force``."""
    tasks, out, source = choose(ids), pathlib.Path(out), pathlib.Path(source)
    tree.refuse_to_overwrite(out, force)
    stripped = {t.id for t in tasks}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source / "minipar", out / "minipar", ignore=ignore, dirs_exist_ok=True)
    lessons = _lessons_dir(source)
    if lessons:
        shutil.copytree(lessons, out / "lessons", ignore=ignore, dirs_exist_ok=True)
    for path in sorted((out / "minipar").rglob("*.py")):
        text = path.read_text()
        if BEGIN in text:
            path.write_text(strip(text, stripped))
    tree.write(out, tasks, out / "lessons", source)
    ship_references(out, source)
    return tasks


def ship_references(out, source=ROOT):
    """Copy into the tree ``out`` each file of ``source``'s docs/, tests/ and scripts/ that a
    file of ``out`` names (docs/comm.md, tests/test_zero.py, tests/test_plan_cli as a module,
    scripts/bench_dp.py; a page's images and linked pages; a test's conftest.py and helpers),
    then what those name, until nothing new is named; the paths shipped, sorted. Only from a
    checkout (its setup.cfg beside the package): an installed wheel has no docs or tests beside
    it, and the tests/ in site-packages is another project's; its references stay unshipped."""
    out, source = pathlib.Path(out), pathlib.Path(source)
    if not (source / "setup.cfg").is_file():
        return []
    shipped, todo = set(), [p for p in out.rglob("*") if p.is_file()]
    while todo:
        for name in _named(todo.pop(), out):
            found = [n for n in (name, name + ".py")
                     if n.split("/")[0] in SHIPPED and (source / n).is_file()]
            if found and found[0] not in shipped:  # copied over what is there, as the package is
                shipped.add(found[0])
                (out / found[0]).parent.mkdir(parents=True, exist_ok=True)
                todo.append(pathlib.Path(shutil.copy2(source / found[0], out / found[0])))
    return sorted(shipped)


def _named(path, out):
    """The paths from the root of the tree ``out`` that its file ``path`` names."""
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):  # a picture, a data file
        return set()
    folder = path.relative_to(out).parent
    names = set(NAMED.findall(text)) | {folder / n for n in BESIDE.findall(text)}
    if path.suffix == ".md":
        names |= {folder / n for n in LINKED.findall(text)}
    if folder.parts[:1] == ("tests",) and path.suffix == ".py":
        names |= {f"tests/{n}.py" for n in IMPORTED.findall(text)} | {"tests/conftest.py"}
    return {posixpath.normpath(pathlib.PurePath(n).as_posix()) for n in names}


def _lessons_dir(source):
    """The lessons beside the package in a source tree, else where the lesson command finds them
    (an installed wheel ships them as data files)."""
    if (source / "lessons").is_dir():
        return source / "lessons"
    from minipar.cli import lessons
    found = pathlib.Path(getattr(lessons, "LESSON_DIR", source / "lessons"))
    return found if found.is_dir() else None


# --- grading ------------------------------------------------------------------------------------
def grade(tree=".", ids=None, timeout=TASK_TIMEOUT, progress=None, budget=BUDGET):
    """Grade every task (or ``ids``) in ``tree``, each within ``timeout`` seconds and all within
    ``budget``; a list of grade_task results (grader.grade_tasks on the tasks named)."""
    return grader.grade_tasks(tree, choose(ids), timeout, progress, budget)
