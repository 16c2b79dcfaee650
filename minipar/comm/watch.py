"""Nothing hangs silently: who waits on whom, a watchdog in every run, and a failing rank ends
the job.

Bookkeeping. Every blocking call notes itself in ``state["call"]`` while it waits: (op, peers as
world ranks, bytes, tag, the time of its last progress), and a collective notes itself in
``state["collective"]`` (name, call number, algorithm, ...: put into words only when someone
asks, so the note costs a collective call no string formatting), a pipeline action in
``state["action"]``. ``waiting_on()`` turns that into a line; the test harness prints it when a
run times out, and the watchdog below prints it on its own.

Watchdog (``start``, called by ``comm.world()``). A thread checks ten times a second whether the
call in progress has made no progress for ``MINIPAR_TIMEOUT`` seconds (default 120; ``0`` turns
it off, for debuggers; ``world(timeout=...)`` sets it too). Large transfers move in chunks that
each count as progress (chunks.py), so only a stuck call trips it. It then asks the peers
it waits on what they are doing, over a private duplicate of the world communicator that the
same thread serves for every other rank, prints what this rank waits for and what they answered,
and ends the job with MPI_Abort, status 1.

Failure ends the job. From the import of ``minipar.comm``, an uncaught exception on any rank
prints its traceback, each line prefixed ``[rank r]``, and aborts the whole job. A rank that
reaches the end of its program waits at exit until every rank does; if meanwhile a peer reports
that it is blocked on this rank (it skipped a collective, or returned early), the leaving rank
names the peer and the call and aborts the job instead of leaving it waiting for ever.
"""
import atexit
import contextlib
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

state = {"call": None, "collective": None, "action": None, "exiting": False}
REQUEST, REPLY = 1, 2  # tags on the private channel
_watch = {"timeout": float(os.environ.get("MINIPAR_TIMEOUT", "120") or 0), "side": None,
          "thread": None}


def world_rank():
    return MPI.COMM_WORLD.Get_rank()


# ----------------------------------------------------------------------------------------------
# What this rank is doing
# ----------------------------------------------------------------------------------------------

def world_ranks(mpi_comm):
    """The world ranks of the ranks of mpi4py communicator ``mpi_comm``, in its order."""
    return tuple(MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(mpi_comm.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


@contextlib.contextmanager
def blocking(op, peers, nbytes=0):
    """Note a blocking call into MPI itself (a barrier, a communicator split, a shared window's
    allocation) that waits on world ranks ``peers``, so that the watchdog and the exit check see
    a rank waiting there as they see one in a send or a receive."""
    state["call"] = (op, tuple(peers), nbytes, None, time.monotonic())
    try:
        yield
    finally:
        state["call"] = None


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
        f"{c[0]} #{c[1]} ({c[2]}{f', {c[3]}' if c[3] else ''}"
        f"{'' if c[4] is None else f', root {c[4]}'}, {c[5].name} x {c[6]})")
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
            "waits_for": list(call[1]) if call else [],
            "seconds": time.monotonic() - call[4] if call else 0.0,
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
        if call is not None and timeout > 0 and time.monotonic() - call[4] > timeout:
            _trip(call, timeout)


def _trip(call, timeout):
    """No progress for ``timeout`` seconds: say what this rank waits for and what the peers do,
    then end the job (status 1)."""
    me = world_rank()
    lines = [f"minipar watchdog: no progress for {time.monotonic() - call[4]:.1f} s "
             f"(MINIPAR_TIMEOUT={timeout:g}) in {describe_call(call)}"]
    lines += [f"  inside {what}" for what in doing()]
    peers = [r for r in call[1] if r != me] or [r for r in range(MPI.COMM_WORLD.Get_size())
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
