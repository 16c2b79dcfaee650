"""GPU arrays and MPI: host buffers to stage device arrays through, and whether MPI takes device
memory at all.

    aware = cuda_aware()[0]              # (bool, how it was decided)
    host, key = to_host(x)               # device array x in a reused host buffer
    to_device(host, out, key)            # host into device array out; the buffer given back
    stats()                              # bytes staged each way, staged calls, host buffers made

The door to MPI (wire.py) decides for each call whether to stage. Staging reuses pinned host
buffers (``HostBuffers``); a buffer in flight (an isend's) is never handed out twice. How
CUDA-awareness is detected and why pinned memory: docs/comm.md.
"""
import ctypes
import os
import threading

from mpi4py import MPI

from minipar import backend



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


MIN_BYTES = 1 << 16  # the smallest host buffer; sizes are powers of two from here
KEEP = 4  # free buffers kept per size: the cache holds what was in flight at once, no more


class HostBuffers:
    """Host buffers for staging, by size class (a power of two >= MIN_BYTES): ``take`` hands
    out a free one of the class or makes one, ``give`` puts it back. At most KEEP free buffers
    stay per class; the rest go back to the allocator, so nothing grows without bound. Shared
    by the threads of a process (the iall_reduce worker stages too), hence the lock."""

    def __init__(self):
        self._free = {}  # (pinned, bytes) -> free uint8 buffers
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("bytes_to_host", "bytes_to_device", "staged_calls",
                                     "buffers_made"), 0)

    def take(self, like):
        """(host array of like's shape and dtype, its buffer) from the cache or made anew."""
        xp = backend.get_array_module(like)
        pinned = xp.__name__.startswith("cupy")
        size = max(MIN_BYTES, 1 << max(like.nbytes - 1, 0).bit_length())
        with self._lock:
            free = self._free.get((pinned, size))
            raw = free.pop() if free else None
            self.counts["staged_calls"] += 1
            if raw is None:
                self.counts["buffers_made"] += 1
        if raw is None:
            raw = (backend.numpy.frombuffer(xp.cuda.alloc_pinned_memory(size), "uint8", size)
                   if pinned else backend.numpy.empty(size, "uint8"))
        host = raw[:like.nbytes].view(like.dtype).reshape(like.shape)
        return host, (pinned, raw)

    def give(self, key):
        pinned, raw = key
        with self._lock:
            free = self._free.setdefault((pinned, raw.size), [])
            if len(free) < KEEP:
                free.append(raw)

    def count(self, field, nbytes):
        with self._lock:
            self.counts[field] += nbytes

    def clear(self):
        """Hand every cached buffer back to the allocator and zero the counts."""
        with self._lock:
            self._free.clear()
            for field in self.counts:
                self.counts[field] = 0


BUFFERS = HostBuffers()


def stats():
    """What staging did in this process: bytes copied to the host and back, staged calls, and
    host buffers made (few and constant when the buffers are reused)."""
    return dict(BUFFERS.counts)


def to_host(x):
    """(host copy of device array x in a reused buffer, key to give it back)."""
    if not x.flags.c_contiguous:
        x = backend.get_array_module(x).ascontiguousarray(x)
    host, key = BUFFERS.take(x)
    x.get(out=host)  # blocking: done when it returns
    BUFFERS.count("bytes_to_host", x.nbytes)
    return host, key


def to_device(host, out, key):
    """Copy host into device array out, then give the host buffer back."""
    out.set(host)
    if key[0]:  # from pinned memory the copy is asynchronous: wait before the buffer is reused
        backend.get_array_module(out).cuda.get_current_stream().synchronize()
    BUFFERS.count("bytes_to_device", out.nbytes)
    BUFFERS.give(key)
