"""The communicator: one process group, its point-to-point messages, counters and collectives.

A ``Communicator`` wraps one mpi4py communicator. Every collective is built from its six
point-to-point calls, so the counters here see every byte a hand-coded collective moves:

    send(x, dest)         recv(out, source)          sendrecv(x, dest, out, source)
    isend(x, dest) -> Request        irecv(out, source) -> Request        barrier()

and every collective is a method declared here, running the algorithm chosen by name from the
registry (allreduce.py, trees.py, exchange.py, param_server.py, and MPI's own in mpi.py):

    all_reduce(x, op="sum", algorithm="auto", out=None, check=None)    iall_reduce(...) -> Work
    broadcast(x, root=0)   reduce(x, root=0, op=)   reduce_scatter(x, op=)   all_gather(x)
    all_to_all(x)   all_to_all_v(x, send_counts)   gather(x, root=0)   scatter(x, root=0)
    all_gather_object(obj)   gather_object(obj, root=0)   broadcast_object(obj, root=0)

Arrays go in, arrays come out (NumPy or CuPy: staging.py); collectives know nothing of tensors.
Collectives talk on a private duplicate channel (``coll``) whose every receive checks the tag,
which carries the call's fingerprint (agreement.py): ranks that disagree on the collective, the
algorithm, the op, the dtype or the count get a ``CommError`` naming both calls. Large messages
move in chunks (chunks.py); the blocking call in progress is noted for the watchdog (watch.py).
``comm.counters`` count messages, bytes and seconds (requests.py); ``comm.trace = []`` records
``(rank, op, peer, start, end, bytes)`` events.

Errors. A peer out of range, a non-array, a non-contiguous receive buffer, or a message whose
size differs from the receive buffer raise ``CommError`` naming the rank, the peer and both
sizes. From the import of this module, an uncaught exception on any rank aborts the whole job.
"""
import functools
import numbers
import time

from mpi4py import MPI

from minipar import backend
# the algorithm modules register themselves in this order (the order tables and lessons list)
from minipar.comm import allreduce, param_server, trees, exchange, mpi, nonblocking  # noqa: I001
from minipar.comm import agreement, chunks, node, watch
from minipar.comm.errors import CommError, dtype_tag, tag_dtype
from minipar.comm.registry import pick
from minipar.comm.requests import Counters, Request  # noqa: F401  (Counters: re-exported)
from minipar.comm.buffers import array as _array
from minipar.comm.staging import HOST_ARRAY, cuda_aware, recv_buffer, send_buffer

_state = watch.state  # the blocking call in progress, for the watchdog (watch.py)
watch.install_abort_hook()  # from this import on, an uncaught exception ends the whole job


def _collective(method):
    """An entry point: refuses a non-array, and clears the watchdog's note of the call after."""
    @functools.wraps(method)
    def entry(self, x, *args, **kwargs):
        if x is not None:
            _array(x, method.__name__)
        try:
            return method(self, x, *args, **kwargs)
        finally:
            _state["collective"] = _state["call"] = None
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
        self._status = MPI.Status()  # reused by the blocking calls (one allocation less each)
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
            self.strict_tags = True
            self.coll = self

    @property
    def trace(self):
        """None (off) or the list of (rank, op, peer, start, end, bytes) events; assign [] to start."""
        return self._log["trace"]

    @trace.setter
    def trace(self, events):
        self._log["trace"] = events

    def __repr__(self):
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- sub-groups --------------------------------------------------------------------------
    def split(self, color, key=None):
        """Ranks with the same ``color`` form a new communicator, ordered by ``key`` (default rank)."""
        return Communicator(self.mpi.Split(color, self.rank if key is None else key))

    def group(self, ranks):
        """A communicator of ``ranks`` in that order (collective; ranks not listed get None)."""
        ranks = [int(r) for r in ranks]
        for r in ranks:
            self.check_peer(r)
        new = self.mpi.Create_group(self.mpi.Get_group().Incl(ranks))
        return None if new == MPI.COMM_NULL else Communicator(new)

    def dup(self, share_counters=False):
        """The same ranks, messages never matching this one's (``share_counters``: counted here)."""
        return Communicator(self.mpi.Dup(), counters=self.counters if share_counters else None)

    # -- checks ------------------------------------------------------------------------------
    def check_peer(self, peer):
        """``peer`` as an int (NumPy integers too), or a CommError unless it is a rank here."""
        if isinstance(peer, numbers.Integral) and not isinstance(peer, bool) and 0 <= peer < self.size:
            return int(peer)
        raise CommError(f"rank {self.rank}: peer rank {peer!r} out of range for a "
                        f"communicator of size {self.size} (valid ranks 0..{self.size - 1})")

    def _check_received(self, status, expected, source, tag):
        if self.strict_tags and status.Get_tag() != tag:
            got = status.Get_tag()
            if agreement.fingerprinted(tag) or agreement.fingerprinted(got):
                raise CommError(f"rank {self.rank}: {agreement.describe(tag)} received a message "
                                f"of rank {source}'s {agreement.describe(got)}: "
                                f"{agreement.difference(tag, got)}")
            raise CommError(f"rank {self.rank}: rank {source} sent {tag_dtype(got)} data where "
                            f"{tag_dtype(tag)} was expected: dtypes differ across ranks")
        got = status.Get_count(MPI.BYTE)
        if got != expected:
            raise CommError(f"rank {self.rank}: received {got} bytes from rank "
                            f"{status.Get_source() if source is None else source} where "
                            f"{expected} were expected: lengths or dtypes differ across ranks")

    def _match(self, tag):
        """The tag to post a receive with: any tag on the strict channel (checked afterwards)."""
        return MPI.ANY_TAG if self.strict_tags else tag

    def _truncated(self, error, expected, source):
        if isinstance(error, MPI.Exception) and error.Get_error_class() == MPI.ERR_TRUNCATE:
            return CommError(f"rank {self.rank}: message from rank {source} is larger than the "
                             f"{expected}-byte receive buffer: lengths or dtypes differ across ranks")
        return error

    # -- buffers: NumPy straight through, CuPy direct (CUDA-aware) or staged through the host --
    def is_cuda_aware(self):
        self._cuda_aware = cuda_aware()[0] if self._cuda_aware is None else self._cuda_aware
        return self._cuda_aware

    def _send_buffer(self, x):
        if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
            return x, None
        return send_buffer(_array(x, "send"), self.is_cuda_aware())

    def _recv_buffer(self, out):
        if type(out) is HOST_ARRAY and out.flags.c_contiguous:
            return out, None
        return recv_buffer(_array(out, "recv"), self.is_cuda_aware(), self.rank)

    def collective_tag(self, collective, algorithm, op, x, root=None, check=None):
        """The tag of this collective call's messages: the next call number and the call's
        fingerprint (agreement.py), noted for the watchdog; the dtype alone when not checking."""
        if check is False or (check is None and not agreement.ENABLED):
            return dtype_tag(x.dtype)
        number, self._calls = self._calls, self._calls + 1
        tag = agreement.encode(collective, algorithm, op, x.dtype, x.size, root, number)
        _state["collective"] = (collective, number, algorithm, op, root, x.dtype, x.size)
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

    # -- accounting --------------------------------------------------------------------------
    def _account(self, sent, received, nbytes, t0):
        c = self.counters
        if sent is not None:
            c.messages_sent += 1
            c.bytes_sent += nbytes
        if received is not None:
            c.messages_received += 1
            c.bytes_received += received
        c.comm_time_s += time.perf_counter() - t0

    def _record(self, op, peer, start, nbytes):
        if self.trace is not None:
            self.trace.append((self.rank, op, peer, start, time.perf_counter(), nbytes))

    # -- point to point ----------------------------------------------------------------------
    def send(self, x, dest, tag=0):
        """Blocking send of array ``x`` to rank ``dest``."""
        dest = self.check_peer(dest)
        t0 = time.perf_counter()
        buf, sent = self._send_buffer(x)  # sent: gives a staged host buffer back
        _state["call"] = ("send", (self.world_ranks[dest],), buf.nbytes, tag, time.monotonic())
        try:
            if buf.nbytes > chunks.CHUNK_BYTES:
                chunks.send(self.mpi, buf, dest, tag)
            else:
                self.mpi.Send(buf, dest, tag)
        finally:
            _state["call"] = None
        if sent:
            sent()
        self._account(True, None, buf.nbytes, t0)
        self._record("send", dest, t0, buf.nbytes)

    def recv(self, out, source, tag=0):
        """Blocking receive from rank ``source`` into ``out`` (its size must match); returns out."""
        source = self.check_peer(source)
        t0 = time.perf_counter()
        buf, finish = self._recv_buffer(out)
        status = self._status
        _state["call"] = ("recv", (self.world_ranks[source],), buf.nbytes, tag, time.monotonic())
        try:
            if buf.nbytes > chunks.CHUNK_BYTES:
                chunks.recv(self.mpi, buf, source, self._match(tag), status,
                            lambda st, n: self._check_received(st, n, source, tag))
            else:
                self.mpi.Recv(buf, source, self._match(tag), status)
                self._check_received(status, buf.nbytes, source, tag)
        except MPI.Exception as error:
            raise self._truncated(error, buf.nbytes, source) from None
        finally:
            _state["call"] = None
        if finish:
            finish()
        self._account(None, buf.nbytes, 0, t0)
        self._record("recv", source, t0, buf.nbytes)
        return out

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=None):
        """Send ``x`` to ``dest`` and receive into ``out`` from ``source`` at once (no deadlock)."""
        dest, source = self.check_peer(dest), self.check_peer(source)
        recvtag = sendtag if recvtag is None else recvtag
        t0 = time.perf_counter()
        sbuf, sent = self._send_buffer(x)
        rbuf, finish = self._recv_buffer(out)
        status = self._status
        _state["call"] = ("sendrecv", (self.world_ranks[dest], self.world_ranks[source]), rbuf.nbytes,
                          recvtag, time.monotonic())
        try:
            if max(sbuf.nbytes, rbuf.nbytes) > chunks.CHUNK_BYTES:
                chunks.sendrecv(self.mpi, sbuf, dest, sendtag, rbuf, source, self._match(recvtag),
                                status, lambda st, n: self._check_received(st, n, source, recvtag))
            else:
                self.mpi.Sendrecv(sbuf, dest, sendtag, rbuf, source, self._match(recvtag), status)
                self._check_received(status, rbuf.nbytes, source, recvtag)
        except MPI.Exception as error:
            raise self._truncated(error, rbuf.nbytes, source) from None
        finally:
            _state["call"] = None
        for done in filter(None, (sent, finish)):  # staged: copy in, give host buffers back
            done()
        self._account(True, rbuf.nbytes, sbuf.nbytes, t0)
        self._record("sendrecv", (dest, source), t0, sbuf.nbytes + rbuf.nbytes)
        return out

    def isend(self, x, dest, tag=0):
        """Start sending ``x`` to ``dest``; returns a ``Request``. Do not modify x before wait()."""
        dest = self.check_peer(dest)
        start = time.perf_counter()
        buf, sent = self._send_buffer(x)

        def complete(status, t0):
            if sent:
                sent()
            self._account(None, None, 0, t0)
            self._record("isend", dest, start, buf.nbytes)
        note = ("isend", (self.world_ranks[dest],), buf.nbytes, tag)
        request = Request(self.mpi.Isend(buf, dest, tag), x, note, complete)
        self._account(True, None, buf.nbytes, start)
        return request

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` from ``source``; returns a ``Request`` (wait() gives out)."""
        source = self.check_peer(source)
        start = time.perf_counter()
        buf, finish = self._recv_buffer(out)

        def complete(status, t0):
            self._check_received(status, buf.nbytes, source, tag)
            if finish is not None:
                finish()
            self._account(None, None, 0, t0)
            self._record("irecv", source, start, buf.nbytes)
        note = ("irecv", (self.world_ranks[source],), buf.nbytes, tag)
        request = Request(self.mpi.Irecv(buf, source, self._match(tag)), out, note, complete)
        self._account(None, buf.nbytes, 0, start)
        return request

    # -- small Python objects (metadata, checks, timings: pickled by mpi4py, not counted) ------
    def all_gather_object(self, obj):
        """Every rank's ``obj``, as a list in rank order, on every rank (torch's name)."""
        return self.mpi.allgather(obj)

    def gather_object(self, obj, root=0):
        """Every rank's ``obj`` as a list in rank order on ``root``; None elsewhere."""
        return self.mpi.gather(obj, root=root)

    def broadcast_object(self, obj, root=0):
        """``root``'s ``obj`` on every rank (the others' argument is ignored)."""
        return self.mpi.bcast(obj, root=root)

    def barrier(self):
        """Wait until every rank of this communicator arrives (MPI's barrier; moves no data)."""
        t0 = time.perf_counter()
        with watch.blocking("barrier", self.world_ranks):
            self.mpi.Barrier()
        self._account(None, None, 0, t0)
        self._record("barrier", None, t0, 0)

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
        comm, local = Communicator(MPI.COMM_WORLD), node.local(MPI.COMM_WORLD)
        comm.local, comm.gpu = local, backend.select_gpu(local.rank)
        _world["world"] = comm
    elif timeout is not None:
        watch.set_timeout(timeout)
    return _world["world"]
