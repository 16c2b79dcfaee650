"""What every figure shares: the size, the fonts, the colours of the actions, a new blank figure.

A figure is 12 x 6.5 inches at 100 dots per inch: 1200 pixels wide, text of 12-16 points, which
stays readable on a projected slide. Colours are fixed per action kind so a reader learns them once.
"""
import functools

from minipar.figures.base import require

DPI = 100
WIDTH = 12.0  # inches: 1200 pixels at DPI

STYLE = {"font.size": 13, "axes.titlesize": 15, "axes.labelsize": 13, "legend.fontsize": 11,
         "xtick.labelsize": 11, "ytick.labelsize": 11, "axes.grid": True, "grid.alpha": 0.3,
         "axes.spines.top": False, "axes.spines.right": False, "legend.framealpha": 0.9,
         "savefig.facecolor": "white", "figure.facecolor": "white"}

# F blue, B green, W amber, R purple, optimizer step grey; BW (DualPipeV's whole backward, B
# and its W in one pass, where W is otherwise separate) teal; and the text that reads on each.
KIND_COLOURS = {"F": "#4285f4", "B": "#34a853", "W": "#f4b400", "BW": "#00897b", "R": "#ab47bc",
                "OPT_STEP": "#787878"}
KIND_TEXT = {"F": "white", "B": "white", "W": "black", "BW": "white", "R": "white",
             "OPT_STEP": "white"}
KIND_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight gradient",
              "BW": "BW whole backward (B + W)", "R": "R re-computed forward",
              "OPT_STEP": "optimizer step"}
PAIR_EDGE = "#d62728"  # the frame around an F&B pair's two halves (DualPipeV)
IDLE = "#f2f2f2"
# one colour per line (schedules, algorithms, K): matplotlib's tab10 without its grey
SERIES = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
          "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")


def colour(i):
    return SERIES[i % len(SERIES)]


def drawing(function):
    """Run a chart function with matplotlib imported (``require()``) and the house style on."""
    @functools.wraps(function)
    def draw(*args, **kwargs):
        with require().rc_context(STYLE):
            return function(*args, **kwargs)
    return draw


def new_figure(height=6.5, width=WIDTH):
    """A blank Figure on an Agg canvas (no pyplot, no window) and its one Axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def log2_axis(ax, values, axis="x"):
    """Base-2 log scale with a tick at each value when the values span a factor of 8 or more;
    a narrower span of whole numbers (m = 2, 4, 6) keeps a linear scale, ticked at each value."""
    values = sorted({v for v in values if v and v > 0})
    wide = bool(values) and values[-1] / values[0] >= 8
    if not wide and not (values and all(float(v).is_integer() for v in values)):
        return
    from matplotlib.ticker import FixedLocator, NullLocator
    target = ax.xaxis if axis == "x" else ax.yaxis
    if wide:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
        target.set_minor_locator(NullLocator())
    target.set_major_locator(FixedLocator(values))
    target.set_major_formatter(_format_int)


def _format_int(value, _pos=None):
    return f"{value:g}"
