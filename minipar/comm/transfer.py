"""The bookkeeping of one point-to-point call, beside the call: the buffers MPI reads and writes
(staging.py), the note for the watchdog (watch.py), the checks of what arrived, the counters
(requests.py) and the trace. A communicator method enters it and keeps only its MPI call:

    with Transfer(comm, "recv", source, recv=out, tag=tag) as t:
        chunks.recv(comm.mpi, t.rbuf, source, t.match, t.status, t.check)

A non-blocking call is a ``requests.Request``, the same bookkeeping finished by ``wait()``.
"""
import time
from typing import NamedTuple

from mpi4py import MPI

from minipar.comm import agreement, chunks, watch
from minipar.comm.buffers import array
from minipar.comm.errors import CommError, tag_dtype
from minipar.comm.staging import HOST_ARRAY, recv_buffer, send_buffer, wire


class Event(NamedTuple):
    """One call in ``comm.trace``."""
    rank: int
    op: str
    peer: object  # the peer's rank; (dest, source) for a sendrecv; None for a barrier
    start: float  # time.perf_counter() when the call began (was posted, if non-blocking)
    end: float  # ... and when it completed
    nbytes: int  # sent and received


class Transfer(watch.blocking):
    """One call of ``comm``: ``op`` with ``peer`` (a rank; (dest, source) for a sendrecv; None:
    every rank), sending array ``send`` and receiving into array ``recv`` (either may be None).
    Around the MPI call it is noted for the watchdog, and a message larger than the receive
    buffer raises a CommError; after it, ``finish`` runs."""

    statuses = ()  # a non-blocking receive's, one per piece: checked when it finishes
    counted = False  # its messages and bytes already counted (a non-blocking call's, when posted)

    def __init__(self, comm, op, peer, send=None, recv=None, tag=None):
        self.start = self.t0 = time.perf_counter()
        self.comm, self.op, self.peer, self.tag = comm, op, peer, tag
        self.sbuf, self._sent = (None, None) if send is None else _send_buffer(comm, send)
        self.rbuf, self._received = (None, None) if recv is None else _recv_buffer(comm, recv)
        self.sent = None if send is None else self.sbuf.nbytes  # bytes each way (None: no message)
        self.received = None if recv is None else self.rbuf.nbytes
        self.nbytes = (self.sent or 0) + (self.received or 0)
        # the collectives' channel posts receives for any tag and checks it after (check): a
        # message of another call is named rather than left unmatched for ever
        self.match = MPI.ANY_TAG if comm.strict_tags else tag
        self.status = comm.status
        w = comm.world_ranks
        if peer is None:
            peers, self.source = w, None
        elif type(peer) is tuple:
            peers, self.source = (w[peer[0]], w[peer[1]]), peer[1]
        else:
            peers, self.source = (w[peer],), peer
        # the watchdog's note: the bytes this call waits for (a send's: those it sends)
        super().__init__(op, peers, self.nbytes if recv is None else self.received, tag)

    def __exit__(self, kind, error, tb):
        super().__exit__(kind, error, tb)
        if error is None:
            self.finish()
        elif isinstance(error, MPI.Exception):
            raise self._truncated(error) from None

    def finish(self):
        """After MPI: check the pieces a non-blocking receive got, copy staged data in and give
        host buffers back, count the seconds since ``t0`` (and the messages, unless counted
        already) and append the call to the trace."""
        if self.statuses and self.rbuf is not None:
            for status, piece in zip(self.statuses, chunks.pieces(self.rbuf)):
                self.check(status, piece.nbytes)
        if self._sent is not None:  # staged: give the host buffer back
            self._sent()
        if self._received is not None:  # staged: copy into the device array, give it back
            self._received()
        self.count(self.t0, messages=not self.counted)
        if self.comm.trace is not None:
            self.comm.trace.append(Event(self.comm.rank, self.op, self.peer, self.start,
                                         time.perf_counter(), self.nbytes))

    def count(self, t0, messages=True):
        """The seconds since t0, and (``messages``) this call's messages and bytes."""
        if messages:
            self.comm.counters.add(time.perf_counter() - t0, self.sent, self.received)
        else:
            self.comm.counters.add(time.perf_counter() - t0)

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
        if error.Get_error_class() != MPI.ERR_TRUNCATE:
            return error
        why = "lengths or dtypes differ across ranks"
        if not self.comm.strict_tags:
            # a receive takes the first message of its source and tag still unreceived, which
            # may be one the sender meant for a later receive (a receive from any rank, say)
            why += f", or this receive took another of rank {self.source}'s tag-{self.tag} messages"
        return CommError(f"rank {self.comm.rank}: message from rank {self.source} is larger than "
                         f"the {self.rbuf.nbytes}-byte receive buffer: {why}")


# NumPy arrays go straight to MPI; CuPy arrays directly (CUDA-aware MPI) or staged through the
# host (staging.py), with a function to call once MPI is done with the buffer (None: none)
def _send_buffer(comm, x):
    if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
        return wire(x), None
    return send_buffer(array(x, "send"), comm.is_cuda_aware())


def _recv_buffer(comm, out):
    if type(out) is HOST_ARRAY and out.flags.c_contiguous:
        return wire(out), None
    return recv_buffer(array(out, "recv"), comm.is_cuda_aware(), comm.rank)
