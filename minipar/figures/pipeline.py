"""Pipeline pictures: the schedule chart (a labelled Gantt), bubble against m, the speed-up grid.

    schedule_chart(events)   ranks as rows (rank 0 on top), one bar per F / B / W / BW / R /
                             optimizer step, labelled F3 (F3.c1: chunk 1 of an interleaved rank)
                             when the label fits; the bubble, and the theory's, in the title;
                             ``pairs=pair_spans(schedule, events)`` frames DualPipeV's F&B pairs
    bubble_chart(points)     (schedule, m, bubble, theory) points: theory a line, values markers
    speedup_chart(grid)      K -> M -> speed-up: measured markers, K*M/(M+K-1) a line per K
"""
from minipar.figures.style import (DPI, IDLE, KIND_COLOURS, KIND_NAMES, KIND_TEXT, MARKERS,
                                   PAIR_EDGE, colour, drawing, log2_axis, new_figure)
from minipar.parallel.pipeline.actions import FB
from minipar.parallel.pipeline.timeline import (WORK_KINDS, bubble_fraction, rank_count, span,
                                                work_events)

TIME_UNITS = {  # time_unit -> (scale from the events' times, x-axis label)
    "units": (1.0, "time (units of one stage forward)"),
    "s": (1.0, "time (s)"),
    "ms": (1e3, "time (ms)"),
}
LINESTYLES = ("-", "--", "-.", ":")
BAR_HEIGHT = 0.8  # of a rank's row
EMS = {"B": 0.7, "W": 1.0}  # the wide letters' widths in em (DejaVu Sans); the rest about 0.62
MAX_PATCHES = 2000  # work events drawn as one patch each; more are drawn as collections


def bar_label(e, chunked):
    """``F3``; ``F3.c1`` for chunk 1 when ranks hold several chunks (as in Chrome traces)."""
    if e.kind == "OPT_STEP":
        return "step"
    return e.label + (f".c{e.chunk}" if chunked and e.mb >= 0 else "")


def _darker(hex_colour, chunk):
    """A later chunk's bar: the kind's colour, darker by a quarter per chunk (at most half)."""
    from matplotlib.colors import to_hex, to_rgb
    f = 1 - min(0.25 * chunk, 0.5)
    return to_hex(tuple(c * f for c in to_rgb(hex_colour)))


def _labels(e, chunked):
    """A bar's labels, longest first: ``F3.c1``, then ``F3`` and ``3`` where space is short (the
    colour says the kind, the shade the chunk)."""
    full = bar_label(e, chunked)
    return [full] if e.mb < 0 else list(dict.fromkeys([full, e.label, str(e.mb)]))


def _fitting_label(labels, width_px, size):
    """(label, font size) of the first label that fits a bar ``width_px`` pixels wide at ``size``
    or up to 2 points smaller (a character is about 0.62 em, a B 0.7 and a W 1; never below 7
    points, so the labels of one chart look alike), or None: the bar stays unlabelled."""
    for text in labels:
        ems = sum(EMS.get(c, 0.62) for c in text)
        for points in (size, size - 1, size - 2):
            if points >= 7 and ems * points * DPI / 72 + 4 <= width_px:
                return text, points
    return None


def _title(title, measured, theory):
    text = f"{title} — bubble {measured:.3f}"
    if theory:
        formula, value = theory
        tail = f"theory {formula} = {value:.3f}"
        text += (",\n" if len(text) + len(tail) > 80 else ", ") + tail  # a second line if too long
    return text


def pair_spans(schedule, events):
    """Where each F&B pair of ``schedule`` ran in ``events`` (its simulated or measured timeline):
    (rank, start of its F, end of its B or BW), one per pair. An event is found by its rank, kind,
    chunk and micro-batch, which name one computation of a rank; a pair ran as its F, then its B."""
    by_key = {(e.rank, e.kind, e.chunk, e.mb): e for e in events}
    spans = []
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind == FB:
                f, b = (by_key[(rank, part.kind, part.chunk, part.mb)] for part in a.pair)
                spans.append((rank, f.start, b.end))
    return spans


@drawing
def schedule_chart(events, n_ranks=None, title=None, theory=None, time_unit="units", pairs=()):
    """The schedule as a Gantt chart: a row per rank, a bar per work event coloured by kind
    (a Rectangle in ``ax.patches`` each, up to MAX_PATCHES events; beyond, collections).

    ``events``: Events from ``minipar.parallel.pipeline.simulate`` (``time_unit="units"``) or a
    measured run's timeline in seconds (``time_unit="s"``, or ``"ms"`` to draw them in
    milliseconds). ``theory``: ``(formula, value)`` of the textbook bubble, put beside the bubble
    these events show in the title. ``pairs``: (rank, start, end) of each F&B pair, a forward
    run with another micro-batch's backward (``pair_spans``), each framed around its two bars."""
    from matplotlib.patches import Patch
    events = list(events)
    work = work_events(events)
    n = rank_count(events, n_ranks)
    t0, t1 = span(events)
    scale, xlabel = TIME_UNITS[time_unit]
    total = (t1 - t0) * scale
    chunked = any(e.chunk > 0 for e in work)
    fig, ax = new_figure(height=min(2.6 + 0.55 * n, 24))
    for r in range(n):  # the idle band behind each rank's bars (a collection, not a patch)
        ax.broken_barh([(0, total)], (r - BAR_HEIGHT / 2, BAR_HEIGHT), facecolors=IDLE, zorder=1)
    # Labels go inside bars wide enough for them: estimated from the axes' share of the figure.
    px_per_x = 0.8 * fig.get_figwidth() * DPI / total
    row_px = 0.75 * fig.get_figheight() * DPI / n * BAR_HEIGHT
    fontsize = min(11.0, 0.55 * row_px * 72 / DPI)
    shortest = min((e.duration for e in work), default=0) * scale * px_per_x
    edge = 0.8 if shortest >= 8 else 0  # white gaps between bars, where there is room
    for kind in WORK_KINDS:
        mine = [e for e in work if e.kind == kind]
        if not mine:
            continue
        colours = [_darker(KIND_COLOURS[kind], e.chunk) for e in mine]
        if len(work) <= MAX_PATCHES:  # a Rectangle patch per action, in ax.patches
            ax.barh([e.rank for e in mine], [e.duration * scale for e in mine],
                    left=[(e.start - t0) * scale for e in mine], height=BAR_HEIGHT, color=colours,
                    edgecolor="white", linewidth=edge, label=KIND_NAMES[kind], zorder=2)
        else:  # thousands of bars: one collection per rank, drawn alike, a hundred times faster
            for r in range(n):
                row = [(e, c) for e, c in zip(mine, colours) if e.rank == r]
                ax.broken_barh([((e.start - t0) * scale, e.duration * scale) for e, _ in row],
                               (r - BAR_HEIGHT / 2, BAR_HEIGHT), facecolors=[c for _, c in row],
                               edgecolor="white", linewidth=edge, zorder=2)
        for e in mine:
            fit = _fitting_label(_labels(e, chunked), e.duration * scale * px_per_x, fontsize)
            if fit:
                ax.text((e.start - t0 + e.duration / 2) * scale, e.rank, fit[0], ha="center",
                        va="center", fontsize=fit[1], color=KIND_TEXT[kind], zorder=3)
    pairs = list(pairs)
    if pairs:  # a frame around each pair's two halves, drawn over its bars (a collection per rank)
        for r in range(n):
            row = [((start - t0) * scale, (end - start) * scale) for q, start, end in pairs if q == r]
            if row:
                ax.broken_barh(row, (r - BAR_HEIGHT / 2 - 0.04, BAR_HEIGHT + 0.08), facecolors="none",
                               edgecolors=PAIR_EDGE, linewidth=1.6, zorder=4)
    kinds = [k for k in WORK_KINDS if any(e.kind == k for e in work)]
    handles = [Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    if pairs:
        handles.append(Patch(facecolor="none", edgecolor=PAIR_EDGE, linewidth=1.6,
                             label="F&B: a forward paired\nwith a backward"))
    if chunked:
        handles.append(Patch(facecolor=_darker(KIND_COLOURS["F"], 1), label="darker: a later chunk"))
    handles.append(Patch(facecolor=IDLE, edgecolor="#bbbbbb", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="action")
    ax.set_xlim(0, total)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.grid(False, axis="y")
    ax.set_axisbelow(True)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pipeline stage")
    text = _title(title or "pipeline schedule", bubble_fraction(events, n), theory)
    ax.set_title(text, wrap=True)
    return fig


@drawing
def bubble_chart(points, title=None, kind="measured"):
    """Bubble against micro-batches m, one colour per schedule: its theory a line, its ``kind``
    ("measured" or "simulated") values markers. ``points``: (schedule_label, m, value, theory)."""
    points = list(points)
    fig, ax = new_figure()
    labels = list(dict.fromkeys(p[0] for p in points))
    for i, label in enumerate(labels):
        rows = sorted((m, v, t) for name, m, v, t in points if name == label)
        theory = [(m, t) for m, _, t in rows if t is not None]
        if theory:
            ax.plot(*zip(*theory), color=colour(i), linestyle=LINESTYLES[i % len(LINESTYLES)],
                    linewidth=2.2, label=f"{label} theory")
        values = [(m, v) for m, v, _ in rows if v is not None]
        if values:  # hollow markers of different shapes: schedules with equal bubbles stay visible
            ax.plot(*zip(*values), linestyle="none", marker=MARKERS[i % len(MARKERS)],
                    markersize=12 - 1.5 * (i % 4), markerfacecolor="none", markeredgewidth=2,
                    color=colour(i), label=f"{label} {kind}")
    log2_axis(ax, [p[1] for p in points])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle fraction)")
    ax.set_title(title or f"pipeline bubble against micro-batches: {kind} beside theory", wrap=True)
    ax.legend(loc="upper right", ncol=2 if len(labels) > 3 else 1)
    return fig


def gpipe_speedup(k, m):
    """GPipe's ideal speed-up of K stages over one device with M micro-batches: K*M/(M+K-1)."""
    return k * m / (m + k - 1)


@drawing
def speedup_chart(grid, title=None):
    """Speed-up over one device against micro-batches M, one colour per stage count K: measured
    markers and the theory K*M/(M+K-1) as a line. ``grid``: K -> {M -> measured speed-up}."""
    fig, ax = new_figure()
    all_m = sorted({m for row in grid.values() for m in row})
    for i, k in enumerate(sorted(grid)):
        ms = sorted(grid[k])
        lo, hi = min(all_m), max(all_m)
        dense = [lo * (hi / lo) ** (j / 60) for j in range(61)] if hi > lo else [lo]
        ax.plot(dense, [gpipe_speedup(k, m) for m in dense], color=colour(i), linewidth=2,
                linestyle="--", label=f"K={k} theory")
        ax.plot(ms, [grid[k][m] for m in ms], linestyle="none", marker=MARKERS[i % len(MARKERS)],
                markersize=9, color=colour(i), label=f"K={k} measured")
    log2_axis(ax, all_m)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("speed-up over one device")
    ax.set_title(title or "GPipe speed-up with K stages: measured beside K·M/(M+K−1)", wrap=True)
    ax.legend(loc="upper left", ncol=2)
    return fig
