"""Whether pictures can be drawn (matplotlib, the ``plot`` extra) and how a figure is saved."""
import os

MISSING = "pictures need matplotlib: pip install 'minipar[plot]'"


class FiguresUnavailable(RuntimeError):
    """matplotlib is not installed: the message says how to install it."""


def require():
    """The matplotlib module; ``FiguresUnavailable(MISSING)`` when it cannot be imported."""
    try:
        import matplotlib
    except ImportError:
        raise FiguresUnavailable(MISSING) from None
    return matplotlib


def available():
    """True when matplotlib can be imported (the ``plot`` extra is installed)."""
    try:
        require()
    except FiguresUnavailable:
        return False
    return True


# File metadata that would change from one run or matplotlib version to the next: left out, so the
# same figure gives the same bytes.
_NO_STAMP = {".png": {"Software": None}, ".svg": {"Date": None, "Creator": None},
             ".pdf": {"CreationDate": None, "Creator": None, "Producer": None}}


def save(fig, path, dpi=None):
    """Write ``fig`` to ``path`` (PNG, or SVG / PDF by the suffix), making its parent folders;
    return the path as a string."""
    path = os.fspath(path)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    suffix = os.path.splitext(path)[1].lower()
    fig.savefig(path, dpi=dpi or fig.dpi, metadata=_NO_STAMP.get(suffix))
    return path


def figure_path(directory, name):
    """``directory/name.png``: where a command that takes ``--plot DIR`` puts its figure ``name``
    (a name ending in .png, .svg or .pdf is kept as it is)."""
    kept = name.lower().endswith(tuple(_NO_STAMP))
    return os.path.join(directory, name if kept else name + ".png")
