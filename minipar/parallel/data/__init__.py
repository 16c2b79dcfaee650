"""Data parallelism: every rank holds the model and sees 1/N of the batch (docs/data_parallel.md).

ddp.py (all-reduce of bucketed gradients as backward fills them; averaging.py, overlapped with
backward or by a hook), sampler.py (each rank's shard of the data), zero.py (optimizer state
and gradients sharded), zero3.py (parameters too: fully sharded, each layer gathered while it
computes), param_server.py (push, update, pull), allreduce_optimizer.py (the 3D trainer's
data-parallel step), buckets.py, the pieces they share (with the flat layout of
``minipar.flat``), and hooks/, DDP's communication hooks (compressed averaging:
``model.register_comm_hook(state, hook)``).

DDP wraps the module, as torch's does: ``DistributedDataParallel(module, comm, bucket_cap_mb=...)``,
then backward and the plain optimizer. The others wrap the optimizer and share one shape,
``Wrapper(module, make_optimizer, comm, ...)`` with ``step()``, ``zero_grad()`` and
``memory_bytes()`` (parameters, gradients, optimizer state held on this rank).
"""
from ...flat import flatten_grads, flatten_parameters, offsets
from .allreduce_optimizer import AllReduceOptimizer, average_grads
from .buckets import GradBucket, ReadyQueue, broadcast_parameters, gradient_bytes, make_buckets
from .ddp import DistributedDataParallel
from .param_server import ParameterServer, busiest_link
from .sampler import DistributedSampler, local_batch_size
from .zero import ZeRO
from .zero3 import ZeRO3

__all__ = ["DistributedDataParallel", "DistributedSampler", "local_batch_size", "ZeRO", "ZeRO3",
           "ParameterServer", "busiest_link", "AllReduceOptimizer", "average_grads",
           # the shared pieces (buckets.py, and the flat layout of minipar.flat)
           "broadcast_parameters", "make_buckets", "offsets", "flatten_parameters",
           "flatten_grads", "gradient_bytes", "ReadyQueue", "GradBucket"]
