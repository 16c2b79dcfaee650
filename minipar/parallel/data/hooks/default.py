"""torch's default communication hooks for DDP: plain averaging, and averaging in 16 bits
(gradient compression by casting: half a float32 gradient's bytes).

    model.register_comm_hook(None, fp16_compress_hook)    # None: the model's communicator

A hook is ``hook(state, bucket)`` (``buckets.GradBucket``); these take a Communicator or None as
their state, as torch's take the process group. Bytes per rank: the all-reduce's, of the
bucket's n elements in the bucket's dtype (allreduce_hook) or in 2 bytes (the compressing
ones); docs/data_parallel.md.
"""
from .... import backend
from ....comm import Communicator


def communicator(state, bucket):
    """The Communicator a hook talks on: ``state`` when it is one, else the model's
    (``bucket.comm``), as torch's hooks fall back from None to the default group."""
    if state is None:
        return bucket.comm
    if not isinstance(state, Communicator):
        raise TypeError(f"a communication hook's process group must be a Communicator or None "
                        f"(the model's), got {type(state).__name__}")
    return state


def allreduce_hook(process_group, bucket):
    """The average: each rank's gradient divided by N, then summed (DDP's own path, as a hook)."""
    comm = communicator(process_group, bucket)
    buf = bucket.buffer()
    backend.get_array_module(buf).divide(buf, comm.size, out=buf)
    return comm.all_reduce(buf, op="sum", algorithm=bucket.algorithm, out=buf)


def fp16_compress_hook(process_group, bucket):
    """Average in float16: cast the bucket to float16, divide by N, all-reduce (2-byte
    messages), cast back into the bucket (torch's ``fp16_compress_hook``)."""
    return compress_hook(process_group, bucket, backend.float16)


def bf16_compress_hook(process_group, bucket):
    """The same in bfloat16 (float32's range, 8 bits of mantissa): no overflow to fear, a
    coarser rounding; on the CPU only (CuPy has no bfloat16)."""
    return compress_hook(process_group, bucket, backend.bfloat16)


def compress_hook(process_group, bucket, dtype):
    """Cast, divide, sum, cast back: the rounding points of torch's compressing hooks."""
    comm = communicator(process_group, bucket)
    buf = bucket.buffer()
    xp = backend.get_array_module(buf)
    compressed = buf.astype(backend.check_dtype(dtype))
    # Divide before the sum, in 16 bits, as torch does: float16 ends at 65504, and a sum of N
    # gradients can overflow where their mean would not (docs/data_parallel.md)
    xp.divide(compressed, compressed.dtype.type(comm.size), out=compressed)
    comm.all_reduce(compressed, op="sum", algorithm=bucket.algorithm, out=compressed)
    buf[...] = compressed  # cast back: the bucket keeps its own dtype
    return buf
