"""The one door at the MPI boundary: MPI's point-to-point verbs on arrays, and around each MPI
call everything that makes it safe, here and nowhere else.

    c = comm.coll                          # a Wire: the collectives' channel (comm.wire: p2p's)
    with c.call("all_reduce", "ring", "sum", x):   # the fingerprint every message carries
        c.Sendrecv(x, right, out, left)    # mpi4py's names: Send Recv Sendrecv Isend Irecv
    c.Waitall([c.Isend(x, 1), c.Irecv(out, 1)])    # a Request's Wait() returns its array

Around each call: the buffer MPI reads or writes (bfloat16 and FP8 as their bits; a GPU array
staged through host memory unless MPI is CUDA-aware: staging.py); a message over CHUNK_BYTES
sent as chunks, each one progress for the watchdog; the watchdog's note of the call
(watch.py); the checks of what arrived (its size, and on the collectives' channel the call's
fingerprint: agreement.py); the counters and the trace. Why each: docs/comm.md.
"""
import os
import time
from typing import NamedTuple

from mpi4py import MPI

from minipar import backend
from minipar.comm import agreement, staging, watch
from minipar.comm.buffers import array
from minipar.comm.errors import CommError, dtype_tag, tag_dtype
from minipar.comm.registry import ALGORITHMS

HOST_ARRAY = backend.numpy.ndarray  # NumPy arrays take the short path to MPI
watched = watch.state  # what this rank waits in, for the watchdog
CHUNK_BYTES = int(os.environ.get("MINIPAR_CHUNK_BYTES", 64 << 20))


def _sync_sends(value):
    if value not in ("", "0", "1"):
        raise ValueError(f"MINIPAR_SYNC_SENDS must be 0 or 1, got {value!r}")
    return value == "1"


# MPI may send a small message eagerly (buffered: the send returns before the receive is
# posted) and a large one only once the receiver is ready, so both partners sending first, then
# receiving, passes at 100 elements and deadlocks at 1 MiB. A synchronous send (MPI_Ssend,
# MPI_Issend) completes only once its receive is posted: the bug deadlocks at every size, and the
# watchdog names it. The grader's checks run with it; a sendrecv cannot deadlock either way.
SYNC_SENDS = _sync_sends(os.environ.get("MINIPAR_SYNC_SENDS", ""))


# -- the buffer MPI reads or writes: NumPy arrays as they are, GPU arrays directly (CUDA-aware
# MPI) or staged through the host; each with a function to call once MPI is done (None: none)
_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def bits(x):
    """The array MPI reads or writes for x: x, or the bits of an ml_dtypes array (bfloat16 as
    uint16, FP8 as uint8). mpi4py knows none of their types (its buffer refuses them), so the
    elements travel as integers of their size: 2 and 1 bytes, the counters count them as they
    are. This is the one place that knows; no reduction may see those integers (mpi.py and
    buffers.refuse_float8 refuse them)."""
    name = _BITS.get(x.dtype.name)
    return x if name is None else x.view(name)


def send_buffer(x, aware):
    """(a buffer MPI can read holding x, function to call once MPI is done with it, or None):
    x itself when possible (C-contiguous; a GPU array if CUDA-aware), else a host copy."""
    if backend.is_gpu_array(x):
        if not aware:
            host, key = staging.to_host(x)
            return bits(host), lambda: staging.BUFFERS.give(key)
        x = backend.get_array_module(x).ascontiguousarray(x)
        backend.synchronize()
        return bits(x), None
    if not x.flags.c_contiguous:
        x = backend.get_array_module(x).ascontiguousarray(x)
    return bits(x), None


def recv_buffer(out, aware, rank=None):
    """(buffer MPI writes into, function to call after the receive completes, or None)."""
    if not out.flags.c_contiguous:
        raise CommError(f"rank {rank}: receive buffer must be C-contiguous "
                        f"(got strides {out.strides}); pass a contiguous array")
    if backend.is_gpu_array(out):
        if aware:
            backend.synchronize()
            return bits(out), None
        host, key = staging.BUFFERS.take(out)
        return bits(host), lambda: staging.to_device(host, out, key)
    return bits(out), None


def inout_buffer(a, aware):
    """(buffer MPI reads and writes in place, ``done(copy_back=True)`` to call afterwards, or
    None): copy_back=False where MPI left the buffer as it was (a broadcast's root)."""
    if backend.is_gpu_array(a) and not aware:
        host, key = staging.to_host(a)

        def done(copy_back=True):
            if copy_back:
                staging.to_device(host, a, key)
            else:
                staging.BUFFERS.give(key)
        return bits(host), done
    if backend.is_gpu_array(a):  # MPI reads device memory: wait for its kernels; host arrays: no
        backend.synchronize()
    return bits(a), None


class Counters:
    """Messages, bytes and seconds of one rank's communication on one communicator;
    ``snapshot()`` gives them as a dict, ``reset()`` zeroes them."""

    FIELDS = ("messages_sent", "messages_received", "bytes_sent", "bytes_received", "comm_time_s")

    def __init__(self):
        self.reset()

    def reset(self):
        for field in self.FIELDS:
            setattr(self, field, 0)

    def add(self, seconds, sent=None, received=None):
        """Seconds in a call, and the bytes of the message it sent and of the one it received
        (None: no message that way)."""
        if sent is not None:
            self.messages_sent += 1
            self.bytes_sent += sent
        if received is not None:
            self.messages_received += 1
            self.bytes_received += received
        self.comm_time_s += seconds

    def snapshot(self):
        return {field: getattr(self, field) for field in self.FIELDS}


class Event(NamedTuple):
    """One call in ``comm.trace``."""
    rank: int
    op: str
    peer: object  # the peer's rank; (dest, source) for a sendrecv; None for a barrier
    start: float  # time.perf_counter() when the call began (was posted, if non-blocking)
    end: float  # ... and when it completed
    nbytes: int  # sent and received


def pieces(buf):
    """Byte views of buf, CHUNK_BYTES each (the last shorter); buf itself when it is small. MPI
    delivers the messages of one sender, tag and communicator in order, so the receiver, cutting
    its buffer the same way, gets every piece in its place."""
    if buf.nbytes <= CHUNK_BYTES:
        return (buf,)
    flat = buf.reshape(-1).view("u1")
    return [flat[i:i + CHUNK_BYTES] for i in range(0, max(flat.size, 1), CHUNK_BYTES)]


class Wire:
    """MPI communicator ``mpi`` of Communicator ``comm`` with the machinery of every call
    around it (module docstring). ``strict``: the collectives' channel, where each receive
    takes any tag and checks that it is the call's fingerprint (``tag``, set by ``call``);
    otherwise a tag is the caller's (0 by default)."""

    def __init__(self, mpi, comm, strict):
        self.mpi, self.comm, self.strict = mpi, comm, strict
        self.rank, self.size, self.world_ranks = comm.rank, comm.size, comm.world_ranks
        self.counters, self._log = comm.counters, comm._log  # shared by a communicator's wires
        self.status = MPI.Status()  # reused by the blocking calls (one allocation less each)
        self.tag = 0  # the fingerprint of the collective call in progress (``call``)
        self.calls = 0  # collective calls made so far: the number in each fingerprint
        self._scratch, self._cuda_aware = {}, None

    # -- a collective call: its fingerprint on every message, its note for the watchdog -------
    def call(self, collective, algorithm, op, x, root=None, check=None):
        """Number this call and set its fingerprint (agreement.py) for every message until the
        ``with`` block ends; the dtype alone when not checking (``check=False``,
        ``MINIPAR_CHECK=0``)."""
        if check is False or (check is None and not agreement.ENABLED):
            self.tag = dtype_tag(x.dtype)
            return self
        number, self.calls = self.calls, self.calls + 1
        kind = agreement.fingerprint(collective, ALGORITHMS[collective][algorithm].id, op,
                                     x.dtype, x.size, root)
        self.tag = kind | (number & agreement.CALL_MASK) << agreement.CALL_SHIFT
        watched["collective"] = watch.Collective(collective, number, algorithm, op, root,
                                                 x.dtype, x.size)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *error):
        watched["collective"] = None

    # -- point to point: mpi4py's verbs, the array returned where one arrives ----------------
    def Send(self, x, dest, tag=None):
        """MPI_Send of array x to rank dest (MPI_Ssend with MINIPAR_SYNC_SENDS=1)."""
        t0, tag = time.perf_counter(), self.tag if tag is None else tag
        buf, sent = self._send_buffer(x)
        self._note("send", (self.world_ranks[dest],), buf.nbytes, tag)
        try:
            for i, piece in enumerate(pieces(buf)):
                if i:  # the piece before went through: the watchdog's clock starts again
                    watch.progress()
                (self.mpi.Ssend if SYNC_SENDS else self.mpi.Send)(piece, dest, tag)
        finally:
            watched["call"] = None
        self._done(t0, "send", dest, buf.nbytes, None, sent)

    def Recv(self, out, source, tag=None):
        """MPI_Recv into array out from rank source (the sizes must match); returns out."""
        t0, tag = time.perf_counter(), self.tag if tag is None else tag
        buf, received = self._recv_buffer(out)
        self._note("recv", (self.world_ranks[source],), buf.nbytes, tag)
        try:
            for i, piece in enumerate(pieces(buf)):
                if i:
                    watch.progress()
                self.mpi.Recv(piece, source, MPI.ANY_TAG if self.strict else tag, self.status)
                self.check(self.status, piece.nbytes, source, tag)
        except MPI.Exception as error:
            raise self._truncated(error, buf, source, tag) from None
        finally:
            watched["call"] = None
        self._done(t0, "recv", source, None, buf.nbytes, received)
        return out

    def Sendrecv(self, x, dest, out, source, sendtag=None, recvtag=None):
        """MPI_Sendrecv: x to rank dest and out from rank source at once (no deadlock)."""
        t0, sendtag = time.perf_counter(), self.tag if sendtag is None else sendtag
        recvtag = sendtag if recvtag is None else recvtag
        (sbuf, sent), (rbuf, received) = self._send_buffer(x), self._recv_buffer(out)
        w = self.world_ranks
        self._note("sendrecv", (w[dest], w[source]), rbuf.nbytes, recvtag)
        try:
            if sbuf.nbytes <= CHUNK_BYTES and rbuf.nbytes <= CHUNK_BYTES:
                self.mpi.Sendrecv(sbuf, dest, sendtag, rbuf, source,
                                  MPI.ANY_TAG if self.strict else recvtag, self.status)
                self.check(self.status, rbuf.nbytes, source, recvtag)
            else:
                self._sendrecv_pieces(sbuf, dest, sendtag, rbuf, source, recvtag)
        except MPI.Exception as error:
            raise self._truncated(error, rbuf, source, recvtag) from None
        finally:
            watched["call"] = None
        self._done(t0, "sendrecv", (dest, source), sbuf.nbytes, rbuf.nbytes, sent, received)
        return out

    def Isend(self, x, dest, tag=None):
        """MPI_Isend (MPI_Issend with MINIPAR_SYNC_SENDS=1): a ``Request``; keep x unchanged
        until its Wait()."""
        t0, tag = time.perf_counter(), self.tag if tag is None else tag
        buf, sent = self._send_buffer(x)
        start = self.mpi.Issend if SYNC_SENDS else self.mpi.Isend
        requests = [start(piece, dest, tag) for piece in pieces(buf)]
        return Request(self, "isend", dest, tag, x, buf, sent, requests, t0)

    def Irecv(self, out, source, tag=None):
        """MPI_Irecv into array out from rank source: a ``Request`` whose Wait() returns out."""
        t0, tag = time.perf_counter(), self.tag if tag is None else tag
        buf, received = self._recv_buffer(out)
        match = MPI.ANY_TAG if self.strict else tag
        requests = [self.mpi.Irecv(piece, source, match) for piece in pieces(buf)]
        return Request(self, "irecv", source, tag, out, buf, received, requests, t0)

    @staticmethod
    def Waitall(requests):
        """Wait for every request, in order (MPI progresses all of them meanwhile)."""
        return [request.Wait() for request in requests]

    # -- MPI's own calls: small Python objects (pickled by mpi4py, not counted), the barrier --
    def Barrier(self):
        """MPI_Barrier: wait until every rank arrives (moves no data; its time is counted)."""
        t0 = time.perf_counter()
        self._note("barrier", self.world_ranks, 0, None)
        try:
            self.mpi.Barrier()
        finally:
            watched["call"] = None
        self._done(t0, "barrier", None, None, None)

    def allgather(self, obj):
        with watch.blocking("all_gather_object", self.world_ranks):
            return self.mpi.allgather(obj)

    def gather(self, obj, root=0):
        with watch.blocking("gather_object", self.world_ranks):
            return self.mpi.gather(obj, root=root)

    def bcast(self, obj, root=0):
        with watch.blocking("broadcast_object", self.world_ranks):
            return self.mpi.bcast(obj, root=root)

    # -- the machinery -----------------------------------------------------------------------
    def scratch(self, slot, n, like):
        """A reusable work buffer of n elements of like's dtype (grown, never shrunk, per slot):
        the collectives' receive buffers, allocated once rather than on every call."""
        have = self._scratch.get(slot)
        if (have is None or have.size < n or have.dtype != like.dtype
                or type(have) is not type(like)):
            have = backend.get_array_module(like).empty(max(n, 1), like.dtype)
            self._scratch[slot] = have
        return have[:n]

    def is_cuda_aware(self):
        """Whether MPI takes this rank's GPU arrays as they are (else staged: staging.py)."""
        if self._cuda_aware is None:
            self._cuda_aware = staging.cuda_aware()[0]
        return self._cuda_aware

    def _send_buffer(self, x):
        """(the array MPI reads, a function to call once MPI is done with it, or None)."""
        if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
            return bits(x), None
        return send_buffer(array(x, "send"), self.is_cuda_aware())

    def _recv_buffer(self, out):
        """(the array MPI writes, a function that copies it into out afterwards, or None)."""
        if type(out) is HOST_ARRAY and out.flags.c_contiguous:
            return bits(out), None
        return recv_buffer(array(out, "recv"), self.is_cuda_aware(), self.rank)

    def _sendrecv_pieces(self, sbuf, dest, sendtag, rbuf, source, recvtag):
        """A Sendrecv too large for one message: every piece posted, then completed in order,
        each one progress for the watchdog."""
        start = self.mpi.Issend if SYNC_SENDS else self.mpi.Isend
        match = MPI.ANY_TAG if self.strict else recvtag
        posted = [(self.mpi.Irecv(piece, source, match), piece.nbytes) for piece in pieces(rbuf)]
        sends = [start(piece, dest, sendtag) for piece in pieces(sbuf)]
        for request, nbytes in posted:
            request.Wait(self.status)
            self.check(self.status, nbytes, source, recvtag)
            watch.progress()
        for request in sends:
            request.Wait()
            watch.progress()

    def _note(self, op, peers, nbytes, tag):
        # the watchdog's note: the world ranks waited on, the bytes waited for (a send's: sent)
        watched["call"] = watch.Call(op, peers, nbytes, tag, time.monotonic())

    def _done(self, t0, op, peer, sent, received, *staged):
        """After MPI: staged data copied in and host buffers given back, the seconds since t0
        and the messages counted, the call appended to the trace."""
        for finish in staged:
            if finish is not None:
                finish()
        end = time.perf_counter()
        self.counters.add(end - t0, sent, received)
        if self._log["trace"] is not None:
            self._log["trace"].append(Event(self.rank, op, peer, t0, end,
                                            (sent or 0) + (received or 0)))

    def check(self, status, expected, source, tag):
        """A CommError unless what arrived has the expected size (and, on the collectives'
        channel, tag), naming the rank, the peer and both sizes or calls."""
        if self.strict and status.Get_tag() != tag:
            got = status.Get_tag()
            if agreement.fingerprinted(tag) or agreement.fingerprinted(got):
                raise CommError(f"rank {self.rank}: {agreement.describe(tag)} received a message "
                                f"of rank {source}'s {agreement.describe(got)}: "
                                f"{agreement.difference(tag, got)}")
            raise CommError(f"rank {self.rank}: rank {source} sent {tag_dtype(got)} data where "
                            f"{tag_dtype(tag)} was expected: dtypes differ across ranks")
        got = status.Get_count(MPI.BYTE)
        if got != expected:
            raise CommError(f"rank {self.rank}: received {got} bytes from rank {source} where "
                            f"{expected} were expected: lengths or dtypes differ across ranks")

    def _truncated(self, error, buf, source, tag):
        if error.Get_error_class() != MPI.ERR_TRUNCATE:
            return error
        why = "lengths or dtypes differ across ranks"
        if not self.strict:
            # a receive takes the first message of its source and tag still unreceived, which
            # may be one the sender meant for a later receive (a receive from any rank, say)
            why += f", or this receive took another of rank {source}'s tag-{tag} messages"
        return CommError(f"rank {self.rank}: message from rank {source} is larger than "
                         f"the {buf.nbytes}-byte receive buffer: {why}")


class Request:
    """A started Isend or Irecv: ``Wait()`` (torch's ``wait()``) completes it, noted for the
    watchdog while it waits, and returns its array; ``Test()`` (``test()``) never blocks. Its
    messages count when it is posted, its seconds when it completes."""

    def __init__(self, wire, op, peer, tag, array, buf, staged, requests, t0):
        self.wire, self.op, self.peer, self.tag, self.array = wire, op, peer, tag, array
        self.buf, self.staged, self.requests, self.start = buf, staged, requests, t0
        self.statuses = [MPI.Status() for _ in requests]
        self.done = False
        sent, received = (buf.nbytes, None) if op == "isend" else (None, buf.nbytes)
        wire.counters.add(time.perf_counter() - t0, sent, received)

    def Wait(self):
        if not self.done:
            t0, wire = time.perf_counter(), self.wire
            wire._note(self.op, (wire.world_ranks[self.peer],), self.buf.nbytes, self.tag)
            try:
                for i, (request, status) in enumerate(zip(self.requests, self.statuses)):
                    if i:  # the piece before completed: the watchdog's clock starts again
                        watch.progress()
                    request.Wait(status)
            except MPI.Exception as error:
                raise wire._truncated(error, self.buf, self.peer, self.tag) from None
            finally:
                watched["call"] = None
            self._finish(t0)
        return self.array

    def Test(self):
        """True (and completed) when the transfer is done; never blocks."""
        if not self.done and MPI.Request.Testall(self.requests, self.statuses):
            self._finish(time.perf_counter())
        return self.done

    wait, test = Wait, Test  # torch's names, for the Communicator's isend and irecv

    def _finish(self, t0):
        self.done, wire = True, self.wire
        if self.op == "irecv":  # each piece's size and tag, checked now that it arrived
            for status, piece in zip(self.statuses, pieces(self.buf)):
                wire.check(status, piece.nbytes, self.peer, self.tag)
        if self.staged is not None:  # staged: copy in, give the host buffer back
            self.staged()
        end = time.perf_counter()
        wire.counters.add(end - t0)  # the seconds of the wait; the messages counted at the post
        if wire._log["trace"] is not None:
            wire._log["trace"].append(Event(wire.rank, self.op, self.peer, self.start, end,
                                            self.buf.nbytes))

    @staticmethod
    def wait_all(requests):
        """Wait for every request or ``Work`` (in order; MPI progresses all of them meanwhile)."""
        return [request.wait() for request in requests]
