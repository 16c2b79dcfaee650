"""Timelines for the teaching layer, at their old import path: the pipeline's timeline
(``minipar.parallel.pipeline.timeline``) and its PNG picture (``minipar.cli.drawing``)."""
from minipar.cli.drawing import KIND_COLOURS, png_bytes, render_pixels, write_png  # noqa: F401
from minipar.parallel.pipeline.timeline import (WORK_KINDS, Event, Tracer,  # noqa: F401
                                                bubble_fraction, bubble_per_rank, chrome_trace,
                                                gather_events, makespan, peak_inflight, text_gantt,
                                                write_chrome_trace)
