"""Measurement pictures: bus bandwidth against message size, loss curves, grouped bars, memory.

    busbw_chart(rows, p)           minipar.bench rows: a line per algorithm (MPI's own black) and
                                   the cost model's prediction dashed in the same colour
    loss_chart(curves)             label -> losses; "serial..." thick and grey underneath
    bar_chart(categories, series)  grouped bars, each with its value written on top
    memory_chart(bars)             (label, measured bytes, theory bytes) as bars in MiB
    magnitude_chart(values, lines) histograms of |value| on a log axis, thresholds marked
    scaling_chart(curves)          label -> (x, measured, formula): markers, the formula dashed
"""
from minipar.figures.style import MARKERS, colour, drawing, log2_axis, new_figure

UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def _bytes(value, _pos=None):
    """A tick label for a message size: 512, 4K, 1M (binary prefixes)."""
    for prefix, size in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if value >= size:
            return f"{value / size:g}{prefix}"
    return f"{value:g}"


def model_busbw(nbytes, model_us, p):
    """The bus bandwidth (GB/s) the cost model predicts for one all-reduce of ``nbytes``."""
    return nbytes / (model_us * 1e-6) * 2 * (p - 1) / p / 1e9


@drawing
def busbw_chart(rows, p, title=None):
    """Bus bandwidth against message size, one line per algorithm (``mpi``, MPI's own, in black)
    and, dashed in the same colour, the busbw the fitted cost model predicts for it. The y axis
    is logarithmic when the values span more than a factor of 100 (small messages then show).
    ``rows``: ``minipar.bench`` row dicts (bytes, algorithm, busbw_GBps, model_us)."""
    rows = list(rows)
    fig, ax = new_figure()
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    algorithms.sort(key=lambda a: a != "mpi")  # MPI's own first: the reference
    for i, algorithm in enumerate(algorithms):
        mine = sorted((r for r in rows if r["algorithm"] == algorithm), key=lambda r: r["bytes"])
        c = "black" if algorithm == "mpi" else colour(i - 1 if "mpi" in algorithms else i)
        name = "mpi (MPI's own)" if algorithm == "mpi" else algorithm
        ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], color=c,
                marker=MARKERS[i % len(MARKERS)], markersize=6, linewidth=2.2 if algorithm == "mpi" else 1.8,
                label=name)
        model = [(r["bytes"], model_busbw(r["bytes"], r["model_us"], p)) for r in mine if r.get("model_us")]
        if model:
            ax.plot(*zip(*model), color=c, linestyle="--", linewidth=1.4, alpha=0.8,
                    label=f"{algorithm} model")
    log2_axis(ax, [r["bytes"] for r in rows])
    if ax.get_xscale() == "log":
        ax.xaxis.set_major_formatter(_bytes)
        ticks = ax.get_xticks()
        if len(ticks) > 12:  # every other size, so the labels do not run into each other
            ax.set_xticks(ticks[::2])
    values = [r["busbw_GBps"] for r in rows if r["busbw_GBps"] > 0]
    if values and max(values) > 100 * min(values):  # latency- and bandwidth-bound sizes both seen
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or f"all-reduce bus bandwidth on {p} ranks: measured and the cost model",
                 wrap=True)
    # beside the axes: with nine algorithms and their models inside, it covered the lines
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(algorithms) // 7)
    return fig


def _points(curve):
    """(steps, losses) from a sequence of losses (steps 0, 1, ...) or of (step, loss) pairs."""
    curve = list(curve)
    if curve and isinstance(curve[0], (tuple, list)):
        return [s for s, _ in curve], [float(v) for _, v in curve]
    return list(range(len(curve))), [float(v) for v in curve]


@drawing
def loss_chart(curves, title=None, xlabel="step", ylabel="loss"):
    """Loss curves, one per label; a label starting with "serial" is the reference: drawn thick
    and grey underneath, so a parallel layout that matches it lies on top of it."""
    fig, ax = new_figure()
    i, layouts = 0, sum(not label.startswith("serial") for label in curves)
    for label, curve in curves.items():
        x, y = _points(curve)
        if label.startswith("serial"):
            ax.plot(x, y, color="#9e9e9e", linewidth=6, alpha=0.7, zorder=1, label=label,
                    solid_capstyle="round")
        else:
            # a marker of its own on every few points, offset per curve: curves that coincide
            # (a parallel layout equal to its twin) still show one mark each
            every = max(layouts, len(x) // 12)
            ax.plot(x, y, color=colour(i), linewidth=1.8, zorder=2, label=label,
                    marker=MARKERS[i % len(MARKERS)], markersize=5,
                    markevery=(i % every, every))
            i += 1
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no step 0.5
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or "loss: the serial reference against each parallel layout", wrap=True)
    ax.legend(loc="upper right")
    return fig


def _value_text(value):
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


@drawing
def bar_chart(categories, series, title=None, ylabel=None, xlabel=None):
    """Grouped bars: a group per category, a bar per series (label -> one value per category,
    None for no bar), each bar with its value written on top."""
    categories = list(categories)
    fig, ax = new_figure()
    n = max(len(series), 1)
    width = 0.8 / n
    crowded = len(categories) * n > 16  # values side by side would overlap: stand them up
    for i, (label, values) in enumerate(series.items()):
        bars = [(j + (i - (n - 1) / 2) * width, v) for j, v in enumerate(values) if v is not None]
        if not bars:
            continue
        container = ax.bar([x for x, _ in bars], [v for _, v in bars], width=width * 0.95,
                           color=colour(i), label=label, zorder=2)
        ax.bar_label(container, labels=[_value_text(v) for _, v in bars], padding=2, fontsize=10,
                     rotation=90 if crowded else 0)
    ax.set_xticks(range(len(categories)), categories)
    if len(categories) > 6 or max(map(len, categories), default=0) * len(categories) > 90:
        ax.tick_params(axis="x", labelrotation=20)
        for text in ax.get_xticklabels():
            text.set_horizontalalignment("right")
    ax.margins(y=0.2 if crowded else 0.12)  # room for the value labels above the tallest bar
    ax.grid(False, axis="x")
    ax.set_axisbelow(True)
    ax.set_xlabel(xlabel or "")
    ax.set_ylabel(ylabel or "")
    ax.set_title(title or "", wrap=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never on them
    return fig


def memory_chart(bars, title=None, unit="MiB", xlabel="configuration"):
    """Memory per rank: for each (label, measured_bytes, theory_bytes or None), a "measured" and a
    "theory" bar in ``unit`` (B, KiB, MiB, GiB, kB, MB, GB)."""
    bars = list(bars)
    size = UNITS[unit]
    series = {"measured": [None if m is None else m / size for _, m, _ in bars],
              "theory": [None if t is None else t / size for _, _, t in bars]}
    return bar_chart([label for label, _, _ in bars], series,
                     title=title or "memory per rank: measured beside theory",
                     ylabel=f"memory per rank ({unit})", xlabel=xlabel)


@drawing
def magnitude_chart(values, lines, title=None, xlabel="|value|"):
    """Histograms of |value| on a log2 axis, one per label in ``values`` (label -> array), zeros
    left out; ``lines`` (label -> x) draws a dashed vertical line per threshold, e.g. float16's
    smallest normal and subnormal, so what falls left of them is seen to underflow."""
    import numpy

    fig, ax = new_figure()
    magnitudes = {label: numpy.abs(numpy.asarray(v, dtype=numpy.float64)) for label, v in
                  values.items()}
    magnitudes = {label: m[m > 0] for label, m in magnitudes.items()}
    low = min([m.min() for m in magnitudes.values() if m.size] + list(lines.values()))
    high = max(m.max() for m in magnitudes.values() if m.size)
    edges = numpy.logspace(numpy.floor(numpy.log2(low)), numpy.ceil(numpy.log2(high)) + 1,
                           num=80, base=2.0)
    for i, (label, m) in enumerate(magnitudes.items()):
        ax.hist(m, bins=edges, color=colour(i), alpha=0.55, label=f"{label} ({m.size:,} nonzero)",
                zorder=2)
    for j, (label, x) in enumerate(lines.items()):
        ax.axvline(x, color="black", linestyle=("--", ":", "-.")[j % 3], linewidth=1.5,
                   label=f"{label} {x:.1e}", zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("entries")
    ax.set_title(title or "magnitudes against the thresholds", wrap=True)
    ax.legend(loc="upper left")
    return fig


@drawing
def scaling_chart(curves, title=None, xlabel="size", ylabel="value", byte_ticks=False):
    """A quantity against a size, one colour per label: ``curves`` maps a label to ``(xs,
    measured, formula)``, the measured values markers, the formula a dashed line through them
    (None: the markers joined by a solid line). Both axes logarithmic when the values span a
    factor of 8 or more; ``byte_ticks`` labels the y axis 4K, 1M."""
    fig, ax = new_figure()
    xs, ys = [], []
    for i, (label, (x, measured, formula)) in enumerate(curves.items()):
        if formula is not None:
            ax.plot(x, formula, color=colour(i), linestyle="--", linewidth=1.6,
                    label=f"{label} formula")
        ax.plot(x, measured, color=colour(i), marker=MARKERS[i % len(MARKERS)], markersize=9,
                linestyle="none" if formula is not None else "-", linewidth=1.8,
                label=f"{label} measured")
        xs += list(x)
        ys += [v for v in measured if v and v > 0]
    log2_axis(ax, xs)
    if ys and max(ys) >= 8 * min(ys):
        ax.set_yscale("log", base=2)
    if byte_ticks:
        ax.yaxis.set_major_formatter(_bytes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or "measured beside the formula", wrap=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
