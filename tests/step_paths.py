"""The path a student walks into one step, measured: which files of ``minipar/comm`` and
``minipar/parallel`` run during the step (in the order they are first entered), and how many
minipar frames stand on the stack at the first call into MPI.

    mpiexec -n 2 python tests/step_paths.py          # prints the four paths on rank 0

A tracer (``sys.settrace``, and ``threading.settrace`` for the threads a step starts) sees
every Python call and every line of minipar; a line calling a method of an mpi4py
communicator, request or window is a call into MPI. Each path runs once to warm up (caches,
scratch buffers, the worker thread) and is measured on the second run. test_layers.py holds
the figures.
"""
import ast
import functools
import linecache
import os
import re
import sys
import threading

import numpy as np
from mpi4py import MPI

import minipar
from minipar import comm, nn, optim

PACKAGE = os.path.dirname(os.path.abspath(minipar.__file__))
WATCHED = (os.path.join(PACKAGE, "comm") + os.sep, os.path.join(PACKAGE, "parallel") + os.sep)


def _receiver(node, frame):
    """The object a call's ``a.b.c`` receiver names in ``frame`` (None: not a plain name chain)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    value = frame.f_locals.get(node.id, frame.f_globals.get(node.id))
    for name in reversed(names):
        value = getattr(value, name, None)
    return value


@functools.lru_cache(maxsize=None)
def _calls(filename, line):
    """(receiver expression, method name) of each method call on a line of source."""
    text = linecache.getline(filename, line).strip()
    try:
        tree = ast.parse(text.rstrip(":") if text.endswith(":") else text)
    except SyntaxError:  # a line that is part of a longer statement: parse its calls alone
        tree = ast.parse("\n".join(re.findall(r"[\w.]+\.[A-Z]\w*\([^()]*", text) and
                                   [m + ")" for m in re.findall(r"[\w.]+\.[A-Z]\w*\(", text)]
                                   or []) or "pass")
    return [(node.func.value, node.func.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]


def _calls_mpi(frame):
    # a method of an mpi4py communicator, request, window or message, or of its class (a
    # Status or a Datatype only describes: not a call into MPI). mpi4py's methods are Cython
    # functions, which a profiler does not see: the line that calls one is found instead
    for receiver, _ in _calls(frame.f_code.co_filename, frame.f_lineno):
        owner = _receiver(receiver, frame)
        kind = owner if isinstance(owner, type) else type(owner)
        if (getattr(kind, "__module__", None) == "mpi4py.MPI"
                and not issubclass(kind, (MPI.Status, MPI.Datatype))):
            return True
    return False


class PathTrace:
    """Tracer: ``files`` (paths under minipar/comm and minipar/parallel, in first-call order)
    and ``frames`` (the minipar frames between the step's caller and the main thread's first
    line that calls MPI, outermost first) while ``on``."""

    def __init__(self):
        self.files, self.frames, self.on = [], None, False
        self.main = threading.main_thread()

    def __call__(self, frame, event, arg):
        if not self.on:
            return None
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(WATCHED) and name not in self.files:
            self.files.append(name)
        if self.frames is None and name.startswith(PACKAGE + os.sep):
            return self.line
        return None

    def line(self, frame, event, arg):
        if (event == "line" and self.on and self.frames is None
                and threading.current_thread() is self.main and _calls_mpi(frame)):
            stack = []  # minipar's frames, up to the step's own caller (this file's)
            while frame is not None and frame.f_code.co_filename.startswith(PACKAGE + os.sep):
                stack.append(f"{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:"
                             f"{frame.f_code.co_name}")
                frame = frame.f_back
            self.frames = stack[::-1]
        return self.line if self.frames is None else None


def measure(step):
    """{"files": [...], "frames": [...]} of the second call of ``step()``."""
    trace = PathTrace()
    sys.settrace(trace)
    threading.settrace(trace)
    try:
        step()
        comm.world().barrier()
        trace.on = True
        step()
        trace.on = False
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return {"files": [os.path.relpath(f, PACKAGE) for f in trace.files],
            "frames": trace.frames or []}


def ring_all_reduce():
    world = comm.world()
    x = np.arange(1000.0)
    return measure(lambda: world.all_reduce(x, algorithm="ring"))


def ddp_step():
    from minipar.parallel.data import DistributedDataParallel
    world = comm.world()
    minipar.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                                    world)
    opt = optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(world.rank)
    x, y = (minipar.Tensor(rng.standard_normal(shape).astype("float32"))
            for shape in ((6, 8), (6, 4)))

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return measure(step)


def one_f_one_b_step():
    from minipar.parallel.pipeline import Pipeline, build
    world = comm.world()
    minipar.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = Pipeline(layers, build("1f1b", world.size, 4), world,
                    lambda out, target: ((out - target) ** 2).mean(),
                    optimizer=lambda ps: optim.SGD(ps, lr=0.1))
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((8, 8)).astype("float32") for _ in range(2))
    return measure(lambda: pipe.step(x, y))


def parallel_mlp():
    from minipar.parallel.tensor.layers import ParallelMLP
    world = comm.world()
    minipar.manual_seed(0)
    mlp = ParallelMLP(8, world)
    x = minipar.Tensor(np.random.default_rng(0).standard_normal((2, 3, 8)).astype("float32"),
                       requires_grad=True)

    def step():
        mlp(x).sum().backward()
    return measure(step)


PATHS = {"1F1B step": one_f_one_b_step, "DDP step": ddp_step,
         "ring all-reduce": ring_all_reduce, "ParallelMLP forward + backward": parallel_mlp}


def all_paths():
    """Every path, measured on this rank."""
    return {name: path() for name, path in PATHS.items()}


if __name__ == "__main__":
    found = all_paths()
    if comm.world().rank == 0:
        for name, path in found.items():
            print(f"{name}: {len(path['files'])} files, {len(path['frames'])} frames")
            print("  files:  " + ", ".join(path["files"]))
            print("  frames: " + " > ".join(path["frames"]))
