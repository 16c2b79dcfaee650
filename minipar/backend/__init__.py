"""The one place that chooses the array library: NumPy on the CPU, CuPy on a GPU.

Every other module asks this one for the array module (``xp``) instead of importing NumPy or
CuPy by name, so the same code runs on a laptop and on a GPU node (the needle/CuPy idiom).

    MINIPAR_DEVICE=cpu   always NumPy
    MINIPAR_DEVICE=gpu   CuPy, and an error if CuPy or a GPU is missing
    MINIPAR_DEVICE=strict  NumPy behind CuPy's rules (``backend/strict.py``): the GPU code path,
                           its refusals included, proven on a machine without a GPU
    (unset / auto)       CuPy when it imports and sees a device, NumPy otherwise

Moving data to the host is always explicit: ``to_numpy(a)``.
"""
import os

import numpy

from . import dtypes
from .dtypes import (bfloat16, cast, dtype, finfo, float8_e4m3fn, float8_e5m2,  # noqa: F401
                     float16, is_floating, is_low_precision)

_VALID_DEVICES = ("auto", "cpu", "gpu", "strict")
_state = {"xp": None, "device": None}
_STRICT = __name__ + ".strict"  # the module of the strict device's arrays


def _keep_freed_memory():
    """Ask glibc to keep freed memory instead of returning it to the OS at once.

    Every NumPy op allocates its result afresh; by default glibc gives large freed blocks back
    (munmap, heap trimming), so the next op's buffer is page-faulted in again, which made a GPT
    block's elementwise ops up to 50x slower in a VM. Raising the mmap and trim thresholds keeps
    buffers up to 32 MB for reuse (RSS stays at its peak). No-op where glibc is absent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim the heap only past 1 GB of free top
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: serve blocks up to 32 MB from the heap
    except (OSError, AttributeError):
        pass


_keep_freed_memory()


def _cupy_or_none():
    """Return the cupy module when it imports and at least one GPU is visible, else None."""
    try:
        import cupy  # noqa: F401  (the one import of CuPy in minipar)

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


def set_device(device):
    """Choose the array module for new arrays: ``"cpu"``, ``"gpu"``, ``"strict"`` or ``"auto"``."""
    device = str(device).lower()
    _state.pop("makes", None)  # does the new device's library have bfloat16, FP8? asked again
    if device not in _VALID_DEVICES:
        raise ValueError(f"unknown device {device!r}: choose one of {', '.join(_VALID_DEVICES)}")
    if device == "cpu":
        _state.update(xp=numpy, device="cpu")
        return "cpu"
    if device == "strict":
        from . import strict

        _state.update(xp=strict, device="strict")
        return "strict"
    cupy = _cupy_or_none()
    if cupy is None:
        if device == "gpu":
            raise RuntimeError("device 'gpu' asked for (MINIPAR_DEVICE=gpu) but CuPy or a CUDA "
                               "device is not available: pip install 'minipar[gpu]' on a GPU machine")
        _state.update(xp=numpy, device="cpu")
        return "cpu"
    _state.update(xp=cupy, device="gpu")
    return "gpu"


def device():
    """``"cpu"``, ``"gpu"`` or ``"strict"``: where new arrays are made."""
    if _state["device"] is None:
        set_device(os.environ.get("MINIPAR_DEVICE", "auto"))
    return _state["device"]


def xp():
    """The array module for new arrays (numpy, cupy, or the strict stand-in for cupy)."""
    if _state["xp"] is None:
        set_device(os.environ.get("MINIPAR_DEVICE", "auto"))
    return _state["xp"]


def is_gpu_array(a):
    """True for a device array: CuPy's, or the strict device's (tested without importing CuPy)."""
    module = type(a).__module__
    return module.startswith("cupy") or module == _STRICT


def get_array_module(*arrays):
    """The module that owns these arrays: cupy (or strict) if any is a device array, else numpy."""
    for a in arrays:
        if is_gpu_array(a):
            if type(a).__module__ == _STRICT:
                from . import strict

                return strict
            import cupy

            return cupy
    return numpy


def asarray(data, dtype=None):
    """An array of the current device's module (copying from the host when needed)."""
    return xp().asarray(data, dtype=None if dtype is None else check_dtype(dtype))


def check_dtype(name):
    """The dtype ``name`` resolves to, refused by name where the device's array library lacks
    it: CuPy has no bfloat16 and no FP8 (nor the strict device, which keeps CuPy's rules);
    float16 works."""
    d = dtypes.dtype(name)
    if d in dtypes.HOST_ONLY and device() != "cpu" and not _device_makes(d):
        raise dtypes.refusal(d, device())
    return d


def _device_makes(d):
    """Whether the device's array library makes arrays of dtype d: asked once per device and
    dtype (a trial allocation), remembered until set_device."""
    makes = _state.setdefault("makes", {})
    if d not in makes:
        makes[d] = device() != "strict" and _trial(d)
    return makes[d]


def _trial(d):
    try:
        xp().zeros(1, dtype=d)
        return True
    except Exception:
        return False


def to_numpy(a):
    """Explicit device-to-host copy (a NumPy array passes through unchanged)."""
    if is_gpu_array(a):
        return a.get()
    return numpy.asarray(a)


def synchronize():
    """Wait for the GPU's current stream (needed before MPI touches device memory); no-op on CPU."""
    if device() == "gpu":
        xp().cuda.get_current_stream().synchronize()


def gpu_for(local_rank, n_gpus, override=None):
    """The GPU index for the rank with this node-local rank: ``local_rank % n_gpus``, so the ranks
    of a node spread over its GPUs (4 ranks, 4 GPUs: 0 1 2 3; 4 ranks, 2 GPUs: 0 1 0 1).

    ``override`` is the value of ``MINIPAR_GPU``: a comma list of GPU indices indexed by the local
    rank, modulo its length ("2,3": local ranks 0 1 2 3 get 2 3 2 3; one number, "1": every rank
    of the node uses GPU 1). A value that is not such a list, or names a GPU the node lacks,
    raises ValueError naming MINIPAR_GPU.
    """
    if n_gpus < 1:
        raise ValueError(f"no GPU visible to pick one for local rank {local_rank}")
    if override is None or not str(override).strip():
        return local_rank % n_gpus
    try:
        choices = [int(item) for item in str(override).split(",")]
    except ValueError:
        raise ValueError(f"MINIPAR_GPU={override!r}: expected a GPU index or a comma list of "
                         "them indexed by node-local rank, e.g. MINIPAR_GPU=1 or "
                         "MINIPAR_GPU=0,2") from None
    gpu = choices[local_rank % len(choices)]
    if not 0 <= gpu < n_gpus:
        raise ValueError(f"MINIPAR_GPU={override!r}: local rank {local_rank} would use GPU {gpu}, "
                         f"but this node has {n_gpus} GPU(s) (0..{n_gpus - 1})")
    return gpu


def select_gpu(local_rank):
    """Bind this process to its GPU, ``gpu_for(local_rank, GPUs on the node, $MINIPAR_GPU)``, and
    return the index; None on the CPU. comm.world() calls it with the node-local rank (comm/node.py)
    before any array is made, so each rank of a multi-GPU node works on a GPU of its own."""
    if device() != "gpu":
        return None
    cupy = xp()
    gpu = gpu_for(local_rank, cupy.cuda.runtime.getDeviceCount(), os.environ.get("MINIPAR_GPU"))
    cupy.cuda.Device(gpu).use()
    return gpu


# --- the debug switch: checks that cost a host sync (or a message) ----------------------------
# One place for MINIPAR_DEBUG=1, read by the engine and the communication layer alike. A check
# that reads a device array's values makes the host wait for the GPU, so on the training step it
# runs only when debugging; on host (NumPy) arrays reading is free and such checks always run.
_state["debug"] = os.environ.get("MINIPAR_DEBUG", "0") not in ("", "0")


def debug():
    """True under ``MINIPAR_DEBUG=1`` (or after ``set_debug(True)``)."""
    return _state["debug"]


def set_debug(on=True):
    """Turn the checks that read device data (and comm's shape agreement) on or off."""
    _state["debug"] = bool(on)


def check_values(*arrays):
    """Whether a check that reads these arrays' values runs now: always for host arrays, for
    device arrays only when debugging (reading them is a host synchronisation)."""
    return _state["debug"] or not any(is_gpu_array(a) for a in arrays)
