"""Counters and requests: what a communicator counts, and a send or receive still in flight.

Counters (per communicator, per rank): messages and bytes sent and received, and seconds spent
inside communication calls; ``snapshot()`` gives them as a dict, ``reset()`` zeroes them.

A ``Request`` is a non-blocking send or receive: ``wait()`` completes it (noting itself for the
watchdog while it waits, watch.py), then runs the communicator's bookkeeping for it (checks,
counters, trace) and returns the buffer.
"""
import time

from mpi4py import MPI

from minipar.comm import watch


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
    """A non-blocking send or receive in flight; ``wait()`` completes it (and returns the buffer).

    ``note`` is (op, peers as world ranks, bytes, tag) for the watchdog; ``complete(status, t0)``
    is the communicator's bookkeeping once the transfer is done."""

    def __init__(self, mpi_request, buffer, note, complete):
        self.mpi_request, self.buffer, self.note, self._complete = mpi_request, buffer, note, complete
        self.done = False

    def wait(self):
        if self.done:
            return self.buffer
        t0 = time.perf_counter()
        watch.state["call"] = self.note + (time.monotonic(),)
        try:
            status = MPI.Status()
            self.mpi_request.Wait(status)
        finally:
            watch.state["call"] = None
        self._finish(status, t0)
        return self.buffer

    def test(self):
        """True (and completed) when the transfer is done; never blocks."""
        if not self.done:
            t0 = time.perf_counter()
            status = MPI.Status()
            if self.mpi_request.Test(status):
                self._finish(status, t0)
        return self.done

    def _finish(self, status, t0):
        self.done = True
        self._complete(status, t0)

    @staticmethod
    def wait_all(requests):
        """Wait for every request (in order; MPI progresses all of them meanwhile)."""
        return [request.wait() for request in requests]
