"""What a failed check says: the one block a student acts on, and the helpers that write it.

checks.py's checks call these: ``_expect`` (expected against got, where they first differ),
``_attempt`` (an exception as the block, with the line of the task's own file it came from),
``_on_ranks`` (a multi-rank check under synchronous or eager sends, a rank's block or, for a
hang, who waits on whom), ``_gradcheck``, ``_expect_traffic`` (the idea's messages, by the
communicator's counters) and ``_Watch`` with ``_expect_partial_sums`` (what the messages carry,
the collectives called, none of MPI's own). The grader's sandbox imports its own copy of this module, as of
minipar.testing (assignments/sandbox.py): a tree's copy made to pass everything never grades it.
"""
import numpy as np

from minipar.testing import run_on_ranks

TIMEOUT = 40  # seconds per multi-rank job: a stub that hangs is reported, not waited on


# --- what a failed check says -------------------------------------------------------------------
def _difference(got, want):
    """'' when got equals want (NaN where NaN is expected too), else where they first differ."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"expected shape {want.shape}, got shape {got.shape}"
    close = np.isclose(got, want, rtol=1e-10, atol=1e-12, equal_nan=True)
    bad = np.flatnonzero(~close.reshape(-1))
    if bad.size == 0:
        return ""
    i = int(bad[0])
    at = tuple(int(k) for k in np.unravel_index(i, want.shape)) if want.ndim > 1 else i
    return (f"expected {want.reshape(-1)[i].item()!r} at index {at}, got "
            f"{got.reshape(-1)[i].item()!r} (the first of {bad.size} differing elements of "
            f"{want.size})")


def _expect(task, check, got, want, note=""):
    """An AssertionError whose first lines are the block a student acts on."""
    difference = _difference(got, want)
    if difference:
        note = f"\n  {note}" if note else ""
        raise AssertionError(f"Task {task}: {check}\n  {difference}{note}")


def _attempt(task, check, call, files):
    """call(); an exception it raises (a CommError, the stub's NotImplementedError) becomes the
    block, with the line of the task's own file it came from."""
    import traceback
    try:
        return call()
    except AssertionError:
        raise
    except Exception as error:
        lines = [f"  at {_shown(f.filename)}:{f.lineno} in {f.name}: {f.line}"
                 for f in traceback.extract_tb(error.__traceback__)
                 if f.filename.replace("\\", "/").endswith(files)]
        raise AssertionError(f"Task {task}: {check}\n  raised {type(error).__name__}: {error}"
                             + "".join("\n" + line for line in lines[-1:])) from error


def _shown(path):
    """A path as the student knows it: relative to the tree (the folder the checks run in)."""
    import os
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


_doing = [""]  # the check a rank is in, for _watch_stuck


def _watch_stuck(files):
    """A thread printing, once, the line of the task's own file where this rank's main thread
    waits when its minipar call has made no progress for most of the watchdog's time (the
    watchdog names the call and the peers, not the line)."""
    import os
    import sys
    import threading
    import time
    import traceback

    from minipar.comm import watch
    after = 0.6 * float(os.environ.get("MINIPAR_TIMEOUT") or 20)
    main = threading.main_thread().ident

    def look():
        while True:
            time.sleep(0.2)
            call = watch.state["call"]
            if call is None or time.monotonic() - call.since < after:
                continue
            frames = [f for f in traceback.extract_stack(sys._current_frames()[main])
                      if f.filename.replace("\\", "/").endswith(files)]
            where = (f" at {_shown(frames[-1].filename)}:{frames[-1].lineno} in "
                     f"{frames[-1].name}: {frames[-1].line}" if frames else "")
            # one write per line: the ranks' lines reach mpiexec's output whole
            sys.stderr.write(f"minipar check: rank {watch.world_rank()} stuck in "
                             f"{_doing[0]}{where}\n")
            sys.stderr.flush()
            return
    threading.Thread(target=look, daemon=True).start()


def _on_ranks(task, check, body, nprocs, sends, *args):
    """run_on_ranks(body, nprocs, args=(task, *args)), its sends ``synchronous`` (every send
    waits for its receive) or ``eager`` (MPI's usual); a failure is re-raised as the block a rank
    wrote (or, for a hang, who waits on whom and where), the details trimmed after it."""
    import os
    env = {"MINIPAR_SYNC_SENDS": "1" if sends == "synchronous" else "0",
           "MINIPAR_TIMEOUT": os.environ.get("MINIPAR_TIMEOUT") or "10"}
    try:
        return run_on_ranks(body, nprocs, timeout=TIMEOUT, args=(task, *args), env=env)
    except AssertionError as error:
        raise AssertionError(_feedback(task, check, nprocs, sends, str(error))) from None


def _feedback(task, check, nprocs, sends, text):
    import re
    detail = [line for line in text.strip().splitlines() if line.strip(" ^~")]
    blocks = re.findall(r"^AssertionError: (Task .*?)(?=\n--- |\nranks \[|\Z)", text, re.S | re.M)
    if blocks:  # a rank's own block, the same on every failing rank as a rule: the first
        ranks = re.findall(r"^--- rank (\d+) ---", text, re.M)
        head = (blocks[0].strip() + f"\n  (failed on rank{'s' * (len(ranks) > 1)} "
                f"{', '.join(ranks)} of {nprocs}, {sends} sends)")
        return head + "\n--- details ---\n" + "\n".join(detail[:20] + ["..."] * (len(detail) > 20))
    # a hang: where each rank waits in the task's files (_watch_stuck), then the watchdog's
    # who-waits-on-whom (or, past run_on_ranks' timeout, the call each rank is blocked in)
    where = {}
    for rank, case, at in re.findall(r"minipar check: rank (\d+) stuck in (.*?)(?: at (.*))?$",
                                     text, re.M):
        where.setdefault((case, at), []).append(int(rank))
    lines = [f"ranks {sorted(ranks)} stuck in {case}" + (f"\n    at {at}" if at else "")
             for (case, at), ranks in where.items()]
    lines += list(dict.fromkeys(line.strip() for line in detail if re.search(
        r"minipar watchdog|^\[rank \d+\]   |blocked in", line)))[:12]
    said = ("hung (does a send wait for a receive never posted?):\n  " + "\n  ".join(lines)
            if lines else "failed")
    return (f"Task {task}: {check}, on {nprocs} ranks with {sends} sends: the ranks {said}"
            + "\n--- details ---\n" + "\n".join(detail[:3 if lines else 20]))


def _gradcheck(task, what, fn, *arrays):
    from minipar.gradcheck import gradcheck
    shapes = " and ".join(str(a.shape) for a in arrays)
    try:
        gradcheck(fn, *arrays)
    except AssertionError as error:
        raise AssertionError(f"Task {task}: {what}, inputs of shapes {shapes}, against finite "
                             f"differences\n  {error}") from None


def _fold_plan(p):
    """(pof2, rem, steps) of MPICH's fold for p ranks, worked out here rather than read from
    the tree's code under test: the largest power of two <= p, the ranks beyond it, log2 pof2."""
    pof2 = 1 << (p.bit_length() - 1)
    return pof2, p - pof2, pof2.bit_length() - 1


def _traffic(algorithm, p, n):
    """(messages each rank sends, elements all ranks send together) in one all-reduce of n
    elements: the idea's own count, which a call to MPI's own all-reduce does not make."""
    if algorithm == "ring":  # p-1 steps of the reduce-scatter and p-1 of the all-gather, n/p each
        return [2 * (p - 1)] * p, 2 * (p - 1) * n
    # recursive halving: log2 pof2 steps of halving and as many of doubling among the ranks left
    # after the fold; a folded pair (2i, 2i+1 below 2 rem) passes one whole vector each way
    pof2, rem, steps = _fold_plan(p)
    sends = [1 if r < 2 * rem and r % 2 == 0 else (r < 2 * rem) + 2 * steps for r in range(p)]
    return sends, 2 * (pof2 - 1) * n + 2 * rem * n


def _expect_traffic(task, check, world, algorithm, n, counted):
    """Every rank's messages and bytes sent, by the communicator's counters, against the idea."""
    seen = world.all_gather_object((counted["messages_sent"], counted["bytes_sent"]))
    messages, elements = _traffic(algorithm, world.size, n)
    got = [m for m, _ in seen]
    total = sum(b for _, b in seen)
    if got != messages or total != 8 * elements:
        raise AssertionError(
            f"Task {task}: {check}: the messages the idea sends, by the communicator's "
            f"counters\n  expected {messages} messages sent by ranks 0..{world.size - 1} and "
            f"{8 * elements} bytes in all, got {got} messages and {total} bytes"
            + ("\n  too few: is part of the work done by MPI's own collective, which sends "
               "no message the counters see?" if sum(got) < sum(messages) else ""))


# --- what the messages carry, and MPI's own collectives kept out -------------------------------
# mpi4py's calls that compute or move data for all the ranks at once: a hand-coded collective
# that makes one has let MPI do the idea (Barrier moves nothing and stays allowed)
MPI_COLLECTIVES = tuple(f"{i}{name}" for i in ("", "I") for name in (
    "Allreduce", "Reduce", "Bcast", "Reduce_scatter", "Reduce_scatter_block", "Allgather",
    "Allgatherv", "Gather", "Gatherv", "Scatter", "Scatterv", "Alltoall", "Alltoallv",
    "Alltoallw", "Scan", "Exscan")) + ("allreduce", "reduce", "bcast", "allgather", "gather",
                                       "scatter", "alltoall", "scan", "exscan")


class _Watch:
    """While its block runs: the payload of every message this rank sends through the
    communicator's wires (``sent``: (verb, dest, copy) in order; Wire's verbs wrapped), each of
    minipar's collective calls (``collectives``), and every call of one of MPI's own collectives
    made with a frame of ``files`` on the stack (``called``). mpi4py's types cannot be patched,
    so the communicators the task can reach (MPI.COMM_WORLD, COMM_SELF, the communicator's and
    each wire's) are swapped for a subclass that notes the call. A call from a function named
    in ``exempt`` (the file's own agreement of the ranks' arguments, outside the task) is not."""

    VERBS = ("Send", "Sendrecv", "Isend")

    def __init__(self, files, world, exempt=()):
        self.files, self.world, self.sent, self.called = files, world, [], []
        self.exempt = exempt
        self.collectives = []  # (collective, op, elements) of each of minipar's calls

    def __enter__(self):
        from mpi4py import MPI

        from minipar.comm.wire import Wire
        self.originals = {verb: getattr(Wire, verb) for verb in (*self.VERBS, "call")}
        for verb in self.VERBS:
            setattr(Wire, verb, self._recording(verb, self.originals[verb]))
        collectives, call = self.collectives, self.originals["call"]

        def noted_call(wire, collective, algorithm, op, x, *args, **kwargs):
            collectives.append((collective, op, int(x.size)))
            return call(wire, collective, algorithm, op, x, *args, **kwargs)
        Wire.call = noted_call
        watched = type("Intracomm", (MPI.Intracomm,), {
            name: self._noting(name) for name in MPI_COLLECTIVES if hasattr(MPI.Intracomm, name)})
        self.swapped = [(MPI, "COMM_WORLD", MPI.COMM_WORLD), (MPI, "COMM_SELF", MPI.COMM_SELF)]
        for owner in [self.world, *(w for w in vars(self.world).values() if isinstance(w, Wire))]:
            self.swapped += [(owner, name, comm) for name, comm in vars(owner).items()
                             if isinstance(comm, MPI.Comm)]
        for owner, name, comm in self.swapped:
            setattr(owner, name, watched(comm))  # the same MPI communicator, another type
        return self

    def _recording(self, verb, original):
        sent = self.sent

        def recorded(wire, x, dest, *args, **kwargs):
            sent.append((verb, dest, np.array(x, copy=True)))
            return original(wire, x, dest, *args, **kwargs)
        return recorded

    def _noting(self, name):
        import sys
        files, called, exempt = self.files, self.called, self.exempt

        def noted(comm, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.replace("\\", "/").endswith(files):
                    if frame.f_code.co_name in exempt:
                        break
                    called.append(f"MPI.Intracomm.{name} at {_shown(frame.f_code.co_filename)}:"
                                  f"{frame.f_lineno}")
                    break
                frame = frame.f_back
            return getattr(super(type(comm), comm), name)(*args, **kwargs)
        return noted

    def __exit__(self, *error):
        from minipar.comm.wire import Wire
        for owner, name, comm in self.swapped:
            setattr(owner, name, comm)
        for verb, original in self.originals.items():
            setattr(Wire, verb, original)

    def expect_no_mpi_collective(self, task, check):
        if self.called:
            raise AssertionError(
                f"Task {task}: {check}: MPI's own collectives do the work the task is to write\n"
                f"  the task's code called {'; '.join(dict.fromkeys(self.called))}\n  a "
                f"hand-coded collective moves its data with point-to-point messages only")

    def expect_collectives(self, task, check, want, hint):
        """The collectives called since the last look (and none of MPI's own) against ``want``,
        [(collective, op, elements)]: the idea's communication, not only its result."""
        self.expect_no_mpi_collective(task, check)
        got, self.collectives[:] = list(self.collectives), []
        if got != want:
            raise AssertionError(f"Task {task}: {check}: the collectives it calls\n  expected "
                                 f"{want or 'none'}\n  got      {got or 'none'}\n  {hint}")


def _partial_sums(algorithm, p, r):
    """The messages rank r sends in one sum all-reduce when rank q's input is 2**q everywhere:
    each message's value, the sum of the inputs it carries, bit q set for rank q's. The ring:
    step k of the reduce-scatter carries ranks r-k..r, the all-gather the whole sum. Recursive
    halving: a folded even rank sends its own input; step k sends the partial sum over the
    newranks that differ from this one in the top k bits, each standing for its real ranks;
    then the doubling steps and the fold's hand-back carry the whole sum."""
    full = 2 ** p - 1
    if algorithm == "ring":
        return [sum(2 ** ((r - t) % p) for t in range(k + 1)) for k in range(p - 1)] \
            + [full] * (p - 1)
    pof2, rem, steps = _fold_plan(p)
    if r < 2 * rem and r % 2 == 0:
        return [2 ** r]
    me = r // 2 if r < 2 * rem else r - rem
    held = [2 ** (2 * j) + 2 ** (2 * j + 1) if j < rem else 2 ** (j + rem) for j in range(pof2)]
    halving = [sum(held[j] for j in range(pof2) if (j ^ me) & ((pof2 >> k) - 1) == 0)
               for k in range(steps)]
    return halving + [full] * steps + [full] * (r < 2 * rem)


def _expect_partial_sums(task, check, world, algorithm, sent):
    """Each message this rank sent in one sum all-reduce of 2**rank everywhere carries the
    partial sum the idea puts in it (``_partial_sums``), on every element: the counts alone
    are met by any messages of the right sizes."""
    want = _partial_sums(algorithm, world.size, world.rank)
    got = [np.unique(payload).tolist() for _, _, payload in sent]

    def ranks(value):
        value = int(value)
        return "ranks " + "+".join(str(q) for q in range(world.size) if value >> q & 1) \
            if 0 < value < 2 ** world.size else f"{value!r}"
    for k, (values, value) in enumerate(zip(got, want)):
        if values and values != [value]:
            shown = ", ".join(ranks(v) if float(v).is_integer() else repr(v) for v in values[:3])
            raise AssertionError(
                f"Task {task}: {check}: message {k} rank {world.rank} sends carries the wrong "
                f"partial sum\n  with rank q's input 2**q everywhere, message {k} of rank "
                f"{world.rank} ({sent[k][0]} to rank {sent[k][1]}) should carry the sum of "
                f"{ranks(value)} ({value}) on every element, got {shown}"
                + ("\n  (step k of the ring's reduce-scatter adds this rank's chunk to the "
                   "partial sum it received at step k-1)" if algorithm == "ring" else
                   "\n  (each halving step sends the half of the window the partner keeps, "
                   "summed over every rank this one has received from)"))
    if len(got) != len(want):
        raise AssertionError(
            f"Task {task}: {check}: rank {world.rank} sent {len(got)} messages through the "
            f"communicator, the idea sends {len(want)}")
