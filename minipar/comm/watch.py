"""Who waits on whom, and a failing rank ends the job: the bookkeeping a hang is explained with.

Every blocking call notes itself in ``current`` while it waits (send, recv and sendrecv inline,
the others through ``waiting``), so a watchdog can say which call on which rank is stuck and on
which peer (``waiting_on()``; the test harness prints it when a run times out).

``install_abort_hook()`` makes an uncaught exception on any rank print its traceback with the
rank and abort the whole job (``MPI_Abort``): a failing rank never leaves its peers waiting.
"""
import sys
import traceback

from mpi4py import MPI

current = {}  # "now": (rank, op, peer, bytes) while this process is inside a blocking call


class waiting:
    """Context manager noting the blocking call in progress, so a hang can name the peer."""

    __slots__ = ("entry",)

    def __init__(self, rank, op, peer, nbytes):
        self.entry = (rank, op, peer, nbytes)

    def __enter__(self):
        current["now"] = self.entry

    def __exit__(self, *exc):
        current.pop("now", None)


def waiting_on():
    """A line naming the blocking call this process is inside, or '' when it is not blocked."""
    entry = current.get("now")
    if entry is None:
        return ""
    rank, op, peer, nbytes = entry
    return f"rank {rank} blocked in {op} with peer {peer} ({nbytes} bytes)"


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
