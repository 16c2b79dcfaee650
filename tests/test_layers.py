"""The layers of minipar are a contract, checked here on the source (every import statement,
function-local ones included), not a sentence in the README:

    backend   ->   engine   ->   comm   ->   parallel, distributed   ->   facade   ->   teaching

- backend (minipar.backend and its strict device) imports no other minipar module (the array
  module is chosen in one place);
- the engine (autograd, ops, functional, nn/, optim, amp/, checkpoint, ... every top-level module
  that is neither backend nor teaching) imports only backend and the engine: it knows no MPI;
- comm imports only backend and comm: collectives move arrays, not tensors;
- parallel and distributed import anything below them, never the teaching layer: serial code
  has no parallel twin inside, and the strategies do not lean on the tools that teach them;
- the facade (``minipar.FACADE``: torch's module paths, minipar.nn.parallel, minipar.utils.data,
  ...) imports anything below it and only re-exports: the one exception to the rule below;
- teaching (testing, trace, cli/, bench, console, figures, assignments, doctor, plan/) may import
  anything;
- no import cycle anywhere, no module sets attributes on a class defined elsewhere, and every
  module stays short enough to read in one sitting: its caps count code lines, not the
  docstrings and comments that explain it.

It also checks how the code reads (docs/architecture.md): a module docstring says what the
module is in at most 15 lines; no module but the facade's only re-exports another; no file name is held by three
modules; each point-to-point call of the Communicator reads as its MPI call; the pipeline's core
executor holds no PipeDream bookkeeping; the README is a reading path, a row per lesson; and the
path a student walks into one step (tests/step_paths.py) stays short: the idea's files and one
door to MPI.
"""
import ast
import collections
import pathlib
import re

import pytest

from minipar import FACADE
from minipar.testing import run_on_ranks

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minipar"
TEACHING = {"minipar.testing", "minipar.cli", "minipar.bench", "minipar.console",
            "minipar.assignments", "minipar.doctor", "minipar.figures", "minipar.plan",
            "minipar.__main__"}  # python -m minipar: the command
ORDER = ("backend", "engine", "comm", "parallel", "facade", "teaching")
MAY_IMPORT = {  # layer -> the layers its modules may import
    "backend": {"backend"},
    "engine": {"backend", "engine"},
    "comm": {"backend", "comm"},
    "parallel": {"backend", "engine", "comm", "parallel"},
    "facade": {"backend", "engine", "comm", "parallel", "facade"},
    "teaching": set(ORDER),
}
FOREIGN = {  # layer -> outside packages it must not import
    "backend": {"mpi4py"}, "engine": {"mpi4py"},
}
# caps in code lines (not blank, not a comment, not a docstring)
MAX_CODE_LINES, MAX_STRATEGY_CODE_LINES = 300, 250
# the assignments' checks: one test per task, side by side in the one file the grader copies
# into its sandbox; a list of independent checks, not a module read top-down (each
# communication task's check also holds what its messages carry: issue 37; the 2026 syllabus
# adds a task each for Ulysses and FP8: issues 38 and 39)
LONGER = {"minipar.assignments.checks": 460}
MAX_MODULE_DOCSTRING, MAX_P2P_METHOD = 15, 10
CAPPED = {"minipar.parallel.groups": 160, "minipar.parallel.pipeline.runtime": 220}
README = PACKAGE.parent / "README.md"
LESSONS = PACKAGE.parent / "lessons"


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name):
    """The layer of a module, from its dotted name."""
    parts = name.split(".")
    top = ".".join(parts[:2])
    if name in FACADE:
        return "facade"
    if top in TEACHING:
        return "teaching"
    if top == "minipar.backend":
        return "backend"
    if top == "minipar.comm":
        return "comm"
    if top in ("minipar.parallel", "minipar.distributed"):
        return "parallel"
    return "engine"


def imports(name, path=None):
    """(imported module, line) for every import in the module: minipar modules resolved to the
    module file they name (``from pkg import mod`` -> pkg.mod, ``from mod import f`` -> mod)."""
    path = path or MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target if target in MODULES else base, node.lineno))
    return found


def graph():
    return {name: {t for t, _ in imports(name) if t in MODULES and t != name} for name in MODULES}


def violations(name, path=None):
    """The layer rules this module breaks, one line each."""
    mine, wrong = layer(name), []
    for target, line in imports(name, path):
        if target in MODULES and target != name and layer(target) not in MAY_IMPORT[mine]:
            wrong.append(f"{name}:{line} ({mine}) imports {target} ({layer(target)})")
        if target.split(".")[0] in FOREIGN.get(mine, ()):
            wrong.append(f"{name}:{line} ({mine}) imports {target}")
    return wrong


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def attached_from_outside(name):
    """Module-level ``Imported.attr = ...`` or ``setattr(...)``: a class changed from outside."""
    tree = ast.parse(MODULES[name].read_text())
    imported = {alias.asname or alias.name.split(".")[0] for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    found = []
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "setattr" \
                    and not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.append(f"{name}:{sub.lineno} setattr at module level")
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id in imported:
                found.append(f"{name}:{node.lineno} assigns {target.value.id}.{target.attr}")
    return found


def test_every_module_imports_only_the_layers_below_it():
    wrong = sorted({line for name in MODULES for line in violations(name)})
    assert not wrong, "layer contract broken:\n" + "\n".join(wrong)


def test_there_is_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_attaches_methods_to_a_class_defined_elsewhere():
    found = [line for name in MODULES for line in attached_from_outside(name)]
    assert not found, "\n".join(found)


def docstring_lines(tree):
    """The line numbers of every docstring (module, class, function) in a parsed module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            found.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return found


def code_lines(source, first=1, last=None):
    """Lines of code between ``first`` and ``last``: blank lines, comments and docstrings not counted."""
    lines, docs = source.splitlines(), docstring_lines(ast.parse(source))
    return sum(1 for number in range(first, (last or len(lines)) + 1)
               if number not in docs and lines[number - 1].strip()
               and not lines[number - 1].strip().startswith("#"))


def module_docstring_length(source):
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def only_reexports(source):
    """A module whose code is nothing but imports (and ``__all__``): an old path kept alive."""
    body = [node for node in ast.parse(source).body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return bool(body) and all(
        isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.Assign) and any(
            getattr(target, "id", None) == "__all__" for target in node.targets)) for node in body)


def test_every_module_reads_in_one_sitting():
    sizes = {name: code_lines(path.read_text()) for name, path in MODULES.items()}
    long = {name: n for name, n in sizes.items() if n > LONGER.get(name, MAX_CODE_LINES)}
    assert not long, f"modules over {MAX_CODE_LINES} code lines: {long}"
    strategies = {name: n for name, n in sizes.items()
                  if layer(name) == "parallel" and n > MAX_STRATEGY_CODE_LINES}
    assert not strategies, f"strategy files over {MAX_STRATEGY_CODE_LINES} code lines: {strategies}"
    capped = {name: (sizes[name], cap) for name, cap in CAPPED.items() if sizes[name] > cap}
    assert not capped, f"(code lines, cap): {capped}"


def test_module_docstrings_say_what_not_why():
    long = {name: n for name, path in MODULES.items()
            if (n := module_docstring_length(path.read_text())) > MAX_MODULE_DOCSTRING}
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING} lines (the why belongs " \
                     f"above the line it explains, or in docs/): {long}"


def test_no_module_only_reexports_and_no_file_name_is_held_three_times():
    shells = [name for name, path in MODULES.items() if name not in FACADE
              and path.name != "__init__.py" and only_reexports(path.read_text())]
    assert not shells, f"modules that only re-export (import from the real home): {shells}"
    holders = collections.defaultdict(list)
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            holders[path.name].append(name)
    crowded = {file: names for file, names in holders.items() if len(names) >= 3}
    assert not crowded, f"file names held by three modules or more: {crowded}"


def test_the_facade_only_reexports_and_is_listed_in_the_port_guide():
    """torch's module paths (minipar.FACADE) hold no code of their own: each name lives in one
    real home, and docs/torch.md's table lists every facade module."""
    assert set(FACADE) <= set(MODULES), sorted(set(FACADE) - set(MODULES))
    coded = [name for name in FACADE if not only_reexports(MODULES[name].read_text())]
    assert not coded, f"facade modules with code of their own (move it to its home): {coded}"
    guide = (PACKAGE.parent / "docs" / "torch.md").read_text()
    unlisted = [name for name in FACADE if f"`{name}`" not in guide]
    assert not unlisted, f"facade modules docs/torch.md does not list: {unlisted}"


def test_point_to_point_calls_read_as_their_mpi_call():
    source = MODULES["minipar.comm.communicator"].read_text()
    [cls] = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.ClassDef) and node.name == "Communicator"]
    methods = {node.name: code_lines(source, node.lineno, node.end_lineno) for node in cls.body
               if isinstance(node, ast.FunctionDef)
               and node.name in ("send", "recv", "sendrecv", "isend", "irecv")}
    assert len(methods) == 5, methods
    long = {name: n for name, n in methods.items() if n > MAX_P2P_METHOD}
    assert not long, f"point-to-point methods over {MAX_P2P_METHOD} code lines: {long}"


def test_the_pipeline_runtime_holds_no_weight_versions():
    source = MODULES["minipar.parallel.pipeline.runtime"].read_text()
    docs = docstring_lines(ast.parse(source))
    code = "\n".join(line.split("#")[0] for number, line in enumerate(source.splitlines(), 1)
                     if number not in docs)
    found = sorted(set(re.findall(r"\w*(?:version|stash)\w*", code, re.IGNORECASE)))
    assert not found, f"PipeDream's weight versions belong in weight_stash.py: {found}"


def resolve(names):
    """Paths from a list of names where a bare name lies in the folder of the path before it."""
    folder, paths = "", []
    for name in names:
        path = name if "/" in name else f"{folder}/{name}" if folder else name
        folder = path.rstrip("/").rpartition("/")[0]
        paths.append(path)
    return paths


def readme_rows():
    """Lesson number -> (run command, [paths to read, in order], [tests that prove it])."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d\d", cells[0]):
            ticks = [re.findall(r"`([^`]+)`", cell) for cell in cells[2:]]
            rows[cells[0]] = (ticks[0][0], resolve(ticks[1]), ticks[2])
    return rows


def test_the_readme_is_a_reading_path():
    assert len(README.read_text().splitlines()) <= 160
    rows, lessons = readme_rows(), sorted(LESSONS.glob("[0-9][0-9]_*.py"))
    assert sorted(rows) == [path.name[:2] for path in lessons]
    for path in lessons:
        run, read, tests = rows[path.name[:2]]
        assert run.startswith(f"minipar lesson {path.name[:2]}")
        assert read[0] == f"lessons/{path.name}" and tests, rows[path.name[:2]]
        for name in read + tests:
            assert (PACKAGE.parent / name).exists(), f"README row {path.name[:2]} names {name}"


# One step, traced on 2 ranks: (files of comm/ and parallel/ that run, minipar frames on the stack
# at the first line that calls MPI) at most. Before the door (wire.py) they were 9/4, 16/12,
# 12/7 and 16/15: machinery stood on the path (chunks, requests, staging, transfer, watch,
# agreement, registry, errors, cost, node) instead of beside it.
PATH_BUDGET = {"1F1B step": (5, 5), "DDP step": (7, 8), "ring all-reduce": (5, 5),
               "ParallelMLP forward + backward": (7, 9)}


def test_a_step_meets_the_ideas_files_and_one_door_to_mpi():
    traced = run_on_ranks(str(pathlib.Path(__file__).with_name("step_paths.py")) + ":all_paths",
                          2, timeout=180)
    long = []
    for rank, paths in enumerate(traced):
        assert sorted(paths) == sorted(PATH_BUDGET)
        for name, (files, frames) in PATH_BUDGET.items():
            path = paths[name]
            # the tracer saw the MPI call, and it is the door's
            assert path["frames"] and path["frames"][-1].startswith("comm/wire.py:"), path
            if len(path["files"]) > files or len(path["frames"]) > frames:
                long.append(f"rank {rank}, {name}: {len(path['files'])} files (at most {files}): "
                            f"{', '.join(path['files'])}; {len(path['frames'])} frames (at most "
                            f"{frames}): {' > '.join(path['frames'])}")
    assert not long, "paths grew longer:\n" + "\n".join(long)


# -- the checker itself: it must catch what it is there to catch ---------------------------------

@pytest.mark.parametrize("name, source, expected", [
    ("minipar.ops", "from minipar.comm import world\n", "(engine) imports minipar.comm (comm)"),
    ("minipar.ops", "def f():\n    from mpi4py import MPI\n", "imports mpi4py"),
    ("minipar.backend", "from . import autograd\n", "(backend) imports minipar.autograd"),
    ("minipar.backend.strict", "from minipar import ops\n", "(backend) imports minipar.ops"),
    ("minipar.comm.allreduce", "from minipar.autograd import Tensor\n",
     "(comm) imports minipar.autograd (engine)"),
    ("minipar.parallel.hybrid", "def f():\n    from ..testing import run_on_ranks\n",
     "(parallel) imports minipar.testing (teaching)"),
])
def test_the_checker_finds_an_upward_import(tmp_path, name, source, expected):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert any(expected in line for line in violations(name, path)), violations(name, path)


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_counts_code_not_explanation():
    source = '"""A module.\n\nWhy, at length.\n"""\nimport os  # noqa\n\n\n# why this line\n' \
             'def f():\n    """What f is."""\n    return os.sep\n'
    assert code_lines(source) == 3
    assert module_docstring_length(source) == 4
    assert only_reexports('"""Old path."""\nfrom a import b  # noqa: F401\n')
    assert not only_reexports(source)
