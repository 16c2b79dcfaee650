"""The pictures under docs/, drawn from the pipeline simulator (a second or two, no MPI):

    python scripts/figures.py              writes docs/schedule-1f1b.png and docs/bubble.png
    python scripts/figures.py --out DIR    somewhere else

docs/schedule-1f1b.png   the 1F1B schedule on p=4 ranks with m=8 micro-batches, as
                         ``minipar schedule --schedule 1f1b --stages 4 --microbatches 8 --png F``
                         draws it: a row per rank, a bar per forward and backward, the simulated
                         bubble beside (p-1)/(m+p-1) in the title
docs/bubble.png          the bubble against m for GPipe, 1F1B, interleaved 1F1B (v=2) and
                         ZB-H1 on p=4 ranks: simulated markers on their textbook lines

The files are the same bytes on every run (no date or version inside) and small: drawn 1200
pixels wide, then stored with a palette of 64 colours.
"""
import argparse
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

P, M = 4, 8
BUBBLE_M = (4, 8, 16, 32, 64)
SCHEDULES = (("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None), ("zb-v", None))


def schedule_figure():
    from minipar.cli.schedule import describe
    from minipar.figures import schedule_chart
    from minipar.parallel.pipeline import bubble_theory, build, simulate, validate
    schedule = validate(build("1f1b", P, M))
    formula, num, den = bubble_theory(schedule)
    return schedule_chart(simulate(schedule), P, title=describe(schedule), theory=(formula, num / den))


def bubble_figure():
    from minipar.figures import bubble_chart
    from minipar.parallel.pipeline import bubble_fraction, bubble_theory, build, simulate, validate
    points = []
    for name, chunks in SCHEDULES:
        for m in BUBBLE_M:
            schedule = validate(build(name, P, m, chunks))
            _, num, den = bubble_theory(schedule)
            label = name + (f" (v={chunks})" if chunks else "")
            points.append((label, m, bubble_fraction(simulate(schedule), P), num / den))
    return bubble_chart(points, title=f"pipeline bubble against micro-batches m on p={P} ranks: "
                                      "simulated beside theory", kind="simulated")


def save_small(fig, path, colours=64):
    """The figure as a PNG with a palette of ``colours`` (about a third of the RGBA file's size)."""
    from PIL import Image
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    image = Image.open(buffer).convert("RGB").quantize(colours, dither=Image.Dither.NONE)
    image.save(path, optimize=True)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for the PNGs (default: docs)")
    args = parser.parse_args(argv)
    from minipar.figures import FiguresUnavailable, require
    try:
        require()
    except FiguresUnavailable as err:
        sys.exit(f"scripts/figures.py: {err}")
    for name, draw in (("schedule-1f1b", schedule_figure), ("bubble", bubble_figure)):
        path = save_small(draw(), os.path.join(args.out, name + ".png"))
        print(f"figure: {path} ({os.path.getsize(path) // 1024} KB)")


if __name__ == "__main__":
    main()
