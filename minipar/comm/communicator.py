"""The communicator: one process group, its point-to-point messages, counters and collectives.

A ``Communicator`` wraps one mpi4py communicator. Every collective is built from its six
point-to-point calls, so the counters here see every byte a hand-coded collective moves:

    send(x, dest)         recv(out, source)          sendrecv(x, dest, out, source)
    isend(x, dest) -> Request        irecv(out, source) -> Request        barrier()

and every collective is a method declared here, running the algorithm chosen by name from the
registry (allreduce.py, trees.py, exchange.py, param_server.py, and MPI's own in mpi.py):

    all_reduce(x, op="sum", algorithm="auto", out=None, check=None)    iall_reduce(...) -> Work
    broadcast(x, root=0)   reduce(x, root=0, op=)   reduce_scatter(x, op=)   all_gather(x)
    all_to_all(x)   gather(x, root=0)   scatter(x, root=0)
    all_gather_object(obj)   gather_object(obj, root=0)   broadcast_object(obj, root=0)

Arrays go in, arrays come out (NumPy or CuPy: staging.py); collectives know nothing of tensors.
Collectives talk on a private duplicate channel (``coll``) whose every receive checks the tag,
which carries the dtype (errors.py), so they never match user messages and ranks that disagree
on dtype or length get a ``CommError``.

Counters (per communicator, per rank): messages and bytes sent and received, and seconds spent
inside communication calls. ``comm.counters.snapshot()`` gives them as a dict,
``comm.counters.reset()`` zeroes them. ``comm.trace = []`` turns on trace events
``(rank, op, peer, start, end, bytes)``; ``comm.trace = None`` turns them off.

Errors. A peer out of range, a non-contiguous receive buffer, or a message whose size differs
from the receive buffer raise ``CommError`` naming the rank, the peer and both sizes. Once
``world()`` has been called, an uncaught exception on any rank prints its traceback and aborts
the whole job (watch.py), so a failing rank never leaves its peers waiting for ever.
"""
import time

from mpi4py import MPI

from minipar import backend
# the algorithm modules register themselves in this order (the order tables and lessons list)
from minipar.comm import allreduce, param_server, trees, exchange, mpi, nonblocking  # noqa: I001
from minipar.comm.errors import CommError, tag_dtype
from minipar.comm.registry import pick
from minipar.comm.staging import HOST_ARRAY, cuda_aware, recv_buffer, send_buffer
from minipar.comm.watch import current as _blocked, install_abort_hook, waiting

class Counters:
    """Messages, bytes and seconds of one rank's communication on one communicator."""

    FIELDS = ("messages_sent", "messages_received", "bytes_sent", "bytes_received", "comm_time_s")

    def __init__(self):
        self.reset()

    def reset(self):
        for field in self.FIELDS:
            setattr(self, field, 0)

    def snapshot(self):
        return {field: getattr(self, field) for field in self.FIELDS}


class Request:
    """A non-blocking send or receive in flight; ``wait()`` completes it (and returns the buffer)."""

    def __init__(self, comm, mpi_request, op, peer, nbytes, start, buffer, finish=None, tag=0):
        self.comm, self.mpi_request, self.op, self.peer = comm, mpi_request, op, peer
        self.tag = tag
        self.nbytes, self.start, self.buffer, self._finish = nbytes, start, buffer, finish
        self.done = False

    def wait(self):
        if self.done:
            return self.buffer
        t0 = time.perf_counter()
        with waiting(self.comm.rank, self.op, self.peer, self.nbytes):
            status = MPI.Status()
            self.mpi_request.Wait(status)
        self._complete(status, t0)
        return self.buffer

    def test(self):
        """True (and completed) when the transfer is done; never blocks."""
        if not self.done:
            t0 = time.perf_counter()
            status = MPI.Status()
            if self.mpi_request.Test(status):
                self._complete(status, t0)
        return self.done

    def _complete(self, status, t0):
        self.done = True
        if self.op == "irecv":
            self.comm._check_received(status, self.nbytes, self.peer, self.tag)
        if self._finish is not None:
            self._finish()
        self.comm._account(None, None, 0, t0)
        self.comm._record(self.op, self.peer, self.start, self.nbytes)

    @staticmethod
    def wait_all(requests):
        """Wait for every request (in order; MPI progresses all of them meanwhile)."""
        return [request.wait() for request in requests]


# ----------------------------------------------------------------------------------------------
# The communicator
# ----------------------------------------------------------------------------------------------

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
        if parent is None:
            self.counters = counters or Counters()
            self._log = {"trace": None}
            self.strict_tags = False
            # Collectives talk on a private duplicate, so their messages never match user p2p,
            # and there every receive checks the tag, which carries the dtype (see dtype_tag).
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
        """A communicator of ``ranks`` (in that order); collective over this communicator.

        Ranks outside the list get ``None``."""
        ranks = [int(r) for r in ranks]
        for r in ranks:
            self.check_peer(r)
        new = self.mpi.Create_group(self.mpi.Get_group().Incl(ranks))
        return None if new == MPI.COMM_NULL else Communicator(new)

    def dup(self, share_counters=False):
        """A communicator over the same ranks whose messages never match this one's (counting
        into this one's counters when ``share_counters``)."""
        return Communicator(self.mpi.Dup(), counters=self.counters if share_counters else None)

    # -- checks ------------------------------------------------------------------------------
    def check_peer(self, peer):
        """CommError unless ``peer`` is a rank of this communicator."""
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise CommError(f"rank {self.rank}: peer rank {peer!r} out of range for a "
                            f"communicator of size {self.size} (valid ranks 0..{self.size - 1})")

    def _check_received(self, status, expected, source, tag):
        if self.strict_tags and status.Get_tag() != tag:
            raise CommError(f"rank {self.rank}: rank {source} sent "
                            f"{tag_dtype(status.Get_tag())} data where {tag_dtype(tag)} was "
                            f"expected: dtypes differ across ranks")
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
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()[0]
        return self._cuda_aware

    def _send_buffer(self, x):
        if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
            return x
        return send_buffer(x, self.is_cuda_aware())

    def _recv_buffer(self, out):
        if type(out) is HOST_ARRAY and out.flags.c_contiguous:
            return out, None
        return recv_buffer(out, self.is_cuda_aware(), self.rank)

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
        self.check_peer(dest)
        t0 = time.perf_counter()
        buf = self._send_buffer(x)
        _blocked["now"] = (self.rank, "send", dest, buf.nbytes)
        try:
            self.mpi.Send(buf, dest, tag)
        finally:
            _blocked.pop("now", None)
        self._account(True, None, buf.nbytes, t0)
        self._record("send", dest, t0, buf.nbytes)

    def recv(self, out, source, tag=0):
        """Blocking receive from rank ``source`` into ``out`` (its size must match); returns out."""
        self.check_peer(source)
        t0 = time.perf_counter()
        buf, finish = self._recv_buffer(out)
        status = self._status
        _blocked["now"] = (self.rank, "recv", source, buf.nbytes)
        try:
            self.mpi.Recv(buf, source, self._match(tag), status)
        except MPI.Exception as error:
            raise self._truncated(error, buf.nbytes, source) from None
        finally:
            _blocked.pop("now", None)
        self._check_received(status, buf.nbytes, source, tag)
        if finish:
            finish()
        self._account(None, buf.nbytes, 0, t0)
        self._record("recv", source, t0, buf.nbytes)
        return out

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=None):
        """Send ``x`` to ``dest`` and receive into ``out`` from ``source`` at once (no deadlock)."""
        self.check_peer(dest)
        self.check_peer(source)
        recvtag = sendtag if recvtag is None else recvtag
        t0 = time.perf_counter()
        sbuf = self._send_buffer(x)
        rbuf, finish = self._recv_buffer(out)
        status = self._status
        _blocked["now"] = (self.rank, "sendrecv", (dest, source), rbuf.nbytes)
        try:
            self.mpi.Sendrecv(sbuf, dest, sendtag, rbuf, source, self._match(recvtag), status)
        except MPI.Exception as error:
            raise self._truncated(error, rbuf.nbytes, source) from None
        finally:
            _blocked.pop("now", None)
        self._check_received(status, rbuf.nbytes, source, recvtag)
        if finish:
            finish()
        self._account(True, rbuf.nbytes, sbuf.nbytes, t0)
        self._record("sendrecv", (dest, source), t0, sbuf.nbytes + rbuf.nbytes)
        return out

    def isend(self, x, dest, tag=0):
        """Start sending ``x`` to ``dest``; returns a ``Request``. Do not modify x before wait()."""
        self.check_peer(dest)
        t0 = time.perf_counter()
        buf = self._send_buffer(x)
        request = Request(self, self.mpi.Isend(buf, dest, tag), "isend", dest, buf.nbytes, t0, x)
        self._account(True, None, buf.nbytes, t0)
        return request

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` from ``source``; returns a ``Request`` (wait() gives out)."""
        self.check_peer(source)
        t0 = time.perf_counter()
        buf, finish = self._recv_buffer(out)
        request = Request(self, self.mpi.Irecv(buf, source, self._match(tag)), "irecv", source,
                          buf.nbytes, t0, out, finish, tag)
        self._account(None, buf.nbytes, 0, t0)
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
        with waiting(self.rank, "barrier", None, 0):
            self.mpi.Barrier()
        self._account(None, None, 0, t0)
        self._record("barrier", None, t0, 0)

    # -- collectives: each runs the algorithm named (registry.py), its formula beside its code --
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
        if self._worker is None:
            self._worker = nonblocking.AsyncWorker(self)
        return self._worker.submit(x, op, algorithm, out)

    def broadcast(self, x, root=0, algorithm="binomial", out=None, check=None):
        """Every rank gets root's x (the others pass an array of the same shape, or ``out``)."""
        return trees.broadcast(self, x, root, algorithm, out, check)

    def reduce(self, x, root=0, op="sum", algorithm="binomial", out=None, check=None):
        """Root gets op(x_0, ..., x_{p-1}); the other ranks get None."""
        return trees.reduce(self, x, root, op, algorithm, out, check)

    def reduce_scatter(self, x, op="sum", algorithm="ring", out=None, check=None):
        """Rank r gets chunk r (``chunk_bounds``) of op(x_0, ..., x_{p-1}) flattened."""
        return exchange.reduce_scatter(self, x, op, algorithm, out, check)

    def all_gather(self, x, algorithm="ring", out=None, check=None):
        """Every rank gets the stack [x_0, ..., x_{p-1}] of shape (p, *x.shape)."""
        return exchange.all_gather(self, x, algorithm, out, check)

    def all_to_all(self, x, algorithm="pairwise", out=None, check=None):
        """x of shape (p, ...): row j goes to rank j; rank r gets [x_0[r], ..., x_{p-1}[r]]."""
        return exchange.all_to_all(self, x, algorithm, out, check)

    def gather(self, x, root=0, algorithm="linear", out=None, check=None):
        """Root gets the stack [x_0, ..., x_{p-1}]; the other ranks get None."""
        return exchange.gather(self, x, root, algorithm, out, check)

    def scatter(self, x, root=0, algorithm="linear", out=None, check=None):
        """Rank r gets row r of root's x of shape (p, ...) (others: x of that shape, or out)."""
        return exchange.scatter(self, x, root, algorithm, out, check)


_world = {}


def world():
    """The communicator of all ranks (``MPI.COMM_WORLD``); installs the abort-on-error hook."""
    if "world" not in _world:
        install_abort_hook()
        _world["world"] = Communicator(MPI.COMM_WORLD)
    return _world["world"]
