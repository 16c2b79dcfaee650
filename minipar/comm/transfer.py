"""The bookkeeping of one point-to-point call, beside the call: the buffers MPI reads and writes
(staging.py), the note for the watchdog (watch.py), the checks of what arrived, the counters
(requests.py) and the trace. A communicator method enters it and keeps only its MPI call:

    with blocking(comm, "recv", source, recv=out, tag=tag) as t:
        chunks.recv(comm.mpi, t.rbuf, source, t.match, t.status, t.check)

    t = Transfer(comm, "isend", dest, send=x, tag=tag)                 # non-blocking
    return t.posted(chunks.isend(comm.mpi, t.sbuf, dest, tag), x)     # a Request
"""
import contextlib
import time
from typing import NamedTuple

from mpi4py import MPI

from minipar.comm import agreement, chunks, watch
from minipar.comm.buffers import array
from minipar.comm.errors import CommError, tag_dtype
from minipar.comm.requests import Request
from minipar.comm.staging import HOST_ARRAY, recv_buffer, send_buffer


class Event(NamedTuple):
    """One call in ``comm.trace``."""
    rank: int
    op: str
    peer: object  # the peer's rank; (dest, source) for a sendrecv; None for a barrier
    start: float  # time.perf_counter() when the call began (was posted, if non-blocking)
    end: float  # ... and when it completed
    nbytes: int  # sent and received


@contextlib.contextmanager
def blocking(comm, op, peer, send=None, recv=None, tag=None):
    """A blocking call's bookkeeping around its MPI call (the body of the ``with``)."""
    transfer = Transfer(comm, op, peer, send, recv, tag)
    with transfer.noted():
        yield transfer
    transfer.done(transfer.start)


class Transfer:
    """One call of ``comm``: ``op`` with ``peer`` (a rank, (dest, source), or None: all ranks),
    sending array ``send`` and receiving into array ``recv`` (either may be None)."""

    def __init__(self, comm, op, peer, send=None, recv=None, tag=None):
        self.comm, self.op, self.peer, self.tag = comm, op, peer, tag
        self.source = peer[1] if isinstance(peer, tuple) else peer
        self.start = time.perf_counter()
        self.sbuf, self._sent = (None, None) if send is None else _send_buffer(comm, send)
        self.rbuf, self._received = (None, None) if recv is None else _recv_buffer(comm, recv)
        # the collectives' channel posts receives for any tag and checks it after (check): a
        # message of another call is named rather than left unmatched for ever
        self.match = MPI.ANY_TAG if comm.strict_tags else tag
        self.status = comm.status  # reused by the blocking calls (one allocation less each)

    @contextlib.contextmanager
    def noted(self):
        """The call noted for the watchdog while MPI waits in it; a message larger than the
        receive buffer raised as a CommError."""
        w = self.comm.world_ranks
        peers = w if self.peer is None else [w[r] for r in (self.peer if isinstance(
            self.peer, tuple) else (self.peer,))]
        nbytes = self.rbuf.nbytes if self.rbuf is not None else self.nbytes
        with watch.blocking(self.op, peers, nbytes, self.tag):
            try:
                yield
            except MPI.Exception as error:
                raise self._truncated(error) from None

    @property
    def nbytes(self):
        return sum(buf.nbytes for buf in (self.sbuf, self.rbuf) if buf is not None)

    def posted(self, requests, buffer):
        """A non-blocking call started as MPI ``requests``: its Request (``wait()`` gives
        ``buffer``). Its messages and bytes count now, its seconds both now and at the end."""
        request = Request(requests, buffer, self)
        self.count(self.start)
        return request

    def done(self, t0, statuses=(), messages=True):
        """After MPI: check the pieces a non-blocking receive got (their ``statuses``), copy
        staged data in and give host buffers back, count and trace."""
        if self.rbuf is not None:
            for status, piece in zip(statuses, chunks.pieces(self.rbuf)):
                self.check(status, piece.nbytes)
        for finish in filter(None, (self._sent, self._received)):
            finish()
        self.count(t0, messages)
        if self.comm.trace is not None:
            self.comm.trace.append(Event(self.comm.rank, self.op, self.peer, self.start,
                                         time.perf_counter(), self.nbytes))

    def count(self, t0, messages=True):
        """The seconds since t0, and (``messages``) this call's messages and bytes."""
        sent = self.sbuf.nbytes if messages and self.sbuf is not None else None
        received = self.rbuf.nbytes if messages and self.rbuf is not None else None
        self.comm.counters.add(time.perf_counter() - t0, sent, received)

    def check(self, status, expected):
        """A CommError unless what arrived has the expected size (and tag, on the strict
        channel), naming the rank, the peer and both sizes or calls."""
        comm, source, tag = self.comm, self.source, self.tag
        if comm.strict_tags and status.Get_tag() != tag:
            got = status.Get_tag()
            if agreement.fingerprinted(tag) or agreement.fingerprinted(got):
                raise CommError(f"rank {comm.rank}: {agreement.describe(tag)} received a message "
                                f"of rank {source}'s {agreement.describe(got)}: "
                                f"{agreement.difference(tag, got)}")
            raise CommError(f"rank {comm.rank}: rank {source} sent {tag_dtype(got)} data where "
                            f"{tag_dtype(tag)} was expected: dtypes differ across ranks")
        got = status.Get_count(MPI.BYTE)
        if got != expected:
            raise CommError(f"rank {comm.rank}: received {got} bytes from rank {source} where "
                            f"{expected} were expected: lengths or dtypes differ across ranks")

    def _truncated(self, error):
        if error.Get_error_class() == MPI.ERR_TRUNCATE:
            return CommError(f"rank {self.comm.rank}: message from rank {self.source} is larger "
                             f"than the {self.rbuf.nbytes}-byte receive buffer: lengths or dtypes "
                             f"differ across ranks")
        return error


# NumPy arrays go straight to MPI; CuPy arrays directly (CUDA-aware MPI) or staged through the
# host (staging.py), with a function to call once MPI is done with the buffer (None: none)
def _send_buffer(comm, x):
    if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
        return x, None
    return send_buffer(array(x, "send"), comm.is_cuda_aware())


def _recv_buffer(comm, out):
    if type(out) is HOST_ARRAY and out.flags.c_contiguous:
        return out, None
    return recv_buffer(array(out, "recv"), comm.is_cuda_aware(), comm.rank)
