"""The timeline: what each rank did and when, measured or simulated, and ways to look at it.

An ``Event`` is one action on one rank: ``(rank, start, end, kind, mb, chunk)``, times in seconds.
The simulator emits them from a schedule and per-action costs; the runtime records the same with
a ``Tracer`` around each action, and ``gather_events`` brings every rank's records to one. So a
bubble measured on real ranks and one simulated from the schedule come from one function:

    makespan(events)          t_end - t_start: the first action's start to the last one's end
    bubble_fraction(events)   idle / (ranks x makespan): 1 - sum(work) / (P * (t_end - t_start))
    peak_inflight(events)     most micro-batches whose activations a rank holds at once
    text_gantt(events)        rows ranks, columns time, cells F3 / B3 / W3, '.' idle (folds to a width)
    chrome_trace(events)      Chrome-trace JSON (complete "X" events, microseconds): open in Perfetto

(The teaching layer draws the same chart as a labelled figure: ``minipar.figures``.)
"""
import contextlib
import json
import textwrap
import time
from dataclasses import dataclass

# Kinds: F forward, B backward (input and weight gradient, or input only when W is separate),
# W weight gradient, BW a whole backward where W is otherwise separate (DualPipeV; its F&B pair
# is recorded as its F and its B), R re-computed forward (re-materialisation), OPT_STEP, and the
# messages SEND_F / RECV_F / SEND_B / RECV_B. Work is F, B, W, BW, R and OPT_STEP; time spent in
# a message (a receive waiting for its data) is not work, so it counts as bubble.
WORK_KINDS = ("F", "B", "W", "BW", "R", "OPT_STEP")


@dataclass(frozen=True)
class Event:
    """One action on one rank, ``start``/``end`` in seconds from a common origin."""

    rank: int
    start: float
    end: float
    kind: str
    mb: int = -1
    chunk: int = 0

    @property
    def duration(self):
        return self.end - self.start

    @property
    def label(self):
        """``F3`` for micro-batch 3; a chunk letter is appended by the drawers when chunks > 1."""
        return self.kind if self.mb < 0 else f"{self.kind}{self.mb}"


class Tracer:
    """Records events on one rank: ``with tracer.record("F", mb=3, chunk=0): ...``.

    Start every rank's tracer just after a barrier so their clocks share an origin (perf_counter
    is per process; a barrier aligns them to within its latency). Gather ``tracer.events`` to one
    rank (they pickle) and hand the concatenated list to the functions below.
    """

    def __init__(self, rank, clock=time.perf_counter):
        self.rank, self.clock, self.events = rank, clock, []
        self.origin = clock()

    @contextlib.contextmanager
    def record(self, kind, mb=-1, chunk=0):
        start = self.clock() - self.origin
        try:
            yield
        finally:
            self.events.append(Event(self.rank, start, self.clock() - self.origin, kind, mb, chunk))


def rank_count(events, n_ranks=None):
    """``n_ranks``, or the ranks the events name."""
    return n_ranks if n_ranks is not None else 1 + max(e.rank for e in events)


def span(events):
    """(first start, last end) over all ranks."""
    if not events:
        raise ValueError("no events: nothing ran")
    return min(e.start for e in events), max(e.end for e in events)


def makespan(events):
    """Seconds from the first action's start to the last one's end, over all ranks."""
    t0, t1 = span(events)
    return t1 - t0


def bubble_per_rank(events, n_ranks=None):
    """Idle fraction of each rank over the whole timeline: 1 - work_r / makespan."""
    total = makespan(events)
    work = [0.0] * rank_count(events, n_ranks)
    for e in events:
        if e.kind in WORK_KINDS:
            work[e.rank] += e.duration
    return [1.0 - w / total for w in work]


def bubble_fraction(events, n_ranks=None):
    """The pipeline bubble: idle time over total time, averaged over ranks (total = makespan)."""
    per_rank = bubble_per_rank(events, n_ranks)
    return sum(per_rank) / len(per_rank)


def peak_inflight(events, n_ranks=None):
    """Per rank, the most micro-batches whose full activations are live at one moment.

    A micro-batch is live on a (rank, chunk) from the start of its F to the end of its B. With
    re-materialisation (an R event for it) the forward keeps only its input, so it is live during
    F, then again from the start of R to the end of B. W needs only the layer inputs and output
    gradients (Zero Bubble's smaller M_W), so it does not extend the count.
    """
    spans = {}
    for e in events:
        if e.kind in ("F", "R", "B", "BW") and e.mb >= 0:  # BW ends a micro-batch as B does
            spans.setdefault((e.rank, e.chunk, e.mb), {})[{"BW": "B"}.get(e.kind, e.kind)] = e
    deltas = [[] for _ in range(rank_count(events, n_ranks))]
    for (rank, _, _), ev in spans.items():
        if "F" not in ev:
            continue
        end = ev["B"].end if "B" in ev else ev["F"].end
        if "R" in ev:
            intervals = [(ev["F"].start, ev["F"].end), (ev["R"].start, end)]
        else:
            intervals = [(ev["F"].start, end)]
        for a, b in intervals:
            deltas[rank] += [(a, 1), (b, -1)]
    peaks = []
    for d in deltas:
        live = peak = 0
        for _, step in sorted(d):  # at equal times -1 sorts first: a B ending frees before F starts
            live += step
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def work_events(events):
    """The events that are work (F, B, W, R, OPT_STEP) and took time: what the drawings show."""
    return [e for e in events if e.kind in WORK_KINDS and e.duration > 0]


def _cell_label(e, chunked):
    if e.kind == "OPT_STEP":
        return "S"  # the optimizer step
    return e.label + (chr(ord("a") + e.chunk) if chunked and e.mb >= 0 else "")


LEGEND = ("F forward, B backward, W weight gradient, R re-computed forward, S optimizer step, "
          ". idle")


def text_gantt(events, n_ranks=None, unit=None, width=None, legend=False, labels=None):
    """A text Gantt chart: one row per rank, one column per ``unit`` of time (default: the
    shortest work event), each cell the action running then (``F3``, ``B3``, ``W3``; chunk letters
    ``F3a``/``F3b`` when ranks hold several chunks; ``S`` the optimizer step) or ``.`` when the
    rank is idle.

    ``width`` (e.g. the terminal's) folds a chart wider than that many characters into blocks of
    columns, each headed by the time steps it shows; ``legend`` adds a line naming the cells;
    ``labels`` names the rows (default ``rank r``: e.g. the world ranks of one pipeline group)."""
    work = work_events(events)
    if not work:
        return ""
    unit = unit or min(e.duration for e in work)
    t0, t1 = span(events)
    n_cols = max(1, round((t1 - t0) / unit))
    chunked = any(e.chunk > 0 for e in work)
    cell = max(len(_cell_label(e, chunked)) for e in work)
    rows = [["."] * n_cols for _ in range(rank_count(events, n_ranks))]
    for e in work:  # every action gets at least one cell, however short it was
        lo = min(round((e.start - t0) / unit), n_cols - 1)
        for col in range(lo, max(lo + 1, round((e.end - t0) / unit))):
            rows[e.rank][min(col, n_cols - 1)] = _cell_label(e, chunked)
    labels = labels or [f"rank {r}" for r in range(len(rows))]
    name = max(len(label) for label in labels)
    per_line = n_cols if width is None else max(1, (width - name - 3 + 1) // (cell + 1))
    blocks = []
    for lo in range(0, n_cols, per_line):
        hi = min(lo + per_line, n_cols)
        head = [] if per_line >= n_cols else [f"{'':<{name}}   time steps {lo}-{hi - 1} of {n_cols}"]
        blocks.append("\n".join(head + [
            f"{label:<{name}} | " + " ".join(c.ljust(cell) for c in row[lo:hi]).rstrip()
            for label, row in zip(labels, rows)]))
    lines = "\n\n".join(blocks)
    if legend:
        key = LEGEND + ("; BW backward with its weight gradient" if any(e.kind == "BW" for e in work)
                        else "") + ("; a, b: a rank's first, second chunk" if chunked else "")
        lines += "\n" + (textwrap.fill(key, width) if width else key)
    return lines


def _trace_name(e, chunked):
    """``F3`` for micro-batch 3, ``F3.c1`` for its chunk 1 when ranks hold several chunks."""
    return e.label + (f".c{e.chunk}" if chunked and e.mb >= 0 else "")


def chrome_trace(events, n_ranks=None, to_us=1e6):
    """Chrome-trace JSON (a dict): complete events (ph "X", ts/dur in microseconds), one row per
    rank (pid 0, tid = rank, named "rank r"), each named ``F3`` (``F3.c1``: chunk 1 of an
    interleaved rank). Zero-length events are left out. Save with
    ``json.dump`` and open in https://ui.perfetto.dev or chrome://tracing."""
    meta = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    for r in range(rank_count(events, n_ranks)):
        meta.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r, "args": {"sort_index": r}})
    chunked = any(e.chunk > 0 for e in events)
    body = [{"name": _trace_name(e, chunked), "cat": e.kind, "ph": "X", "ts": e.start * to_us, "dur": e.duration * to_us,
             "pid": 0, "tid": e.rank, "args": {"mb": e.mb, "chunk": e.chunk}}
            for e in sorted(events, key=lambda e: (e.rank, e.start)) if e.duration > 0]
    return {"traceEvents": meta + body, "displayTimeUnit": "ms"}


def write_chrome_trace(events, path, n_ranks=None, to_us=1e6):
    with open(path, "w") as f:
        json.dump(chrome_trace(events, n_ranks, to_us), f)


def gather_events(comm, events, root=0):
    """Every rank's trace events on ``root`` (one list, pickled by mpi4py), None elsewhere."""
    parts = comm.gather_object(events, root=root)
    return [e for part in parts for e in part] if parts is not None else None
