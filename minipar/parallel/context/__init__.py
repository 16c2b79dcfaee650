"""Context parallelism: the sequence split over the cp ranks of a group, attention by a ring.

    layout.py   which chunks of the sequence a rank holds (balanced zig-zag or contiguous)
    ring.py     ring_attention: k/v blocks round the ring, the online softmax, its backward
    ulysses.py  ulysses_attention: all-to-alls swap the sequence split for a split of the heads
    work.py     RingLog: the blocks each rank computed or skipped, step by step
    gpt.py      a GPT's positions and loss share when its sequences are split (Trainer3D)

Theory, the load balance and the measurements: docs/context_parallel.md.
"""
from .gpt import local_positions, loss_share
from .layout import LAYOUTS, chunk_length, gather_sequence, rank_chunks, split_sequence
from .ring import ring_attention
from .ulysses import ulysses_attention
from .work import RingLog

__all__ = ["LAYOUTS", "chunk_length", "rank_chunks", "split_sequence", "gather_sequence",
           "ring_attention", "ulysses_attention", "RingLog", "local_positions", "loss_share"]
