"""GPU arrays and MPI: hand MPI the device buffer (CUDA-aware) or stage through host memory.

MPI reads device memory only when the library is CUDA-aware. ``cuda_aware()`` asks, in order:
the environment (``MINIPAR_CUDA_AWARE=0/1``), the MPI 4.1 info key ``mpi_memory_alloc_kinds``
(lists ``cuda`` when device memory is accepted), and MPICH/Open MPI's
``MPIX_Query_cuda_support()``. CUDA-aware: synchronise the stream, hand MPI the device buffer.
Otherwise stage: device -> host copy, MPI, host -> device copy.

    send_buffer(x, aware)        a buffer MPI can read holding x
    recv_buffer(out, aware)      (buffer MPI writes into, function to call once it has)
    inout_buffer(a, aware)       the same for a buffer MPI reads and writes in place
"""
import ctypes
import os

from mpi4py import MPI

from minipar import backend
from minipar.comm.errors import CommError

HOST_ARRAY = backend.numpy.ndarray  # NumPy arrays take the short path through the checks


def _query_cuda_support_symbol():
    """``MPIX_Query_cuda_support()`` from the loaded libmpi, or None where it has no such symbol."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
        for path in sorted(paths):
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if query is not None:
                return bool(query())
    except OSError:
        pass
    return None


def cuda_aware():
    """(bool, reason): whether MPI accepts device buffers, and how that was decided."""
    if backend.device() == "strict":  # its arrays have no buffer MPI could read: always staged
        return False, "MINIPAR_DEVICE=strict (device arrays are always staged)"
    env = os.environ.get("MINIPAR_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes"), f"MINIPAR_CUDA_AWARE={env}"
    kinds = MPI.COMM_WORLD.Get_info().get("mpi_memory_alloc_kinds")
    if kinds is not None and "cuda" in kinds:
        return True, f"mpi_memory_alloc_kinds={kinds}"
    symbol = _query_cuda_support_symbol()
    if symbol is not None:
        return symbol, f"MPIX_Query_cuda_support()={int(symbol)}"
    return False, f"mpi_memory_alloc_kinds={kinds}" if kinds else "no CUDA support reported"


def send_buffer(x, aware):
    """A buffer MPI can read holding x (C-contiguous; host copy of a GPU array if staged)."""
    if type(x) is HOST_ARRAY and x.flags.c_contiguous:  # the common case, first
        return x
    if backend.is_gpu_array(x):
        x = backend.get_array_module(x).ascontiguousarray(x)
        backend.synchronize()
        return x if aware else backend.to_numpy(x)
    if not x.flags.c_contiguous:
        x = backend.get_array_module(x).ascontiguousarray(x)
    return x


def recv_buffer(out, aware, rank=None):
    """(buffer MPI writes into, function to call after the receive completes, or None)."""
    if type(out) is HOST_ARRAY and out.flags.c_contiguous:  # the common case, first
        return out, None
    if not out.flags.c_contiguous:
        raise CommError(f"rank {rank}: receive buffer must be C-contiguous "
                        f"(got strides {out.strides}); pass a contiguous array")
    if backend.is_gpu_array(out):
        backend.synchronize()
        if aware:
            return out, None
        host = backend.get_array_module().empty(out.shape, out.dtype)
        return host, lambda: out.set(host)
    return out, None


def inout_buffer(a, aware):
    """(buffer MPI reads and writes in place, function to call afterwards, or None)."""
    if backend.is_gpu_array(a) and not aware:
        host = backend.to_numpy(a)
        return host, lambda: a.set(host)
    if backend.is_gpu_array(a):  # MPI reads device memory: wait for its kernels; host arrays: no
        backend.synchronize()
    return a, None
