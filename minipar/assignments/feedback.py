"""What a failed check says: the one block a student acts on, and the helpers that write it.

checks.py's checks call these: ``_expect`` (expected against got, where they first differ),
``_attempt`` (an exception as the block, with the line of the task's own file it came from),
``_on_ranks`` (a multi-rank check under synchronous or eager sends, a rank's block or, for a
hang, who waits on whom), ``_gradcheck`` and ``_expect_traffic`` (the idea's messages, by the
communicator's counters). The grader's sandbox imports its own copy of this module, as of
minipar.testing (assignments/sandbox.py): a tree's copy made to pass everything never grades it.
"""
import numpy as np

from minipar.testing import run_on_ranks

TIMEOUT = 40  # seconds per multi-rank job: a stub that hangs is reported, not waited on


# --- what a failed check says -------------------------------------------------------------------
def _difference(got, want):
    """'' when got equals want, else where they first differ, in words."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"expected shape {want.shape}, got shape {got.shape}"
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-10, atol=1e-12).reshape(-1))
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


def _traffic(algorithm, p, n):
    """(messages each rank sends, elements all ranks send together) in one all-reduce of n
    elements: the idea's own count, which a call to MPI's own all-reduce does not make."""
    if algorithm == "ring":  # p-1 steps of the reduce-scatter and p-1 of the all-gather, n/p each
        return [2 * (p - 1)] * p, 2 * (p - 1) * n
    # recursive halving: log2 pof2 steps of halving and as many of doubling among the ranks left
    # after the fold; a folded pair (2i, 2i+1 below 2 rem) passes one whole vector each way
    pof2 = 1 << (p.bit_length() - 1)
    rem, steps = p - pof2, pof2.bit_length() - 1
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
