"""What a long run says on the terminal, besides its results: progress, spread, machine load.

    for step in progress(range(400), "training", rank=world.rank): ...
    spread([0.41, 0.38, 0.45])         '0.410 [0.380-0.450]'   (median [min-max])
    note_load()                         a line on standard error when the machine is busy
    terminal_width()                    columns to fit a text chart into
    terminal_env(env)                   the terminal's settings for ranks mpiexec gives pipes

Everything here writes to standard error, so the results on standard output stay clean (and
pure JSON with ``--json``). Progress is shown on rank 0 only and only when standard error is a
terminal: a log file, a pipe or a test run gets nothing. The bar is tqdm's when tqdm is
installed (``pip install 'minipar[progress]'``), else one line rewritten in place.
``MINIPAR_PROGRESS=0`` turns progress off, ``=1`` forces it on (for a pipe that is a terminal
further down, e.g. ``mpiexec``'s forwarding of standard error).
"""
import os
import shutil
import statistics
import sys
import time


def _progress_wanted(rank, stream):
    setting = os.environ.get("MINIPAR_PROGRESS", "")
    if rank != 0 or setting == "0":
        return False
    return setting == "1" or (hasattr(stream, "isatty") and stream.isatty())


def progress(iterable, desc, total=None, rank=0, stream=None):
    """``iterable``, with a progress bar on ``stream`` (standard error) when it is wanted."""
    stream = stream or sys.stderr
    if not _progress_wanted(rank, stream):
        return iterable
    total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    try:
        from tqdm import tqdm
    except ImportError:
        return _line_meter(iterable, desc, total, stream)
    return tqdm(iterable, desc=desc, total=total, file=stream, leave=False, dynamic_ncols=True)


def _line_meter(iterable, desc, total, stream, every=0.5):
    """tqdm's job in a dozen lines: ``desc: i/total (s)`` rewritten at most every half second."""
    start = last = time.perf_counter()
    count = 0
    for count, item in enumerate(iterable, 1):
        yield item
        now = time.perf_counter()
        if now - last >= every:
            last = now
            of = f"/{total}" if total else ""
            stream.write(f"\r{desc}: {count}{of} ({now - start:.0f} s)")
            stream.flush()
    if last > start:  # something was drawn: clear the line
        stream.write("\r" + " " * (len(desc) + 32) + "\r")
        stream.flush()


def spread(values, fmt="{:.3f}"):
    """``median [min-max]`` of repeated measurements, each number through ``fmt``."""
    values = list(values)
    if not values:
        raise ValueError("spread of no values")
    median = statistics.median(values)
    if len(values) == 1:
        return fmt.format(median)
    return f"{fmt.format(median)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def load_note(cores=None, load=None):
    """A sentence when the 1-minute load average exceeds the cores (timings are then noisy), else
    None. ``load`` and ``cores`` default to this machine's (no load average: None)."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if load <= cores:
        return None
    return (f"note: load average {load:.1f} on {cores} cores: other work shares this machine, "
            f"so the timings below are noisy (run again on a quiet machine to compare)")


def note_load(rank=0, stream=None):
    """Print ``load_note()`` on standard error from rank 0 when there is one; returns it."""
    note = load_note()
    if note and rank == 0:
        print(note, file=stream or sys.stderr, flush=True)
    return note


def terminal_env(env, stdout=None, stderr=None):
    """What ranks started by mpiexec cannot see for themselves: mpiexec hands them pipes, not
    this terminal. ``MINIPAR_PROGRESS=1`` when standard error is a terminal (progress bars,
    rank 0), ``COLUMNS`` when standard output is one (text charts folded to its width); a value
    already in ``env`` wins. Returns the variables to add."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    wanted = {}
    if "MINIPAR_PROGRESS" not in env and stderr.isatty():
        wanted["MINIPAR_PROGRESS"] = "1"
    if "COLUMNS" not in env and stdout.isatty():
        wanted["COLUMNS"] = str(shutil.get_terminal_size().columns)
    return wanted


def terminal_width(default=100):
    """Columns of the terminal on standard output (``COLUMNS`` when set, else ``default``)."""
    return shutil.get_terminal_size((default, 24)).columns
