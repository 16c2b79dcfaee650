"""The layers of minipar are a contract, checked here on the source (every import statement,
function-local ones included), not a sentence in the README:

    backend   ->   engine   ->   comm   ->   parallel, distributed   ->   teaching

- backend (minipar.backend and its strict device) imports no other minipar module (the array
  module is chosen in one place);
- the engine (autograd, ops, functional, nn/, optim, checkpoint, ... every top-level module that
  is neither backend nor teaching) imports only backend and the engine: it knows no MPI;
- comm imports only backend and comm: collectives move arrays, not tensors;
- parallel and distributed import anything below them, never the teaching layer: serial code
  has no parallel twin inside, and the strategies do not lean on the tools that teach them;
- teaching (testing, trace, cli/, bench, console, figures, assignments, doctor) may import anything;
- no import cycle anywhere, no module sets attributes on a class defined elsewhere, and every
  module stays short enough to read in one sitting.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minipar"
TEACHING = {"minipar.testing", "minipar.cli", "minipar.bench", "minipar.console",
            "minipar.assignments", "minipar.doctor", "minipar.figures"}
ORDER = ("backend", "engine", "comm", "parallel", "teaching")
MAY_IMPORT = {  # layer -> the layers its modules may import
    "backend": {"backend"},
    "engine": {"backend", "engine"},
    "comm": {"backend", "comm"},
    "parallel": {"backend", "engine", "comm", "parallel"},
    "teaching": set(ORDER),
}
FOREIGN = {  # layer -> outside packages it must not import
    "backend": {"mpi4py"}, "engine": {"mpi4py"},
}
MAX_LINES, MAX_STRATEGY_LINES = 400, 300


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name):
    """The layer of a module, from its dotted name."""
    parts = name.split(".")
    top = ".".join(parts[:2])
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


def test_every_module_reads_in_one_sitting():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"modules of {MAX_LINES} lines or more: {long}"
    strategies = {name: n for name, path in MODULES.items() if layer(name) == "parallel"
                  and (n := len(path.read_text().splitlines())) > MAX_STRATEGY_LINES}
    assert not strategies, f"strategy files over {MAX_STRATEGY_LINES} lines: {strategies}"


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
