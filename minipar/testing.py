"""Run a function or a script on N ranks under mpiexec from a plain pytest run.

    from minipar.testing import run_on_ranks

    def body(n):                       # runs on every rank
        from minipar import comm
        world = comm.world()
        ...                            # assert freely; return something JSON-able (or None)

    def test_body():                   # runs in pytest, launches the ranks
        values = run_on_ranks(body, nprocs=4, args=(10,))   # one value per rank

A failing rank's traceback, a crash or a hang (with the call each rank is blocked in) comes back
as one ``AssertionError``: nothing hangs. Also the serial twins the parallel layouts must equal.
"""
import importlib
import importlib.util
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# One BLAS/OpenMP thread per rank. MPICH busy-polls while it waits and calls sched_yield every
# 1000 polls by default, which measured best for message-bound tests on 2 cores with 8 ranks.
# heavy_yield=True sets MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (waiting ranks sleep instead): a rank
# computing while 7 others wait ran 2x faster, but every message became 3-7x slower, so it suits
# compute-bound bodies (training steps with idle ranks), not collective tests.
RANK_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def mpiexec():
    """The mpiexec to use: $MINIPAR_MPIEXEC, the one beside this Python (the mpich wheel's), or PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = os.environ.get("MINIPAR_MPIEXEC") or (beside if os.path.exists(beside) else None) \
        or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: pip install 'minipar[mpi]' (the mpich wheel) or "
                           "set MINIPAR_MPIEXEC")
    return found


_FLAVOURS = {}


def launcher_flavour(launcher=None):
    """("openmpi" | "mpich" | "unknown", first line of ``launcher --version``), cached per path."""
    launcher = launcher or mpiexec()
    if launcher not in _FLAVOURS:
        try:
            text = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                                  timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        lower = text.lower()
        flavour = ("openmpi" if "open mpi" in lower or "open-mpi" in lower or "openrte" in lower
                   or "prrte" in lower else "mpich" if "hydra" in lower or "mpich" in lower
                   else "unknown")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        versioned = [line for line in lines if re.search(r"version.*\d", line, re.I)]
        _FLAVOURS[launcher] = (flavour, (versioned or lines or [""])[0])
    return _FLAVOURS[launcher]


def launch_command(nprocs, *program):
    """``[mpiexec, *flags, "-n", N, *program]``: the launcher profile shared by run_on_ranks,
    run_job, the benchmark and ``minipar lesson``. Flags: ``$MINIPAR_MPIEXEC_ARGS`` (shlex-split,
    e.g. ``--hostfile hosts``), and for Open MPI ``--oversubscribe`` when N exceeds the cores
    (and no hostfile names the slots) and ``--allow-run-as-root`` when running as root."""
    launcher = mpiexec()
    flags = shlex.split(os.environ.get("MINIPAR_MPIEXEC_ARGS", ""))
    if launcher_flavour(launcher)[0] == "openmpi":
        hosts = any(f.startswith(("--hostfile", "-hostfile", "--machinefile", "--host", "-H"))
                    for f in flags)
        if int(nprocs) > (os.cpu_count() or 1) and not hosts and "--oversubscribe" not in flags:
            flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-run-as-root" not in flags:
            flags.append("--allow-run-as-root")
    return [launcher, *flags, "-n", str(nprocs), *map(str, program)]


class RankValues(list):
    """The per-rank return values (a plain list to compare), plus ``outputs[r]``: what rank r
    printed (stdout and stderr), and ``printed()``: all of it, each line prefixed ``[rank r]``."""

    outputs = ()

    def printed(self):
        return "".join(f"[rank {r}] {line}\n" for r, text in enumerate(self.outputs)
                       for line in text.splitlines())


def _target_name(target, folder):
    """'file.py:function' for a function defined in a file, 'pickle:PATH' for one defined in
    ``__main__`` or a notebook cell (serialised with cloudpickle), else the target string."""
    if not callable(target):
        return str(target)
    code = target.__code__
    in_file = os.path.isfile(code.co_filename) and "<" not in target.__qualname__
    if target.__module__ != "__main__" and in_file:
        return f"{os.path.abspath(code.co_filename)}:{target.__name__}"
    try:
        import cloudpickle
    except ImportError:
        if in_file:  # a script's own function: its file is loaded again on every rank
            return f"{os.path.abspath(code.co_filename)}:{target.__name__}"
        raise RuntimeError(
            f"run_on_ranks({target.__qualname__}): a function defined in a notebook cell or "
            f"__main__ is sent to the ranks with cloudpickle: pip install 'minipar[notebook]' "
            f"(or cloudpickle), or define the function in a .py file and import it") from None
    path = os.path.join(folder, "target.pkl")
    with open(path, "wb") as f:
        cloudpickle.dump(target, f)
    return "pickle:" + path


def run_on_ranks(target, nprocs, timeout=120, args=(), env=None, grace=2.0, heavy_yield=False,
                 show_output=False):
    """Run ``target(*args)`` on ``nprocs`` ranks; return the per-rank values (a ``RankValues``
    list, with what each rank printed). ``show_output=True`` prints the ranks' output here, each
    line prefixed ``[rank r]`` (what a notebook wants); ``env`` adds to ``RANK_ENV``.

    ``target`` is a function defined at the top level of a file, a string
    ``"package.module:function"`` or ``"path/to/file.py:function"``, or ``"path/to/script.py"``
    (run as ``__main__``). A function defined in a notebook cell or in ``__main__`` (a lambda, a
    closure) travels to the ranks pickled by value with cloudpickle (``pip install
    'minipar[notebook]'``).

    Each rank writes its result or its traceback to a temporary folder. ``AssertionError`` lists
    every failing rank with its traceback, and the ranks that left no result (killed when the job
    was aborted, or crashed), with the tail of the output; after ``timeout`` seconds it names the
    ranks that did not finish, each with the point-to-point call it is blocked in (op, peer,
    bytes) and its Python stacks, then kills the whole process group. A failing rank waits
    ``grace`` seconds for the others (so that all tracebacks are collected), then aborts the job.

    Group many cases into one launch (a body that loops over a table of cases and returns the
    failures) rather than one mpiexec per case: a launch costs about 0.3 s of start-up per rank
    count, and ranks beyond the cores share them."""
    shown = getattr(target, "__qualname__", None) or str(target)
    rank_env = {**os.environ, **RANK_ENV, **({"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
                                             if heavy_yield else {}), **(env or {})}
    # the ranks import the same minipar as this process, wherever they start
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rank_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, rank_env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="minipar-ranks-") as folder:
        name = _target_name(target, folder)
        if not name.startswith("pickle:"):
            shown = name
        command = launch_command(nprocs, sys.executable, "-m", "minipar.testing",
                                 folder, name, json.dumps(list(args)), str(grace))
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=rank_env, start_new_session=True, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            open(os.path.join(folder, "dump"), "w").close()  # ask every rank's watchdog
            time.sleep(1.5)
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        results = _read_results(folder, nprocs)
        values = RankValues(results[r].get("value") if r in results else None
                            for r in range(nprocs))
        values.outputs = [_read(folder, f"out{r}.txt") or "" for r in range(nprocs)]
        if show_output:
            print(values.printed(), end="", flush=True)
        missing = [r for r in range(nprocs) if r not in results]
        failed = {r: v for r, v in results.items() if not v["ok"]}
        if timed_out:
            dumps = "\n".join(_read(folder, f"stack{r}.txt") or f"rank {r}: no stack dump"
                              for r in missing)
            raise AssertionError(
                f"{shown} on {nprocs} ranks timed out after {timeout} s: ranks {missing} did not "
                f"finish" + _describe(failed) + f"\n--- where they are ---\n{dumps}"
                + _tail(output))
        if failed or missing or proc.returncode:
            lost = (f"\nranks {missing} left no result (killed when the job aborted, or crashed)"
                    if missing else "")
            raise AssertionError(f"{shown} failed on {nprocs} ranks (exit code {proc.returncode})"
                                 + _describe(failed) + lost + _tail(output))
        return values


def run_job(source, nprocs, timeout=60, env=None):
    """Run a script (its source text) as a plain ``mpiexec -n nprocs python script`` job, the
    way a student runs one: no harness around the ranks, so what minipar does on its own when
    something goes wrong is what happens. Returns (exit status, output, seconds); a job still
    running after ``timeout`` seconds is killed and reported with status None."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rank_env = {**os.environ, **RANK_ENV, **(env or {})}
    rank_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, rank_env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="minipar-job-") as folder:
        script = os.path.join(folder, "job.py")
        with open(script, "w") as f:
            f.write(source)
        start = time.monotonic()
        proc = subprocess.Popen(launch_command(nprocs, sys.executable, script),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=rank_env,
                                start_new_session=True, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, status = proc.communicate()[0], None
        return status, output, time.monotonic() - start


def _describe(failed):
    return "".join(f"\n--- rank {r} ---\n{v['traceback']}" for r, v in sorted(failed.items()))


def _tail(output, lines=40):
    kept = (output or "").strip().splitlines()[-lines:]
    return "\n--- output (last lines) ---\n" + "\n".join(kept) if kept else ""


def _read(folder, name):
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read()
    except OSError:
        return None


def _read_results(folder, nprocs):
    results = {}
    for r in range(nprocs):
        text = _read(folder, f"rank{r}.json")
        if text:
            results[r] = json.loads(text)
    return results


# ----------------------------------------------------------------------------------------------
# The rank side: python -m minipar.testing FOLDER TARGET ARGS_JSON GRACE
# ----------------------------------------------------------------------------------------------

def _load(name):
    """The callable (or, for a script, a function running it as __main__) named by target."""
    if name.startswith("pickle:"):
        import cloudpickle
        with open(name[len("pickle:"):], "rb") as f:
            return cloudpickle.load(f)
    if ":" not in name:
        return lambda *args: _run_script(name, args)
    where, function = name.rsplit(":", 1)
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(
            "_minipar_rank_" + os.path.basename(where)[:-3], where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, function)


def _run_script(path, args):
    """Run a script as ``__main__`` with ``args`` as its command line (``sys.argv[1:]``) and its
    folder first on ``sys.path``, as ``python path`` would (a lesson imports its ``_kit``).
    ``raise SystemExit(0)`` is a success, as for ``python path``; any other status fails."""
    sys.argv = [path, *(str(a) for a in args)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise


def _watchdog(folder, rank):
    """On the parent's request (a 'dump' file), write where this rank is blocked and its stacks."""
    import faulthandler

    from minipar.comm import waiting_on

    trigger = os.path.join(folder, "dump")
    while not os.path.exists(trigger):
        time.sleep(0.1)
    with open(os.path.join(folder, f"stack{rank}.txt"), "w") as f:
        f.write(f"rank {rank}: {waiting_on() or 'not inside a minipar call'}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)


class _Tee:
    """A text stream writing to ``stream`` and to the rank's output file."""

    def __init__(self, stream, copy):
        self.stream, self.copy = stream, copy

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.copy.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _write_json(folder, rank, record):
    path = os.path.join(folder, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, default=repr)
    os.replace(path + ".tmp", path)


def _rank_main(folder, name, args_json, grace):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    printed = open(os.path.join(folder, f"out{rank}.txt"), "w", buffering=1)
    sys.stdout, sys.stderr = _Tee(sys.stdout, printed), _Tee(sys.stderr, printed)
    threading.Thread(target=_watchdog, args=(folder, rank), daemon=True).start()
    try:
        record = {"ok": True, "value": _load(name)(*json.loads(args_json))}
    except BaseException:
        record = {"ok": False, "traceback": traceback.format_exc()}
    _write_json(folder, rank, record)
    # Everyone meets before leaving; a failed rank waits only `grace` seconds, then aborts the
    # job, because its peers may be blocked on a message it will never send.
    request = world.Ibarrier()
    deadline = time.monotonic() + grace
    while not request.Test():
        if not record["ok"] and time.monotonic() > deadline:
            sys.stderr.write(f"[minipar.testing] rank {rank} failed; aborting the job\n")
            world.Abort(1)
        time.sleep(0.001)
    return 0 if record["ok"] else 1



# ----------------------------------------------------------------------------------------------
# Serial twins: the oracles the parallel layouts are checked against
# ----------------------------------------------------------------------------------------------

def serial_losses(config, batches, make_optimizer=None, seed=0, dtype="float32"):
    """The serial GPT trained on the same global batches with the same seed: the losses a
    ``minipar.parallel.hybrid.Trainer3D`` run of any (dp, cp, tp, pp) layout must reproduce."""
    from minipar import nn, random  # here, not at the top: the launching process of
    from minipar.parallel.hybrid import default_optimizer  # run_on_ranks never loads MPI

    random.manual_seed(seed)
    model = nn.GPT(config).astype(dtype)
    return train_serial(model, (make_optimizer or default_optimizer)(model.parameters()), batches)


def train_serial(model, optimizer, batches):
    """Train a serial GPT one optimizer step per (ids, targets) batch; the losses, as floats."""
    losses = []
    for ids, targets in batches:
        model.zero_grad()
        _, loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
