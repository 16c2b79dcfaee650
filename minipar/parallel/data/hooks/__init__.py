"""Communication hooks for ``DistributedDataParallel.register_comm_hook`` (torch's interface):
each averages a bucket its own way, most of them in fewer bytes (docs/data_parallel.md).

    from minipar.parallel.data.hooks import PowerSGDState, powerSGD_hook
    model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2), powerSGD_hook)

default.py (allreduce_hook; fp16_compress_hook and bf16_compress_hook: average in 16 bits),
float8.py (float8_compress_hook: e5m2 with one agreed scale a bucket, added in its dtype),
powersgd.py (low-rank gradients with error feedback: Vogels et al. 2019), topk.py (the k
largest entries, Deep Gradient Compression), sign.py (1 bit an entry and a scale, signSGD).
"""
from ..buckets import GradBucket
from .default import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .float8 import float8_compress_hook
from .powersgd import PowerSGDState, powerSGD_hook
from .sign import SignState, sign_hook
from .topk import TopKState, topk_hook

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "float8_compress_hook", "PowerSGDState", "powerSGD_hook", "TopKState", "topk_hook",
           "SignState", "sign_hook"]
