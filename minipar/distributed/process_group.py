"""torch.distributed's process groups over minipar's communicator (MPI underneath).

    import minipar.distributed as dist
    dist.init_process_group(backend="mpi")              # under mpiexec: every rank calls it
    rank, world_size = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([0, 2])                      # every rank calls it, as in torch

The names and signatures follow torch.distributed; ``backend`` may also say ``"gloo"`` or
``"nccl"`` (a torch script unchanged), and every group runs over MPI (``get_backend()`` says so).
Ranks given to the collectives (``src``, ``dst``) are ranks of the world, as in torch; a group's
own numbering is ``get_group_rank``. The all-reduce that runs: ``init_process_group``'s
``all_reduce_algorithm=NAME``, else ``$MINIPAR_ALLREDUCE``, else ``"auto"`` (the cost model's
choice among minipar's hand-coded ones); NAME is any entry of
``minipar.comm.ALGORITHMS["all_reduce"]``, a student's own too (``_algorithm`` below).
"""
import datetime
import enum
import os
import sys
import traceback
import warnings

BACKENDS = ("mpi", "gloo", "nccl")  # names torch scripts pass; all of them run over MPI here
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # MPICH, Open MPI, PMIx


def launched_rank():
    """This process's rank when ``mpiexec`` started it (read from the environment, before MPI is
    initialised, as torch's env:// reads RANK), else None."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return None


def _uncaught_before_init(exc_type, exc, tb):
    """A launched rank's traceback before minipar.comm starts MPI, each line prefixed with the
    rank as after (comm/watch.py's abort hook, which replaces this one); then the whole job
    ends: a peer already inside MPI's start-up (init_process_group) waits there for this rank,
    so this rank starts MPI too and aborts the job (``end_the_job``)."""
    rank = launched_rank()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
    sys.stderr.flush()
    end_the_job(rank)


# seconds a failing rank waits for its peers to reach MPI's start-up before it leaves alone
START_UP_WAIT = 30.0


def end_the_job(rank):
    """MPI_Abort from a rank that never started MPI: MPI_Init pairs with the peers' (those
    waiting in init_process_group), then the abort ends them all. A peer that never starts MPI
    would keep MPI_Init waiting: after START_UP_WAIT seconds this rank exits with status 1."""
    import threading
    import time

    def leave():
        time.sleep(START_UP_WAIT)
        sys.stderr.write(f"[rank {rank}] no peer started MPI within {START_UP_WAIT:g} s: this "
                         f"rank exits alone (status 1)\n")
        sys.stderr.flush()
        os._exit(1)
    threading.Thread(target=leave, daemon=True).start()
    from mpi4py import MPI
    time.sleep(0.5)  # mpiexec forwards output asynchronously; an abort at once can lose it
    MPI.COMM_WORLD.Abort(1)


# minipar.comm, imported by init_process_group, starts MPI, so the launched rank is all there is
# to name a rank by until then (a hook of the program's own stays)
if launched_rank() is not None and sys.excepthook is sys.__excepthook__:
    sys.excepthook = _uncaught_before_init


class ReduceOp(enum.Enum):
    """torch.distributed.ReduceOp; the value is the communicator's name of the op."""
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "prod"


def op_name(op):
    """The communicator's name of a ``ReduceOp`` (or of its name as a string, any case)."""
    if isinstance(op, ReduceOp):
        return op.value
    names = {m.name.lower(): m.value for m in ReduceOp} | {m.value: m.value for m in ReduceOp}
    if isinstance(op, str) and op.lower() in names:
        return names[op.lower()]
    raise ValueError(f"unknown reduction op {op!r}: use ReduceOp.SUM, AVG, MAX, MIN or PRODUCT")


class ProcessGroup:
    """A set of world ranks and, on its members, their communicator (None on the others)."""

    def __init__(self, comm, ranks, algorithm):
        self.comm, self.ranks, self.algorithm = comm, list(ranks), algorithm

    def rank(self):
        """This process's rank in the group (-1 when it is not a member)."""
        return -1 if self.comm is None else self.comm.rank

    def size(self):
        return len(self.ranks)

    def __repr__(self):
        return f"ProcessGroup(ranks={self.ranks}, all_reduce={self.algorithm!r})"


class group:  # noqa: N801  (torch's name: dist.group.WORLD)
    """``group.WORLD``: the default group; None names it in every call, as here."""
    WORLD = None


_state = {"world": None, "groups": []}


def _timeout_s(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return timeout


# A student's own ring, registered before init_process_group, runs under an unchanged script:
#
#     from minipar.comm.registry import algorithm
#     @algorithm("all_reduce", "my_ring", 15)   # 15: its number in the fingerprint, not taken
#     def my_ring(c, x, buf, op):   # c: the collectives' wire.Wire, x: flat input, buf: result
#         ...
#     # MINIPAR_ALLREDUCE=my_ring mpiexec -n 4 python train.py
def _algorithm(name):
    """The all-reduce to run: ``name``, ``$MINIPAR_ALLREDUCE`` or auto (checked against the
    registry, so a typo fails at start-up with the valid names)."""
    from minipar.comm.registry import pick
    name = name or os.environ.get("MINIPAR_ALLREDUCE") or "auto"
    if name != "auto":
        pick("all_reduce", name)
    return name


def _backend_name(backend):
    """``"mpi"`` for ``"mpi"``, ``"cpu:mpi"``, ``Backend.MPI`` (None: torch's default, gloo)."""
    return "gloo" if backend is None else str(backend).split(":")[-1].lower()


def init_process_group(backend="mpi", init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None, *,
                       all_reduce_algorithm=None):
    """Start the default group of every rank of the MPI job (every rank calls it).

    ``init_method``, ``store``, ``group_name``, ``pg_options`` and ``device_id`` are accepted
    and ignored (mpiexec has already connected the ranks); ``world_size`` and ``rank``, when
    given, must agree with the job (with ``"mpi"``, as torch, a warning says they are ignored).
    ``timeout`` (seconds or a timedelta) sets the watchdog that ends a job making no progress
    (``minipar.comm.world``)."""
    if _state["world"] is not None:
        raise RuntimeError("init_process_group: the default process group is already "
                           "initialized (call destroy_process_group() first)")
    if backend is not None and _backend_name(backend) not in BACKENDS:
        raise ValueError(f"init_process_group: backend {backend!r} is not one of "
                         f"{', '.join(BACKENDS)} (all run over MPI)")
    algorithm = _algorithm(all_reduce_algorithm)
    from minipar import comm
    world = comm.world(_timeout_s(timeout))
    disagree = [(what, asked, real) for asked, real, what in
                ((world_size, world.size, "world_size"), (rank, world.rank, "rank"))
                if asked not in (-1, None) and asked != real]
    if disagree and _backend_name(backend) == "mpi":
        # torch's MPI backend takes rank and size from the MPI launch and warns (the tutorial
        # passes rank=0, world_size=0); a gloo or nccl script means them, and they must agree
        warnings.warn("init_process_group: for the MPI backend, world_size and rank are "
                      "assigned by the MPI launch: " + ", ".join(
                          f"{what}={asked} ignored, the launch says {real}"
                          for what, asked, real in disagree), stacklevel=2)
    elif disagree:
        what, asked, real = disagree[0]
        raise ValueError(f"init_process_group: {what}={asked} but the MPI job says {real} "
                         f"(start the job with mpiexec -n N; minipar reads rank and size "
                         f"from MPI)")
    _state["world"] = ProcessGroup(world, range(world.size), algorithm)


def is_available():
    return True


def is_mpi_available():
    return True


def is_initialized():
    return _state["world"] is not None


def _default():
    if _state["world"] is None:
        raise RuntimeError("Default process group has not been initialized, please make sure "
                           "to call init_process_group.")
    return _state["world"]


def resolve(group):
    """The ProcessGroup a call names (None: the default one)."""
    world = _default()
    if group is None:
        return world
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group, got {type(group).__name__}")
    if group is not world and group not in _state["groups"]:
        raise RuntimeError("this process group was destroyed (destroy_process_group)")
    return group


def get_rank(group=None):
    """This process's rank in ``group`` (default: the world); -1 when not a member."""
    return resolve(group).rank()


def get_world_size(group=None):
    return resolve(group).size()


def get_backend(group=None):
    resolve(group)
    return "mpi"


def get_all_reduce_algorithm(group=None):
    """The name of the all-reduce the group runs (``auto``: the cost model chooses per call)."""
    return resolve(group).algorithm


def get_process_group_ranks(group):
    return list(resolve(group).ranks)


def get_global_rank(group, group_rank):
    return resolve(group).ranks[group_rank]


def get_group_rank(group, global_rank):
    ranks = resolve(group).ranks
    if global_rank not in ranks:
        raise ValueError(f"rank {global_rank} is not in the group {ranks}")
    return ranks.index(global_rank)


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True,
              *, all_reduce_algorithm=None):
    """A group of the world ``ranks`` (default: all), numbered in sorted order (or as given,
    ``sort_ranks=False``), as in torch.

    Every rank of the world calls it; the others get a group they are not a member of
    (``get_rank(group) == -1``; collectives on it do nothing and return None). The group runs the
    world's all-reduce unless ``all_reduce_algorithm`` names another."""
    world = _default()
    ranks = list(range(world.size())) if ranks is None else [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks {ranks} repeat a rank")
    ranks = sorted(ranks) if sort_ranks else ranks
    algorithm = _algorithm(all_reduce_algorithm) if all_reduce_algorithm else world.algorithm
    group = ProcessGroup(world.comm.group(ranks), ranks, algorithm)
    _state["groups"].append(group)
    return group


def destroy_process_group(group=None):
    """Forget ``group``, or every group and the default one (then init_process_group may run
    again)."""
    if group is None:
        _state["world"], _state["groups"] = None, []
    elif group in _state["groups"]:
        _state["groups"].remove(group)
