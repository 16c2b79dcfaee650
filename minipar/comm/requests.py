"""Counters and requests: what a communicator counts, and a send or receive still in flight.

Counters (per communicator, per rank): messages and bytes sent and received, and seconds spent
inside communication calls; ``snapshot()`` gives them as a dict, ``reset()`` zeroes them.

A ``Request`` is a non-blocking send or receive: ``wait()`` completes it (noting itself for the
watchdog while it waits), then finishes its bookkeeping (transfer.py: checks, staging,
counters, trace) and returns the buffer.
"""
import time

from mpi4py import MPI

from minipar.comm import watch
from minipar.comm.transfer import Transfer


class Counters:
    """Messages, bytes and seconds of one rank's communication on one communicator."""

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


class Request(Transfer):
    """A non-blocking send or receive in flight; ``wait()`` completes it (and returns the buffer).

        request = Request(comm, "isend", dest, send=x, tag=tag)
        request.post(chunks.isend(comm.mpi, request.sbuf, dest, tag), x)
    """

    def post(self, requests, buffer):
        """Started as MPI ``requests``, one per piece (chunks.py): its messages count now."""
        self.requests, self.buffer, self.done = requests, buffer, False
        self.statuses = [MPI.Status() for _ in requests]
        self.count(self.start)
        self.counted = True
        return self

    def wait(self):
        if not self.done:
            self.t0 = time.perf_counter()
            with self:  # noted for the watchdog while it waits; finished after
                for i, (request, status) in enumerate(zip(self.requests, self.statuses)):
                    if i:  # the piece before completed: the watchdog's clock starts again
                        watch.progress()
                    request.Wait(status)
        return self.buffer

    def test(self):
        """True (and completed) when the transfer is done; never blocks."""
        if not self.done:
            self.t0 = time.perf_counter()
            if MPI.Request.Testall(self.requests, self.statuses):
                self.finish()
        return self.done

    def finish(self):
        self.done = True
        super().finish()

    @staticmethod
    def wait_all(requests):
        """Wait for every request (in order; MPI progresses all of them meanwhile)."""
        return [request.wait() for request in requests]
