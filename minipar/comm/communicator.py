"""Point-to-point messages on NumPy or CuPy arrays over mpi4py, with counters and a trace.

A ``Communicator`` wraps one mpi4py communicator. Everything else in ``minipar.comm`` is built
from its six point-to-point calls, so the counters here see every byte a hand-coded collective
moves:

    send(x, dest)         recv(out, source)          sendrecv(x, dest, out, source)
    isend(x, dest) -> Request        irecv(out, source) -> Request        barrier()

GPU arrays. MPI reads device memory only when the library is CUDA-aware. ``cuda_aware()`` asks,
in order: the environment (``MINIPAR_CUDA_AWARE=0/1``), the MPI 4.1 info key
``mpi_memory_alloc_kinds`` (lists ``cuda`` when device memory is accepted), and MPICH/Open MPI's
``MPIX_Query_cuda_support()``. CUDA-aware: synchronise the stream, hand MPI the device buffer.
Otherwise stage through host memory (device -> host copy, MPI, host -> device copy).

Counters (per communicator, per rank): messages and bytes sent and received, and seconds spent
inside communication calls. ``comm.counters.snapshot()`` gives them as a dict,
``comm.counters.reset()`` zeroes them. ``comm.trace = []`` turns on trace events
``(rank, op, peer, start, end, bytes)``; ``comm.trace = None`` turns them off.

Errors. A peer out of range, a non-contiguous receive buffer, or a message whose size differs
from the receive buffer raise ``CommError`` naming the rank, the peer and both sizes. Once
``world()`` has been called, an uncaught exception on any rank prints its traceback and aborts
the whole job (``MPI_Abort``), so a failing rank never leaves its peers waiting for ever.
"""
import ctypes
import os
import sys
import time
import traceback

from mpi4py import MPI

from minipar import backend

_HOST_ARRAY = backend.numpy.ndarray  # NumPy arrays take the short path through the checks


class CommError(ValueError):
    """Bad input to a communication call (sizes, dtypes, peers, ops or algorithms)."""


_DTYPE_CHARS = "?bBhHiIlLqQefdgFDG"  # NumPy type characters; a message's tag is the index


def dtype_tag(dtype):
    """The tag collectives send an array of this dtype with, so a receiver can check the dtype."""
    return _DTYPE_CHARS.index(dtype.char) if dtype.char in _DTYPE_CHARS else len(_DTYPE_CHARS)


def tag_dtype(tag):
    """The dtype name a collective's tag stands for."""
    if 0 <= tag < len(_DTYPE_CHARS):
        return backend.get_array_module().dtype(_DTYPE_CHARS[tag]).name
    return f"tag {tag}"


# ----------------------------------------------------------------------------------------------
# Is MPI CUDA-aware?
# ----------------------------------------------------------------------------------------------

def _query_cuda_support_symbol():
    """``MPIX_Query_cuda_support()`` from the loaded libmpi, or None where it has no such symbol."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
        for path in sorted(paths):
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if query is not None:
                return bool(query())
    except OSError:
        pass
    return None


def cuda_aware():
    """(bool, reason): whether MPI accepts device buffers, and how that was decided."""
    env = os.environ.get("MINIPAR_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes"), f"MINIPAR_CUDA_AWARE={env}"
    kinds = MPI.COMM_WORLD.Get_info().get("mpi_memory_alloc_kinds")
    if kinds is not None and "cuda" in kinds:
        return True, f"mpi_memory_alloc_kinds={kinds}"
    symbol = _query_cuda_support_symbol()
    if symbol is not None:
        return symbol, f"MPIX_Query_cuda_support()={int(symbol)}"
    return False, f"mpi_memory_alloc_kinds={kinds}" if kinds else "no CUDA support reported"


# ----------------------------------------------------------------------------------------------
# Counters and requests
# ----------------------------------------------------------------------------------------------

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
        with self.comm._waiting_on(self.op, self.peer, self.nbytes):
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

    def __init__(self, mpi_comm, parent=None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._cuda_aware = None
        self._async = None  # background worker for iall_reduce (collectives.AsyncWorker)
        self._scratch = {}  # reusable receive buffers of the collectives, by slot
        self._status = MPI.Status()  # reused by the blocking calls (one allocation less each)
        if parent is None:
            self.counters = Counters()
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
            self._check_peer(r)
        new = self.mpi.Create_group(self.mpi.Get_group().Incl(ranks))
        return None if new == MPI.COMM_NULL else Communicator(new)

    def dup(self):
        """A communicator over the same ranks whose messages never match this one's."""
        return Communicator(self.mpi.Dup())

    # -- checks ------------------------------------------------------------------------------
    def _check_peer(self, peer):
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
        """A buffer MPI can read holding x (C-contiguous; host copy of a GPU array if staged)."""
        if type(x) is _HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
            return x
        if backend.is_gpu_array(x):
            xp = backend.get_array_module(x)
            x = xp.ascontiguousarray(x)
            backend.synchronize()
            return x if self.is_cuda_aware() else backend.to_numpy(x)
        if not x.flags.c_contiguous:
            x = backend.get_array_module(x).ascontiguousarray(x)
        return x

    def _recv_buffer(self, out):
        """(buffer MPI writes into, function to call after the receive completes)."""
        if type(out) is _HOST_ARRAY and out.flags.c_contiguous:  # the common case, first
            return out, None
        if not out.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: receive buffer must be C-contiguous "
                            f"(got strides {out.strides}); pass a contiguous array")
        if backend.is_gpu_array(out):
            backend.synchronize()
            if self.is_cuda_aware():
                return out, None
            host = backend.get_array_module().empty(out.shape, out.dtype)
            return host, lambda: out.set(host)
        return out, None

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

    def _waiting_on(self, op, peer, nbytes):
        return _Waiting(self.rank, op, peer, nbytes)

    # -- point to point ----------------------------------------------------------------------
    def send(self, x, dest, tag=0):
        """Blocking send of array ``x`` to rank ``dest``."""
        self._check_peer(dest)
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
        self._check_peer(source)
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
        self._check_peer(dest)
        self._check_peer(source)
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
        self._check_peer(dest)
        t0 = time.perf_counter()
        buf = self._send_buffer(x)
        request = Request(self, self.mpi.Isend(buf, dest, tag), "isend", dest, buf.nbytes, t0, x)
        self._account(True, None, buf.nbytes, t0)
        return request

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` from ``source``; returns a ``Request`` (wait() gives out)."""
        self._check_peer(source)
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
        with self._waiting_on("barrier", None, 0):
            self.mpi.Barrier()
        self._account(None, None, 0, t0)
        self._record("barrier", None, t0, 0)


# ----------------------------------------------------------------------------------------------
# Who waits on whom (read by the test harness's watchdog when a run times out)
# ----------------------------------------------------------------------------------------------

_blocked = {}  # "now": (rank, op, peer, bytes) while inside a blocking call (set inline by
#               send, recv and sendrecv, the hot path; by _Waiting in the others)


class _Waiting:
    """Context manager noting the blocking call in progress, so a hang can name the peer."""

    __slots__ = ("entry",)

    def __init__(self, rank, op, peer, nbytes):
        self.entry = (rank, op, peer, nbytes)

    def __enter__(self):
        _blocked["now"] = self.entry

    def __exit__(self, *exc):
        _blocked.pop("now", None)


def waiting_on():
    """A line naming the blocking call this process is inside, or '' when it is not blocked."""
    entry = _blocked.get("now")
    if entry is None:
        return ""
    rank, op, peer, nbytes = entry
    return f"rank {rank} blocked in {op} with peer {peer} ({nbytes} bytes)"


# ----------------------------------------------------------------------------------------------
# world() and the abort-on-error hook
# ----------------------------------------------------------------------------------------------

_world = {}


def _abort_on_uncaught(exc_type, exc, tb):
    """Print the traceback with the rank, then end every rank of the job (never a hang)."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"[minipar rank {rank}] uncaught exception, aborting the job:\n{text}")
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(1)


def install_abort_hook():
    """Make an uncaught exception on any rank abort the whole MPI job (idempotent)."""
    if sys.excepthook is not _abort_on_uncaught:
        sys.excepthook = _abort_on_uncaught


def world():
    """The communicator of all ranks (``MPI.COMM_WORLD``); installs the abort-on-error hook."""
    if "world" not in _world:
        install_abort_hook()
        _world["world"] = Communicator(MPI.COMM_WORLD)
    return _world["world"]


# Collectives as methods: ``collectives.py`` (which imports this module) attaches all_reduce,
# broadcast, ... to Communicator, so ``comm.all_reduce(x)`` is ``collectives.all_reduce(comm, x)``.
