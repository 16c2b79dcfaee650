"""Timelines for the teaching layer, at their old import path: the pipeline's timeline
(``minipar.parallel.pipeline.timeline``). Its labelled picture is ``minipar.figures.schedule_chart``."""
from minipar.parallel.pipeline.timeline import (WORK_KINDS, Event, Tracer,  # noqa: F401
                                                bubble_fraction, bubble_per_rank, chrome_trace,
                                                gather_events, makespan, peak_inflight, text_gantt,
                                                write_chrome_trace)
