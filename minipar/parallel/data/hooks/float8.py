"""DDP's gradient hook in FP8 (e5m2, as gradients use: Micikevicius et al. 2022), beside the
16-bit ones of default.py, cast with one tensor-wise scale from the amax all ranks agree on.

    model.register_comm_hook(None, float8_compress_hook)    # None: the model's communicator

FP8 is never summed in FP8 (each add would round to 3 mantissa bits): the bucket's FP8 chunks
cross in an all-to-all, each rank adds its chunk in the bucket's dtype, and the mean's chunks,
cast to FP8 again, are all-gathered. Bytes per rank for a bucket of n elements on p ranks, n'
= n rounded up to a multiple of p: 2 (p-1) n'/p, half of bf16_compress_hook's ring all-reduce
4 (p-1) n/p, plus one float32 amax all-reduced (under max). docs/float8.md.
"""
import numpy

from .... import backend
from ....amp.float8_recipes import Quantized, dequantize, saturate, tensorwise_scale
from ....backend import dtypes
from .default import communicator

FLOAT32 = dtypes.float32


def float8_compress_hook(process_group, bucket):
    """Average the bucket in e5m2 with one scale for the bucket, from the amax of every rank's
    bucket; the sum in the bucket's dtype. Every rank ends with the same bits; an inf or NaN
    anywhere makes the whole bucket NaN (GradScaler then skips the step)."""
    comm = communicator(process_group, bucket)
    g, d = bucket.buffer(), dtypes.float8_e5m2
    xp, p, n = backend.get_array_module(g), comm.size, g.size
    amax = xp.abs(g).max(initial=0).astype(FLOAT32).reshape(1)
    s = tensorwise_scale(comm.all_reduce(amax, op="max", algorithm=bucket.algorithm), d)
    inverse = FLOAT32.type(1) / s
    width = -(-n // p)
    mine = xp.zeros(width * p, FLOAT32)  # padded with zeros to p equal chunks
    mine[:n] = g
    with numpy.errstate(invalid="ignore"):  # inf * 0: NaN, as quantize_tensorwise gives
        rows = comm.all_to_all(saturate(mine * s, d).reshape(p, width))  # every rank's chunk r
    total = xp.zeros(width, g.dtype)
    for row in rows:  # in rank order, on every rank alike
        total += dequantize(Quantized(row, inverse, row.shape), g.dtype)
    mean = (total / p).astype(FLOAT32)
    with numpy.errstate(invalid="ignore"):
        gathered = comm.all_gather(saturate(mean * s, d))
    g[...] = dequantize(Quantized(gathered.reshape(-1)[:n], inverse, (n,)), g.dtype)
    return g
