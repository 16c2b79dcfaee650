"""Large messages move in chunks, so a transfer that progresses never looks stuck.

A message over ``CHUNK_BYTES`` (64 MiB; ``MINIPAR_CHUNK_BYTES`` to change it) goes as a run of
chunks with the same tag: MPI delivers messages of one sender, tag and communicator in order,
so the receiver, cutting its buffer the same way, gets them in place. Each finished chunk counts
as progress for the watchdog (watch.py), so an all-reduce of 2^31 elements on a loaded machine
does not trip even a short timeout, while a call that waits on a peer that never sends does.
"""
import os
import time

from minipar.comm import watch

CHUNK_BYTES = int(os.environ.get("MINIPAR_CHUNK_BYTES", 64 << 20))


def pieces(buf):
    """Byte views of buf, CHUNK_BYTES each (the last shorter); one piece when it is small."""
    flat = buf.reshape(-1).view("u1")
    return [flat[i:i + CHUNK_BYTES] for i in range(0, max(flat.size, 1), CHUNK_BYTES)]


def _progress():
    call = watch.state["call"]
    if call is not None:
        watch.state["call"] = call[:4] + (time.monotonic(),)


def send(mpi, buf, dest, tag):
    for piece in pieces(buf):
        mpi.Send(piece, dest, tag)
        _progress()


def recv(mpi, buf, source, tag, status, check):
    """Receive every piece; ``check(status, expected bytes)`` after each (sizes and tags)."""
    for piece in pieces(buf):
        mpi.Recv(piece, source, tag, status)
        check(status, piece.nbytes)
        _progress()


def sendrecv(mpi, sbuf, dest, sendtag, rbuf, source, recvtag, status, check):
    """Both directions at once: every piece posted, then completed in order, each progress."""
    receives = [(mpi.Irecv(piece, source, recvtag), piece.nbytes) for piece in pieces(rbuf)]
    sends = [mpi.Isend(piece, dest, sendtag) for piece in pieces(sbuf)]
    for request, nbytes in receives:
        request.Wait(status)
        check(status, nbytes)
        _progress()
    for request in sends:
        request.Wait()
        _progress()
