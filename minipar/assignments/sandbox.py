"""The sandbox a task's checks run in: its folder, its user, its processes, and its guard.

``lay_out`` writes the grader's copies (read-only to the task) beside a copy of the tree's
``minipar/`` (the task's own); ``run`` starts pytest there as a user of its own when the grader
is root (``own_uid``), its output into a file, and kills every process of the task after it.
This file is one of the copies: as the sandbox's ``sitecustomize.py``, every Python process of
the task (pytest, each rank) runs it at start-up, before the tree's code, and ``install`` makes
the harness (``COPIES``) the grader's copies, notes numpy's checkers, and
at exit turns a run that replaced one, or imported another minipar, into a failure.
"""
import atexit
import contextlib
import ctypes
import fcntl
import importlib.util
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy
import numpy.testing
from numpy.testing._private import utils as numpy_checks

STUCK_TIMEOUT = "15"  # MINIPAR_TIMEOUT for graded ranks: a stuck call prints who waits on whom
KEPT = 64 * 1024  # bytes of a task's output kept (its head and its tail)
FIRST_UID = 61000  # the sandbox users, one per task running at a time, when the grader is root


# --- outside: the folder, the user, the processes ---------------------------------------------
def lay_out(scratch, tree, uid, sources):
    """Fill the task's folder ``scratch``: the grader's files ``sources`` ({name: text}) in
    ``harness/``, read-only to the task, and a copy of the tree's package, its own, in ``tree/``."""
    scratch.chmod(0o755)  # the task's user passes through it to the folders it may use
    sources = {**sources, "pytest.ini": "[pytest]\n"}  # its own ini: the tree's never applies
    for name, text in sources.items():
        path = scratch / "harness" / name
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o644)
    # no bytecode: a stale .pyc can carry other code than the source the teacher reads
    shutil.copytree(tree / "minipar", scratch / "tree" / "minipar", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder in ("home", "report"):
        (scratch / folder).mkdir()
    for folder in ("tree", "home", "report") if uid is not None else ():
        for path in [scratch / folder, *(scratch / folder).rglob("*")]:
            os.chown(path, uid, uid, follow_symlinks=False)


def environment(scratch, token):
    """Only what the task needs: the teacher's minipar, thread and MPI settings, the harness
    first on the path."""
    env = {"MINIPAR_TIMEOUT": STUCK_TIMEOUT, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    env.update((k, v) for k, v in os.environ.items() if k.startswith((
        "MINIPAR_", "OMP_", "OPENBLAS_", "MKL_", "OMPI_", "PRTE_", "PMIX_", "MPIR_", "HYDRA_",
        "I_MPI_")) or k in ("PATH", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "TZ"))
    home = str(scratch / "home")
    env.update(HOME=home, TMPDIR=home, USER="minipar-grader",
               PYTHONPATH=os.pathsep.join([str(scratch / "harness"), str(scratch / "tree")]),
               # no folder of the command line first on sys.path, no user site, no plugin
               # found through an installed entry point: only what the grader names runs
               PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               MINIPAR_GRADE_TREE=str(scratch / "tree"), MINIPAR_GRADE_TOKEN=token)
    return env


@contextlib.contextmanager
def own_uid():
    """A uid no other grading run holds (a lock per uid), when the grader is root; else None,
    and the task runs as the grader's own user: then it could signal the grader and write its
    files, the limit of grading without root."""
    if os.geteuid() != 0:
        yield None
        return
    for uid in range(FIRST_UID, FIRST_UID + 1000):
        with open(f"{tempfile.gettempdir()}/minipar-grade-uid-{uid}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            _sweep(uid, None)  # what a grading run that crashed may have left
            yield uid
            return
    raise RuntimeError(f"no free sandbox uid in {FIRST_UID}..{FIRST_UID + 999}")


_libc = ctypes.CDLL(None, use_errno=True)
READ_SEARCH = 2  # CAP_DAC_READ_SEARCH: read any file and folder, write none, signal none


def _become(uid, read_all):
    """A preexec_fn making the child ``uid``, with no privilege left; with ``read_all``, keeping
    the right to read any file (an ambient capability, inherited by everything it starts),
    for an interpreter installed where other users cannot reach (/root/.pyenv here)."""
    def preexec():
        _libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: the capabilities survive setuid
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        kept = (1 << READ_SEARCH) if read_all else 0
        header, sets = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)(kept, kept, kept)
        if _libc.capset(header, sets) or (read_all and _libc.prctl(47, 2, READ_SEARCH, 0, 0)):
            raise OSError(ctypes.get_errno(), "capset")  # PR_CAP_AMBIENT_RAISE just above
        _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no set-uid program gives root back
    return preexec


_REACH = {}


def _out_of_reach(uid):
    """Whether ``uid`` cannot start this interpreter with its packages without reading rights."""
    if uid not in _REACH:
        try:
            probe = subprocess.run([sys.executable, "-c", "import numpy, pytest"],
                                   preexec_fn=_become(uid, False), cwd="/", timeout=120,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _REACH[uid] = probe.returncode != 0
        except OSError:
            _REACH[uid] = True
    return _REACH[uid]


def _sweep(uid, token):
    """Kill every process of a task: those of its uid, and those whose environment carries its
    token (without root, a child started with a cleared environment escapes this)."""
    for _ in range(200):
        victims = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                   if pid != os.getpid() and _of_task(pid, uid, token)]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _of_task(pid, uid, token):
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        if re.search(r"^State:\s+[ZX]", status, re.MULTILINE):  # dead already
            return False
        if uid is not None and int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)[1]) == uid:
            return True
        return token is not None and f"MINIPAR_GRADE_TOKEN={token}".encode() in \
            pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, TypeError):
        return False


def run(command, cwd, env, timeout, log, uid=None):
    """The exit status (None on timeout) of ``command`` run as ``uid``. Its output goes to the
    file ``log``, not a pipe (a child still holding a pipe would hold the grader); every process
    of the task is killed after it, ranks that left its process group included."""
    become = None if uid is None else _become(uid, _out_of_reach(uid))
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=become)
    try:
        return proc.wait(timeout=max(timeout, 0.01))
    except subprocess.TimeoutExpired:
        return None
    finally:
        _sweep(uid, env["MINIPAR_GRADE_TOKEN"])
        proc.wait()


def kept(log):
    """The output in ``log``, its middle cut beyond KEPT bytes."""
    with open(log, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if size <= KEPT:
            return f.read(KEPT).decode(errors="replace")
        head = f.read(KEPT // 4)
        f.seek(size - 3 * KEPT // 4)
        tail = f.read(3 * KEPT // 4)
    cut = f"\n[... {size - KEPT} bytes of output cut ...]\n".encode()
    return (head + cut + tail).decode(errors="replace")


# --- inside: the guard every Python process of the task runs first ----------------------------
HERE = os.path.dirname(os.path.abspath(__file__))
# the harness the checks import: a tree's own testing.py, gradcheck.py or feedback.py (made to
# pass everything) is never what grades it
COPIES = {name: os.path.join(HERE, "_minipar_grader", name.split(".")[-1] + ".py")
          for name in ("minipar.testing", "minipar.gradcheck", "minipar.assignments.feedback")}
# what a check's verdict rests on; replaced from the tree's code, every check would pass
WATCHED = ((numpy.testing, ("assert_allclose", "assert_array_equal", "assert_equal",
                            "assert_array_almost_equal", "assert_almost_equal")),
           (numpy_checks, ("assert_array_compare", "assert_allclose", "assert_array_equal")),
           (numpy, ("allclose", "isclose", "array_equal")))
FAILED = 70  # the exit status of a run the guard turns down (EX_SOFTWARE)


class HarnessFinder:
    """The import system's first finder: the harness modules come from the grader's copies."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in COPIES:
            return importlib.util.spec_from_file_location(name, COPIES[name])
        return None


def noted():
    """{(module, name): (function, its code)} of every watched checker, as it is now."""
    return {(module.__name__, name): (getattr(module, name),
                                      getattr(getattr(module, name), "__code__", None))
            for module, names in WATCHED for name in names}


def changes(before, tree=None):
    """What the code under test changed since ``before`` (noted()), one phrase each."""
    found = [f"it replaced {module}.{name}" for (module, name), (function, code) in before.items()
             if getattr(sys.modules[module], name, None) is not function
             or getattr(function, "__code__", None) is not code]
    for name, path in COPIES.items():
        loaded = getattr(sys.modules.get(name), "__file__", path)
        if loaded != path:
            found.append(f"its {name} is {loaded}, not the grader's copy")
    minipar = sys.modules.get("minipar")
    origin = os.path.realpath(getattr(minipar, "__file__", None) or "?")
    if tree and minipar is not None and not origin.startswith(os.path.realpath(tree) + os.sep):
        found.append(f"it imported minipar from {origin}, not from the submission")
    return found


def install():
    """Put the harness finder first and check, at exit, that nothing was replaced."""
    before, tree = noted(), os.environ.get("MINIPAR_GRADE_TREE")
    sys.meta_path.insert(0, HarnessFinder)

    @atexit.register
    def fail_if_changed():
        found = changes(before, tree)
        if found:  # written to the file descriptor: a rank's sys.stderr may be a wrapper
            os.write(2, f"\nminipar grader: this run counts as failed: {'; '.join(found)}\n"
                        .encode())
            os._exit(FAILED)


if __name__ == "sitecustomize":  # the copy in a task's sandbox, not this module when imported
    install()
