"""Pictures for a slide, drawn from what minipar measured or simulated (the ``plot`` extra).

    available(), require()          is matplotlib importable? the module, or FiguresUnavailable
    save(fig, path), figure_path()  a PNG (or .svg / .pdf by suffix) at directory/name.png
    write_figures(directory, draw)  what every --plot does: save, print each path, or say MISSING

    schedule_chart(events, ...)     ranks as rows, one labelled bar per F/B/W/R/optimizer step
    bubble_chart, speedup_chart     bubble against m per schedule; GPipe's speed-up over K x M
    ring_chart(steps, chunks)       ring attention's blocks, a row per rank, a column per step
    busbw_chart(rows, p, ...)       bus bandwidth against message size per algorithm, with the model
    loss_chart(curves, ...)         loss curves, the serial reference thick and grey underneath
    bar_chart, memory_chart         grouped bars with their values on them; memory beside theory
    scaling_chart(curves, ...)      a quantity against a size: measured markers, the formula dashed
    magnitude_chart(values, lines)  histograms of |value| on a log axis against thresholds
"""
import sys

# Each chart function returns a matplotlib.figure.Figure built with the object API (no pyplot:
# no window, no global state, no display needed), at least 1000 pixels wide when saved, with a
# title, axis labels and a legend. matplotlib is imported only inside these functions, through
# require(), so ``import minipar.figures`` works without it and every command that draws says
# how to get the pictures (MISSING) instead of failing.
from minipar.figures.base import (MISSING, FiguresUnavailable, available, figure_path, require,
                                  save)
from minipar.figures.charts import (bar_chart, busbw_chart, loss_chart, magnitude_chart,
                                    memory_chart, scaling_chart)
from minipar.figures.context import ring_chart
from minipar.figures.pipeline import bubble_chart, schedule_chart, speedup_chart

__all__ = ["MISSING", "FiguresUnavailable", "available", "bar_chart", "bubble_chart", "busbw_chart",
           "figure_path", "loss_chart", "magnitude_chart", "memory_chart", "require", "ring_chart",
           "save", "scaling_chart", "schedule_chart", "speedup_chart", "write_figures"]


def write_figures(directory, draw, stream=None):
    """Save the figures ``draw()`` returns ({name: Figure}) as ``directory/name.png`` (a name with
    its own suffix keeps it), printing ``figure: PATH`` for each on ``stream`` (standard output);
    returns the paths. Without matplotlib ``draw`` is not called and one line on standard error
    says how to get the pictures (``MISSING``): the shape of every ``--plot``."""
    if not available():
        print(MISSING, file=sys.stderr, flush=True)
        return []
    paths = []
    for name, fig in draw().items():
        paths.append(save(fig, figure_path(directory, name)))
        print(f"figure: {paths[-1]}", file=stream or sys.stdout, flush=True)
    return paths
