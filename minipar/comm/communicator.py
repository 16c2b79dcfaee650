"""The communicator: one process group, its point-to-point calls and every collective's entry.

    world = comm.world()                       # all ranks, the watchdog running (watch.py)
    world.send(x, dest=1); world.recv(out, source=0)    # sendrecv; isend, irecv -> Request
    y = world.all_reduce(x, op="sum", algorithm="ring")
    # broadcast reduce reduce_scatter all_gather all_to_all(_v) gather scatter barrier,
    # iall_reduce -> Work, all_gather_object gather_object broadcast_object

Arrays go in, arrays come out (NumPy or CuPy: staging.py); collectives know nothing of tensors.
Each collective runs the algorithm named from the registry (allreduce.py, trees.py,
exchange.py, param_server.py, mpi.py), built from the point-to-point calls, so
``comm.counters`` and ``comm.trace = []`` see every byte. The theory, the channel of the
collectives and the errors each call raises: docs/comm.md.
"""
import functools
import numbers

from mpi4py import MPI

from minipar import backend
# the algorithm modules register themselves in this order (the order tables and lessons list)
from minipar.comm import allreduce, param_server, trees, exchange, mpi, nonblocking  # noqa: I001
from minipar.comm import agreement, chunks, node, watch
from minipar.comm.errors import CommError, dtype_tag
from minipar.comm.registry import pick
from minipar.comm.requests import Counters, Request  # noqa: F401  (Counters: re-exported)
from minipar.comm.buffers import array as _array
from minipar.comm.staging import cuda_aware
from minipar.comm.transfer import Transfer

_state = watch.state  # the collective in progress, for the watchdog (watch.py)
watch.install_abort_hook()  # from this import on, an uncaught exception ends the whole job


def _collective(method):
    """An entry point: refuses a non-array; clears the watchdog's note of the collective after."""
    @functools.wraps(method)
    def entry(self, x, *args, **kwargs):
        if x is not None:
            _array(x, method.__name__)
        try:
            return method(self, x, *args, **kwargs)
        finally:
            _state["collective"] = None
    return entry


class Communicator:
    """One process group: ``rank``, ``size``, point-to-point calls, counters and collectives."""

    def __init__(self, mpi_comm, parent=None, counters=None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._cuda_aware = None
        self._worker = None  # background thread of iall_reduce (nonblocking.AsyncWorker)
        self._scratch = {}  # reusable receive buffers of the collectives, by slot
        self.status = MPI.Status()  # reused by the blocking calls (one allocation less each)
        self.world_ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(self.size)),
                                                MPI.COMM_WORLD.Get_group())  # peers as world ranks
        self._calls = 0  # collective calls made so far: the number in each call's fingerprint
        if parent is None:
            self.counters = counters or Counters()
            self._log = {"trace": None}
            self.strict_tags = False
            # collectives talk on a private duplicate: their messages never match user p2p
            self.coll = Communicator(mpi_comm.Dup(), parent=self)
        else:  # the private channel shares its parent's counters and trace
            self.counters = parent.counters
            self._log = parent._log
            # every receive here checks the tag: the call's fingerprint (agreement.py)
            self.strict_tags = True
            self.coll = self
        if parent is None and self.size > 1:
            # the node layout now, while every rank is here anyway (Dup waits for them all):
            # asked at ``auto``'s first all-reduce, MPI's own collectives would go before the
            # call's fingerprinted messages, and a rank in another collective would hang there
            node.span(self)

    @property
    def trace(self):
        """None (off) or the list of ``transfer.Event(rank, op, peer, start, end, nbytes)``;
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
        self._cuda_aware = cuda_aware()[0] if self._cuda_aware is None else self._cuda_aware
        return self._cuda_aware

    def collective_tag(self, collective, algorithm, op, x, root=None, check=None):
        """The tag of this collective call's messages: the next call number and the call's
        fingerprint (agreement.py), noted for the watchdog; the dtype alone when not checking."""
        if check is False or (check is None and not agreement.ENABLED):
            return dtype_tag(x.dtype)
        number, self._calls = self._calls, self._calls + 1
        tag = agreement.encode(collective, algorithm, op, x.dtype, x.size, root, number)
        _state["collective"] = watch.Collective(collective, number, algorithm, op, root, x.dtype,
                                                x.size)
        return tag

    def scratch(self, slot, n, like):
        """A reusable work buffer of n elements of like's dtype (grown, never shrunk, per slot):
        the collectives' receive buffers, allocated once rather than on every call."""
        have = self._scratch.get(slot)
        if (have is None or have.size < n or have.dtype != like.dtype
                or type(have) is not type(like)):
            have = backend.get_array_module(like).empty(max(n, 1), like.dtype)
            self._scratch[slot] = have
        return have[:n]

    # -- point to point: each call's bookkeeping (buffers, watchdog, counters, trace) is its
    # Transfer (transfer.py); every message moves in chunks, one for a small buffer (chunks.py)
    def send(self, x, dest, tag=0):
        """Blocking send of array ``x`` to rank ``dest``."""
        dest = self.check_peer(dest)
        with Transfer(self, "send", dest, send=x, tag=tag) as t:
            chunks.send(self.mpi, t.sbuf, dest, tag)

    def recv(self, out, source, tag=0):
        """Blocking receive from rank ``source`` into ``out`` (its size must match); returns out."""
        source = self.check_peer(source)
        with Transfer(self, "recv", source, recv=out, tag=tag) as t:
            chunks.recv(self.mpi, t.rbuf, source, t.match, t.status, t.check)
        return out

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=None):
        """Send ``x`` to ``dest`` and receive into ``out`` from ``source`` at once (no deadlock)."""
        dest, source = self.check_peer(dest), self.check_peer(source)
        recvtag = sendtag if recvtag is None else recvtag
        with Transfer(self, "sendrecv", (dest, source), send=x, recv=out, tag=recvtag) as t:
            chunks.sendrecv(self.mpi, t.sbuf, dest, sendtag, t.rbuf, source, t.match, t.status,
                            t.check)
        return out

    def isend(self, x, dest, tag=0):
        """Start sending ``x`` to ``dest``; returns a ``Request``. Do not modify x before wait()."""
        dest = self.check_peer(dest)
        request = Request(self, "isend", dest, send=x, tag=tag)
        return request.post(chunks.isend(self.mpi, request.sbuf, dest, tag), x)

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` from ``source``; returns a ``Request`` (wait() gives out)."""
        source = self.check_peer(source)
        request = Request(self, "irecv", source, recv=out, tag=tag)
        return request.post(chunks.irecv(self.mpi, request.rbuf, source, request.match), out)

    # -- small Python objects (metadata, checks, timings: pickled by mpi4py, not counted) ------
    # MPI's own collectives: noted for the watchdog, so a rank that skips one is named
    def all_gather_object(self, obj):
        """Every rank's ``obj``, as a list in rank order, on every rank (torch's name)."""
        with watch.blocking("all_gather_object", self.world_ranks):
            return self.mpi.allgather(obj)

    def gather_object(self, obj, root=0):
        """Every rank's ``obj`` as a list in rank order on ``root``; None elsewhere."""
        with watch.blocking("gather_object", self.world_ranks):
            return self.mpi.gather(obj, root=root)

    def broadcast_object(self, obj, root=0):
        """``root``'s ``obj`` on every rank (the others' argument is ignored)."""
        with watch.blocking("broadcast_object", self.world_ranks):
            return self.mpi.bcast(obj, root=root)

    def barrier(self):
        """Wait until every rank of this communicator arrives (MPI's barrier; moves no data)."""
        with Transfer(self, "barrier", None):
            self.mpi.Barrier()

    # -- collectives: each runs the algorithm named (registry.py), its formula beside its code --
    @_collective
    def all_reduce(self, x, op="sum", algorithm="auto", out=None, check=None):
        """Every rank gets op(x_0, ..., x_{p-1}) elementwise (op: sum, avg, max, min, prod);
        ``out=x`` reduces in place; ``auto`` picks the algorithm the cost model favours."""
        return allreduce.all_reduce(self, x, op, algorithm, out, check)

    def iall_reduce(self, x, op="sum", algorithm="auto", out=None):
        """Start an all-reduce and return a ``Work`` at once; x must not change until
        ``wait()``. ``mpi`` is MPI_Iallreduce; a hand-coded one runs on a background thread."""
        if algorithm == "mpi":
            return nonblocking.iall_reduce_mpi(self, x, op, out)
        pick("all_reduce", "ring" if algorithm == "auto" else algorithm, op)
        return nonblocking.worker(self).start("all_reduce", x, op=op, algorithm=algorithm, out=out)

    @_collective
    def broadcast(self, x, root=0, algorithm="binomial", out=None, check=None):
        """Every rank gets root's x (the others pass an array of the same shape, or ``out``)."""
        return trees.broadcast(self, x, root, algorithm, out, check)

    @_collective
    def reduce(self, x, root=0, op="sum", algorithm="binomial", out=None, check=None):
        """Root gets op(x_0, ..., x_{p-1}); the other ranks get None."""
        return trees.reduce(self, x, root, op, algorithm, out, check)

    @_collective
    def reduce_scatter(self, x, op="sum", algorithm="ring", out=None, check=None):
        """Rank r gets chunk r (``chunk_bounds``) of op(x_0, ..., x_{p-1}) flattened."""
        return exchange.reduce_scatter(self, x, op, algorithm, out, check)

    @_collective
    def all_gather(self, x, algorithm="ring", out=None, check=None):
        """Every rank gets the stack [x_0, ..., x_{p-1}] of shape (p, *x.shape)."""
        return exchange.all_gather(self, x, algorithm, out, check)

    @_collective
    def all_to_all(self, x, algorithm="pairwise", out=None, check=None):
        """x of shape (p, ...): row j goes to rank j; rank r gets [x_0[r], ..., x_{p-1}[r]]."""
        return exchange.all_to_all(self, x, algorithm, out, check)

    @_collective
    def all_to_all_v(self, x, send_counts, recv_counts=None, algorithm="pairwise", check=None):
        """Rows by peer: send_counts[j] rows go to rank j; returns those received, rank 0's first."""
        return exchange.all_to_all_v(self, x, send_counts, recv_counts, algorithm, check)

    @_collective
    def gather(self, x, root=0, algorithm="linear", out=None, check=None):
        """Root gets the stack [x_0, ..., x_{p-1}]; the other ranks get None."""
        return exchange.gather(self, x, root, algorithm, out, check)

    @_collective
    def scatter(self, x, root=0, algorithm="linear", out=None, check=None):
        """Rank r gets row r of root's x of shape (p, ...) (others: x of that shape, or out)."""
        return exchange.scatter(self, x, root, algorithm, out, check)


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
