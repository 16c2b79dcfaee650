"""Pictures of a timeline: the Gantt chart as a PNG, written by hand with zlib and struct only.

    write_png(events, path)   one band per rank, one coloured cell per action

Legend: F blue, B green, W amber, R (re-computed forward) purple, OPT_STEP grey, idle white.
Micro-batches cycle through four shades (lighter as mb % 4 grows); chunk b and later are darker.
"""
import itertools
import math
import struct
import zlib

from minipar.parallel.pipeline.timeline import rank_count, span, work_events

KIND_COLOURS = {"F": (66, 133, 244), "B": (52, 168, 83), "W": (244, 180, 0), "R": (171, 71, 188),
                "OPT_STEP": (120, 120, 120)}


def _shade(rgb, mb, chunk):
    light = 0.18 * (max(mb, 0) % 4)
    dark = 0.35 if chunk > 0 else 0.0
    return tuple(int((c + (255 - c) * light) * (1 - dark)) for c in rgb)


def png_bytes(pixels):
    """Encode rows of (r, g, b) tuples as an 8-bit RGB PNG: signature, IHDR, IDAT (zlib), IEND."""
    height, width = len(pixels), len(pixels[0])

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"".join(b"\x00" + bytes(itertools.chain.from_iterable(row)) for row in pixels)  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def render_pixels(events, n_ranks=None, px_per_unit=16, row_height=24, unit=None, max_width=4096):
    """The Gantt chart as rows of pixels: one band per rank, one coloured cell per work event
    (``px_per_unit`` pixels per shortest event, fewer if the picture would exceed ``max_width``)."""
    work = work_events(events)
    unit = unit or min(e.duration for e in work)
    t0, t1 = span(events)
    px_per_unit = max(1, min(px_per_unit, int(max_width * unit / (t1 - t0))))
    width = max(1, math.ceil((t1 - t0) / unit * px_per_unit))
    n = rank_count(events, n_ranks)
    grid = [[(255, 255, 255)] * width for _ in range(n * row_height)]
    for e in work:
        x0, x1 = round((e.start - t0) / unit * px_per_unit), round((e.end - t0) / unit * px_per_unit)
        colour = _shade(KIND_COLOURS[e.kind], e.mb, e.chunk)
        for y in range(e.rank * row_height + 2, (e.rank + 1) * row_height - 2):
            grid[y][x0:max(x0 + 1, x1 - 1)] = [colour] * (max(x0 + 1, x1 - 1) - x0)  # 1 px gap
    return [row[:width] for row in grid]


def write_png(events, path, n_ranks=None, px_per_unit=16, row_height=24):
    with open(path, "wb") as f:
        f.write(png_bytes(render_pixels(events, n_ranks, px_per_unit, row_height)))
