"""Which ranks share this machine: the node-local rank and size, how many nodes there are, and
what that means for data parallelism's overlap (whether a core is left idle for it).

    local = node.local(comm.mpi)     # Local(rank=1, size=4, nodes=2): rank 1 of the 4 on my node
    on, why = node.overlap_default(comm)   # DDP's overlap="auto": on where a core is idle

``MINIPAR_RANKS_PER_NODE=k`` cuts each real node into "nodes" of k consecutive ranks, so one
machine can play a cluster (the tests of the hierarchical all-reduce do; the ranks still share
memory, they just do not use it across the cut).
"""
import os
import socket
import weakref
from collections import namedtuple

from mpi4py import MPI

from minipar.comm import watch

Local = namedtuple("Local", "rank size nodes")


def ranks_per_node():
    """k from ``MINIPAR_RANKS_PER_NODE`` (pretend nodes of k ranks), or None: the real nodes."""
    value = os.environ.get("MINIPAR_RANKS_PER_NODE", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MINIPAR_RANKS_PER_NODE must be a positive integer, got {value!r}")
    return int(value)


def shared(mpi_comm):
    """The mpi4py communicator of the ranks of ``mpi_comm`` on this rank's node, in the order of
    their ranks in ``mpi_comm`` (collective; the caller frees it). With MINIPAR_RANKS_PER_NODE=k
    a node's ranks are cut into groups of k."""
    # MPI_Comm_split_type(COMM_TYPE_SHARED) splits a communicator into groups of ranks that can
    # share memory, i.e. one group per node, with any MPI and any launcher: a rank's rank in its
    # group is its local rank, and counting the groups' rank 0s gives the number of nodes. The
    # same groups carry the shared-memory all-reduce (shm.py, hierarchical.py).
    with watch.blocking("split by node", watch.world_ranks(mpi_comm)):
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
        k = ranks_per_node()
        if k is None:
            return node
        try:
            return node.Split(node.Get_rank() // k, key=node.Get_rank())
        finally:
            node.Free()


def local(mpi_comm=None):
    """``Local(rank, size, nodes)``: this rank's place among the ranks of its node, their
    number, and the number of nodes ``mpi_comm`` (default MPI.COMM_WORLD) spans. Collective:
    every rank of ``mpi_comm`` calls it (comm.world() does, once, and hands the local rank to
    backend.select_gpu: backend imports nothing of minipar, so it is told, not asked)."""
    # A node's GPUs are numbered 0, 1, ... on that node, so a rank picks its GPU by its place
    # among the ranks of its own node, not by its world rank (world rank 5 of 8 on two nodes of
    # 4 is the second rank of the second node: GPU 1). The world rank cannot tell which ranks
    # share a node: mpiexec may place ranks in blocks or round robin, Slurm by its own
    # distribution, and a hostfile may give nodes different slot counts. Launcher variables
    # (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID) say it, each launcher its own
    # way. MPI itself knows, with any launcher: see shared().
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    node = shared(mpi_comm)
    try:
        rank, size = node.Get_rank(), node.Get_size()
        # a node is named by the least world rank on it, the same name from every rank
        first = min(watch.world_ranks(node))
    finally:
        node.Free()
    with watch.blocking("count of nodes", watch.world_ranks(mpi_comm)):
        firsts = mpi_comm.allgather(first)
    if ranks_per_node() is None and len(firsts) == MPI.COMM_WORLD.Get_size():
        _node_of.update(zip(watch.world_ranks(mpi_comm), firsts))
    return Local(rank, size, len(set(firsts)))


# world rank -> the least world rank on its node, as local() learnt them on the whole world
# (real nodes only: MINIPAR_RANKS_PER_NODE cuts each communicator's ranks in its own order)
_node_of = {}
_spans = weakref.WeakKeyDictionary()  # Communicator -> the number of nodes its ranks span


def span(comm):
    """How many nodes the ranks of Communicator ``comm`` span: what ``auto`` asks before it
    weighs the shared-memory all-reduces. Counted from what ``local`` learnt (comm.world()
    calls it), else by ``local`` on ``comm``, a collective: the Communicator asks when it is
    made, so that no collective call's first message waits behind one of MPI's."""
    if comm not in _spans:
        if ranks_per_node() is None and all(r in _node_of for r in comm.world_ranks):
            _spans[comm] = len({_node_of[r] for r in comm.world_ranks})
        else:
            _spans[comm] = local(comm.mpi).nodes
    return _spans[comm]


LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")  # the job's ranks on this node


def choose_overlap(comm, choice="auto"):
    """(overlap, why) for DistributedDataParallel's ``overlap`` argument: True or False as
    given, ``"auto"`` as ``overlap_default`` decides; anything else is a ValueError."""
    if choice not in (True, False, "auto"):
        raise ValueError(f"rank {comm.rank}: DistributedDataParallel: overlap must be "
                         f"True, False or 'auto', got {choice!r}")
    if choice == "auto":
        return overlap_default(comm)
    return choice, f"overlap={choice} given"


def usable_cores():
    """The cores this process may run on: its CPU affinity mask (``os.sched_getaffinity``),
    else all of the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def overlap_default(comm):
    """(overlap, why) for ``overlap="auto"``: on when every node has a usable core that none of
    the job's ranks uses (for the background all-reduce), else off. Usable cores are the CPU
    affinity masks of ``comm``'s ranks on the node together (``os.sched_getaffinity``, else
    ``os.cpu_count``); the ranks are the job's on the node as the launcher tells them (MPICH's
    MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE: a DDP over a sub-group shares the
    node with the other groups), else ``comm``'s."""
    # The background all-reduce is CPU work (copies, adds, MPI polling for the peer), so it hides
    # behind backward only on a core that backward does not use; where some node has none idle,
    # overlap takes compute's core and costs more than it hides (scripts/bench_dp.py and lesson
    # 05 measure both).
    cores = usable_cores()
    job = max([int(os.environ[v]) for v in LOCAL_SIZE if os.environ.get(v, "").isdigit()] or [0])
    nodes = {}
    # one all_gather_object, so every rank takes the same decision (blocking and non-blocking
    # collectives must not meet)
    for host, mask, local_size in comm.all_gather_object((socket.gethostname(), sorted(cores),
                                                          job)):
        ranks, usable, most = nodes.get(host, (0, set(), 0))
        nodes[host] = ranks + 1, usable | set(mask), max(most, local_size)
    nodes = [(max(ranks, most), usable) for ranks, usable, most in nodes.values()]
    ranks, usable = max(nodes, key=lambda node: node[0] - len(node[1]))  # the busiest node
    idle = len(usable) - ranks
    if idle > 0:
        return True, (f"overlap on: {ranks} rank(s) on {len(usable)} usable cores leave {idle} "
                      f"idle for the background all-reduce")
    return False, (f"overlap off: {ranks} rank(s) on {len(usable)} usable cores leave no core "
                   f"idle, so the background all-reduce would take compute's core (overlap=True "
                   f"forces it; scripts/bench_dp.py measures both)")
