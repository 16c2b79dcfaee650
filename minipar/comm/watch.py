"""Nothing hangs silently: who waits on whom, a watchdog in every run, and a failing rank ends
the job.

    with watch.blocking("barrier", peers):   # the call noted while it waits (watch.Call)
        mpi_comm.Barrier()
    watch.waiting_on()    # 'rank 0 blocked in recv with peer 1 (800 bytes); all_reduce #3 ...'

``start`` (called by ``comm.world()``) runs the watchdog thread: a call without progress for
``MINIPAR_TIMEOUT`` seconds (default 120, 12 in a student tree; 0: off) makes it ask the peers
what they do, print that, and end the job with status 1. ``install_abort_hook`` makes an uncaught exception on any
rank abort the job; a rank that leaves while a peer waits on it names the call and aborts.
How each part works: docs/comm.md.
"""
import atexit
import os
import sys
import threading
import time
import traceback
from typing import NamedTuple

from mpi4py import MPI


class Call(NamedTuple):
    """A blocking call in progress: what, on whom, how big, and when it last made progress."""
    op: str
    peers: tuple  # world ranks
    nbytes: int
    tag: object  # None for MPI's own calls (a barrier, a split, a collective of MPI's)
    since: float  # time.monotonic() of its start or of its last finished chunk (wire.py)


class Collective(NamedTuple):
    """A collective in progress: put into words only when someone asks (``doing``), so the
    note costs a collective call no string formatting."""
    name: str
    number: int
    algorithm: str
    op: object
    root: object
    dtype: object
    count: int


state = {"call": None, "collective": None, "action": None, "exiting": False}
REQUEST, REPLY = 1, 2  # tags on the private channel
# seconds when MINIPAR_TIMEOUT is unset; a student tree's copy of this line reads 12, written
# by `minipar assignment make`: its deadlocks are the lesson, their report wanted in seconds
DEFAULT_TIMEOUT = "120"
_watch = {"timeout": float(os.environ.get("MINIPAR_TIMEOUT", DEFAULT_TIMEOUT) or 0),
          "side": None, "thread": None}


def world_rank():
    return MPI.COMM_WORLD.Get_rank()


# ----------------------------------------------------------------------------------------------
# What this rank is doing
# ----------------------------------------------------------------------------------------------

def world_ranks(mpi_comm):
    """The world ranks of the ranks of mpi4py communicator ``mpi_comm``, in its order."""
    return tuple(MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(mpi_comm.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


class blocking:  # a context manager, named as contextlib's are
    """Note a blocking call that waits on world ranks ``peers`` (a send, a receive, a barrier,
    a communicator split, a shared window's allocation) while it runs, for the watchdog and
    the exit check: ``with watch.blocking("barrier", peers): ...``."""

    def __init__(self, op, peers, nbytes=0, tag=None):
        self.note = (op, tuple(peers), nbytes, tag)

    def __enter__(self):
        state["call"] = Call(*self.note, time.monotonic())
        return self

    def __exit__(self, *error):
        state["call"] = None


def progress():
    """The call in progress moved (a chunk finished): restart its watchdog clock."""
    call = state["call"]
    if call is not None:
        state["call"] = Call(*call[:4], time.monotonic())


def describe_call(call):
    op, peers, nbytes, tag, _ = call
    if op == "sendrecv":
        where = f"to rank {peers[0]}, from rank {peers[1]}"
    elif op in ("send", "isend"):
        where = f"to rank {peers[0]}"
    elif op in ("recv", "irecv"):
        where = f"from rank {peers[0]}"
    else:
        where = f"with ranks {list(peers)}"
    return f"{op} {where} ({nbytes} bytes{'' if tag is None else f', tag {tag}'})"


def doing():
    """The collective and pipeline action in progress, in words (empty where there is none)."""
    c = state["collective"]
    collective = None if c is None else (
        f"{c.name} #{c.number} ({c.algorithm}{f', {c.op}' if c.op else ''}"
        f"{'' if c.root is None else f', root {c.root}'}, {c.dtype.name} x {c.count})")
    return [what for what in (collective, state["action"]) if what]


def waiting_on():
    """A line naming the blocking call this process is inside, or '' when it is not blocked."""
    call = state["call"]
    if call is None:
        return ""
    op, peers, nbytes, _, _ = call
    peer = peers[0] if op != "sendrecv" and len(peers) == 1 else tuple(peers)
    text = f"rank {world_rank()} blocked in {op} with peer {peer} ({nbytes} bytes)"
    return text + "".join(f"; {what}" for what in doing())


def report():
    """What this rank is doing, as a peer is told: its blocked call, collective and action."""
    call = state["call"]
    return {"rank": world_rank(), "exiting": state["exiting"],
            "call": describe_call(call) if call else None,
            "waits_for": list(call.peers) if call else [],
            "seconds": time.monotonic() - call.since if call else 0.0,
            "doing": doing()}


def _peer_line(answer):
    if answer is None:
        return "no answer (its process is gone, or frozen outside Python)"
    if answer["exiting"]:
        return "has finished its program and waits at exit"
    if answer["call"] is None:
        return "is not inside a minipar call: it is computing, or stuck outside communication"
    extra = "".join(f"; {w}" for w in answer["doing"])
    return f"waits in {answer['call']} for {answer['seconds']:.1f} s{extra}"


# ----------------------------------------------------------------------------------------------
# The private channel: ask peers what they do; answer when asked
# ----------------------------------------------------------------------------------------------

def ask(ranks, patience=1.0):
    """{rank: report or None} from the given world ranks, each within ``patience`` seconds."""
    side = _watch["side"]
    if side is None:
        return {r: None for r in ranks}
    sends = [side.isend(None, dest=r, tag=REQUEST) for r in ranks]
    answers, deadline, status = {r: None for r in ranks}, time.monotonic() + patience, MPI.Status()
    waiting = set(ranks)
    while waiting and time.monotonic() < deadline:
        _serve(side, status)  # peers asking at the same moment get their answer meanwhile
        message = side.improbe(source=MPI.ANY_SOURCE, tag=REPLY, status=status)
        if message is not None:
            answer = message.recv()
            answers[answer["rank"]] = answer
            waiting.discard(answer["rank"])
        else:
            time.sleep(0.01)
    for request in sends:
        request.Test()
    return answers


def _serve(side, status):
    """Answer every request waiting (a matched probe: two threads serving never take the same
    request, nor wait for one that the other took)."""
    while (message := side.improbe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status)) is not None:
        message.recv()
        side.send(report(), dest=status.Get_source(), tag=REPLY)


def _loop(side):
    status = MPI.Status()
    while True:
        time.sleep(0.1)
        _serve(side, status)
        call, timeout = state["call"], _watch["timeout"]
        if call is not None and timeout > 0 and time.monotonic() - call.since > timeout:
            _trip(call, timeout)


def _trip(call, timeout):
    """No progress for ``timeout`` seconds: say what this rank waits for and what the peers do,
    then end the job (status 1)."""
    me = world_rank()
    lines = [f"minipar watchdog: no progress for {time.monotonic() - call.since:.1f} s "
             f"(MINIPAR_TIMEOUT={timeout:g}) in {describe_call(call)}"]
    lines += [f"  inside {what}" for what in doing()]
    peers = [r for r in call.peers if r != me] or [r for r in range(MPI.COMM_WORLD.Get_size())
                                                if r != me]
    for rank, answer in sorted(ask(peers).items()):
        lines.append(f"  rank {rank} {_peer_line(answer)}")
    _abort(lines)


def _abort(lines):
    rank = world_rank()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    _end_job()


def _end_job():
    """MPI_Abort with status 1, once mpiexec has had a moment to pass on what was printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)  # mpiexec forwards output asynchronously; an abort at once can lose it
    MPI.COMM_WORLD.Abort(1)


def start(timeout=None):
    """Start the watchdog thread and its private channel (collective: every rank calls it once,
    as ``comm.world()`` does). ``timeout`` seconds (None: MINIPAR_TIMEOUT; 0: no watchdog)."""
    if timeout is not None:
        set_timeout(timeout)
    if _watch["side"] is None and MPI.COMM_WORLD.Get_size() > 1:
        _watch["side"] = MPI.COMM_WORLD.Dup()
        _watch["thread"] = threading.Thread(target=_loop, args=(_watch["side"],), daemon=True,
                                            name="minipar-watchdog")
        _watch["thread"].start()
        atexit.register(_at_exit)


def set_timeout(seconds):
    """Seconds without progress after which a blocking call ends the job (0: never)."""
    if seconds < 0:
        raise ValueError(f"the watchdog timeout must be 0 (off) or positive, got {seconds}")
    _watch["timeout"] = float(seconds)


# ----------------------------------------------------------------------------------------------
# Failure ends the job
# ----------------------------------------------------------------------------------------------

def _at_exit():
    """Wait for every rank at exit; if a peer is blocked on this one, name it and abort."""
    if MPI.Is_finalized():  # the program finalized MPI itself: nothing to wait for
        return
    side, me = _watch["side"], world_rank()
    state["exiting"] = True
    everyone = side.Ibarrier()
    others = [r for r in range(side.Get_size()) if r != me]
    next_ask = time.monotonic() + 0.5
    while not everyone.Test():
        time.sleep(0.01)
        if time.monotonic() < next_ask:
            continue
        next_ask = time.monotonic() + 1.0
        stuck = {r: a for r, a in ask(others).items()
                 if a and a["call"] and me in a["waits_for"] and a["seconds"] > 0.5}
        if stuck:
            _abort([f"this rank reached the end of its program while rank {r} still waits for "
                    f"it in {a['call']}" + "".join(f"; {w}" for w in a["doing"])
                    + ": a rank skipped a call its peers made, or returned early"
                    for r, a in sorted(stuck.items())])


def _abort_on_uncaught(exc_type, exc, tb):
    """Print the traceback with the rank, then end every rank of the job (never a hang)."""
    rank = world_rank()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"[minipar rank {rank}] uncaught exception, aborting the job:\n"
                     + "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        _end_job()


def install_abort_hook():
    """Make an uncaught exception on any rank abort the whole MPI job (idempotent)."""
    if sys.excepthook is not _abort_on_uncaught:
        sys.excepthook = _abort_on_uncaught
