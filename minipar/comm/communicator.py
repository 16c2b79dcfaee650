"""The communicator: one process group, its point-to-point calls and every collective's entry.

    world = comm.world()                       # all ranks, the watchdog running (watch.py)
    world.send(x, dest=1); world.recv(out, source=0)    # sendrecv; isend, irecv -> Request
    y = world.all_reduce(x, op="sum", algorithm="ring")
    # broadcast reduce reduce_scatter all_gather all_to_all(_v) gather scatter barrier,
    # iall_reduce -> Work, all_gather_object gather_object broadcast_object

Arrays go in, arrays come out (NumPy or CuPy); collectives know nothing of tensors. Each
collective's entry point is its algorithm module's (allreduce.py, trees.py, exchange.py), which
runs the algorithm named from the registry on ``coll``, the collectives' own channel. Every
message of either channel passes through one door, a ``wire.Wire`` (buffers, checks, the
watchdog's note), so ``comm.counters`` and ``comm.trace = []`` see every byte. The theory and
the errors each call raises: docs/comm.md.
"""
import numbers

from mpi4py import MPI

from minipar import backend
# the algorithm modules register themselves in this order (the order tables and lessons list)
from minipar.comm import allreduce, param_server, trees, exchange, mpi, nonblocking  # noqa: I001
from minipar.comm import node, watch
from minipar.comm.errors import CommError
from minipar.comm.registry import pick
from minipar.comm.wire import Counters, Wire

watch.install_abort_hook()  # from this import on, an uncaught exception ends the whole job


class Communicator:
    """One process group: ``rank``, ``size``, point-to-point calls, counters and collectives."""

    def __init__(self, mpi_comm, counters=None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._worker = None  # background thread of iall_reduce (nonblocking.AsyncWorker)
        self.world_ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(self.size)),
                                                MPI.COMM_WORLD.Get_group())  # peers as world ranks
        self.counters = counters or Counters()
        self._log = {"trace": None}
        # the user's point-to-point calls, with the tags they give
        self.wire = Wire(mpi_comm, self, strict=False)
        # collectives talk on a private duplicate: their messages never match user p2p, and
        # every receive there checks the tag, the call's fingerprint (agreement.py)
        self.coll = Wire(mpi_comm.Dup(), self, strict=True)
        # the nodes the ranks span (None on one rank), learnt now, while every rank is here
        # anyway (Dup waits for them all): asked at ``auto``'s first all-reduce, MPI's own
        # collectives would go before the call's fingerprinted messages, and a rank in another
        # collective would hang there
        self.nodes = node.span(self) if self.size > 1 else None

    @property
    def trace(self):
        """None (off) or the list of ``wire.Event(rank, op, peer, start, end, nbytes)``;
        assign [] to start."""
        return self._log["trace"]

    @trace.setter
    def trace(self, events):
        self._log["trace"] = events

    def __repr__(self):
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- sub-groups --------------------------------------------------------------------------
    def split(self, color, key=None):
        """Ranks with the same ``color`` form a new communicator, ordered by ``key`` (default rank)."""
        with watch.blocking("split", self.world_ranks):
            new = self.mpi.Split(color, self.rank if key is None else key)
        return Communicator(new)

    def group(self, ranks):
        """A communicator of ``ranks`` in that order (collective; ranks not listed get None)."""
        ranks = [int(r) for r in ranks]
        for r in ranks:
            self.check_peer(r)
        # MPI_Comm_create_group: collective over the ranks listed only
        with watch.blocking("group", [self.world_ranks[r] for r in ranks]):
            new = self.mpi.Create_group(self.mpi.Get_group().Incl(ranks))
        return None if new == MPI.COMM_NULL else Communicator(new)

    def dup(self, share_counters=False):
        """The same ranks, messages never matching this one's (``share_counters``: counted here)."""
        return Communicator(self.mpi.Dup(), counters=self.counters if share_counters else None)

    # -- checks ------------------------------------------------------------------------------
    def check_peer(self, peer):
        """``peer`` as an int (NumPy integers too), or a CommError unless it is a rank here."""
        if type(peer) is int and 0 <= peer < self.size:  # the common case, before the ABC check
            return peer
        if isinstance(peer, numbers.Integral) and not isinstance(peer, bool) and 0 <= peer < self.size:
            return int(peer)
        raise CommError(f"rank {self.rank}: peer rank {peer!r} out of range for a "
                        f"communicator of size {self.size} (valid ranks 0..{self.size - 1})")

    def is_cuda_aware(self):
        """Whether MPI takes this rank's GPU arrays as they are (else staged: staging.py)."""
        return self.coll.is_cuda_aware()

    # -- point to point: each the door's MPI call (wire.py), on a peer checked here ---------
    def send(self, x, dest, tag=0):
        """Blocking send of array ``x`` to rank ``dest``."""
        self.wire.Send(x, self.check_peer(dest), tag)

    def recv(self, out, source, tag=0):
        """Blocking receive from rank ``source`` into ``out`` (its size must match); returns out."""
        return self.wire.Recv(out, self.check_peer(source), tag)

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=None):
        """Send ``x`` to ``dest`` and receive into ``out`` from ``source`` at once (no deadlock)."""
        return self.wire.Sendrecv(x, self.check_peer(dest), out, self.check_peer(source),
                                  sendtag, recvtag)

    def isend(self, x, dest, tag=0):
        """Start sending ``x`` to ``dest``; returns a ``Request``. Do not modify x before wait()."""
        return self.wire.Isend(x, self.check_peer(dest), tag)

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` from ``source``; returns a ``Request`` (wait() gives out)."""
        return self.wire.Irecv(out, self.check_peer(source), tag)

    # -- small Python objects (metadata, checks, timings: pickled by mpi4py, not counted) ------
    # MPI's own collectives: noted for the watchdog, so a rank that skips one is named
    def all_gather_object(self, obj):
        """Every rank's ``obj``, as a list in rank order, on every rank (torch's name)."""
        return self.wire.allgather(obj)

    def gather_object(self, obj, root=0):
        """Every rank's ``obj`` as a list in rank order on ``root``; None elsewhere."""
        return self.wire.gather(obj, root)

    def broadcast_object(self, obj, root=0):
        """``root``'s ``obj`` on every rank (the others' argument is ignored)."""
        return self.wire.bcast(obj, root)

    def barrier(self):
        """Wait until every rank of this communicator arrives (MPI's barrier; moves no data)."""
        self.wire.Barrier()

    # -- collectives: each entry point is its algorithm module's, the formulas beside the code
    # all_reduce(x, op="sum", algorithm="auto", out=None, check=None): every rank gets
    # op(x_0, ..., x_{p-1}) elementwise; ``auto`` picks the algorithm the cost model favours
    all_reduce = allreduce.all_reduce
    # broadcast(x, root=0, algorithm="binomial", out=None, check=None): root's x everywhere
    broadcast = trees.broadcast
    # reduce(x, root=0, op="sum", algorithm="binomial", out=None, check=None): root gets the sum
    reduce = trees.reduce
    # reduce_scatter(x, op="sum", algorithm="ring", out=None, check=None): rank r gets chunk r
    reduce_scatter = exchange.reduce_scatter
    # all_gather(x, algorithm="ring", out=None, check=None): the stack [x_0, ..., x_{p-1}]
    all_gather = exchange.all_gather
    # all_to_all(x, algorithm="pairwise", out=None, check=None): row j of x goes to rank j
    all_to_all = exchange.all_to_all
    # all_to_all_v(x, send_counts, recv_counts=None, algorithm="pairwise", check=None)
    all_to_all_v = exchange.all_to_all_v
    # gather(x, root=0, algorithm="linear", out=None, check=None): the stack on root
    gather = exchange.gather
    # scatter(x, root=0, algorithm="linear", out=None, check=None): row r of root's x to rank r
    scatter = exchange.scatter

    def iall_reduce(self, x, op="sum", algorithm="auto", out=None):
        """Start an all-reduce and return a ``Work`` at once; x must not change until
        ``wait()``. ``mpi`` is MPI_Iallreduce; a hand-coded one runs on a background thread."""
        if algorithm == "mpi":
            return nonblocking.iall_reduce_mpi(self, x, op, out)
        pick("all_reduce", "ring" if algorithm == "auto" else algorithm, op)
        return nonblocking.worker(self).start("all_reduce", x, op=op, algorithm=algorithm, out=out)


_world = {}


def world(timeout=None):
    """The communicator of all ranks (``MPI.COMM_WORLD``) with the watchdog running (watch.py:
    ``timeout`` s without progress end the job; None: $MINIPAR_TIMEOUT or 120; 0: off), each
    rank on the GPU of its node-local rank (``.local``: node.py; ``.gpu``: None on the CPU)."""
    if "world" not in _world:
        watch.start(timeout)
        local = node.local(MPI.COMM_WORLD)  # every rank's node, so no communicator asks again
        comm = Communicator(MPI.COMM_WORLD)
        comm.local, comm.gpu = local, backend.select_gpu(local.rank)
        _world["world"] = comm
    elif timeout is not None:
        watch.set_timeout(timeout)
    return _world["world"]
