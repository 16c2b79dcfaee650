"""Autocast (torch.autocast): matrix products in 16 bits, the touchy ops in float32.

    with minipar.amp.autocast("cpu", dtype=minipar.bfloat16):   # also a decorator
        logits, loss = model(ids, targets)   # linear, matmul, attention, conv2d give bf16
    loss.backward()                          # float32 parameters get float32 gradients

Inside it the ops of torch's CUDA "lower precision" list (matmul, linear, attention, conv2d) cast
their floating inputs to the 16-bit dtype, through the graph, and multiply as tensor cores do
(``ops.low_precision``); those of its "float32" list (softmax, log_softmax, layer_norm,
cross_entropy, nll_loss, sum) cast 16-bit inputs up to float32. Every other op runs in its
inputs' dtype (bf16 + fp32 gives fp32, as in torch). torch's CPU lists keep softmax, layer_norm
and the losses in bf16; minipar follows the CUDA lists on every device, so a lesson run on a
laptop rounds where a GPU run would.
"""
import functools

from .. import backend

# One state for the process, not one per device type as in torch: minipar's arrays all live on
# one device (backend.device()), so autocast("cuda") in a script written for a GPU also works
# on a laptop. device_type only picks the default dtype, torch's: float16 on a GPU, else bf16.
_state = {"enabled": False, "dtype": None}
_DEVICE_TYPES = ("cpu", "cuda", "gpu", "strict")


def _default_dtype(device_type):
    device = backend.device() if device_type is None else device_type
    return backend.float16 if device in ("cuda", "gpu", "strict") else backend.bfloat16


def _check_device_type(device_type):
    if device_type is not None and device_type not in _DEVICE_TYPES:
        raise ValueError(f"autocast: device_type must be 'cpu' or 'cuda' (or minipar's 'gpu' or "
                         f"'strict', or None for the current device), got {device_type!r}")
    return device_type


class autocast:
    """``autocast(device_type=None, dtype=None, enabled=True, cache_enabled=None)``, torch's
    signature with device_type optional (None: minipar's device). dtype is float16 or bfloat16
    (a name such as "bf16" too); ``enabled=False`` inside switches autocast off until the block
    ends. cache_enabled is accepted and ignored: minipar casts a weight at each use."""

    def __init__(self, device_type=None, dtype=None, enabled=True, cache_enabled=None):
        self.device = _check_device_type(device_type)
        fast = _default_dtype(device_type) if dtype is None else backend.dtype(dtype)
        if not backend.is_low_precision(fast):
            raise ValueError(f"autocast: dtype must be float16 or bfloat16, got {fast}")
        self.fast_dtype = fast
        self._enabled = bool(enabled)
        self._outer = []  # the states to restore, one per open with-block of this object

    def __enter__(self):
        self._outer.append(dict(_state))
        _state.update(enabled=self._enabled, dtype=self.fast_dtype)
        return self

    def __exit__(self, *exc):
        _state.update(self._outer.pop())
        return False

    def __call__(self, fn):
        """As a decorator: each call of ``fn`` runs in a block of its own (recursion is safe)."""
        @functools.wraps(fn)
        def autocast_call(*args, **kwargs):
            with autocast(self.device, self.fast_dtype, self._enabled):
                return fn(*args, **kwargs)
        return autocast_call


def is_autocast_enabled(device_type=None):
    """Whether autocast is on now (for minipar's one device, whatever ``device_type`` says)."""
    _check_device_type(device_type)
    return _state["enabled"]


def get_autocast_dtype(device_type=None):
    """The 16-bit dtype of the innermost autocast block, else torch's default for the device."""
    _check_device_type(device_type)
    return _state["dtype"] or _default_dtype(device_type)


def active_dtype():
    """The dtype matrix products are cast to now: None outside autocast (or with it disabled)."""
    return _state["dtype"] if _state["enabled"] else None


def casts(x, dtype):
    """Whether autocast casts ``x`` to ``dtype``: torch's "eligible" inputs, floating ones that are
    neither float64 nor of that dtype already (None, integers and numbers never)."""
    d = getattr(x, "dtype", None)
    return (d is not None and backend.is_floating(d) and d != dtype
            and d != backend.dtypes.float64)


def _cast(tensors, dtype):
    if dtype is not None:  # outside autocast (every op of a float32 model) nothing is looked at
        tensors = tuple(t.astype(dtype) if casts(t, dtype) else t for t in tensors)
    return tensors[0] if len(tensors) == 1 else tensors


def to_lower_precision(*tensors):
    """For the ops of the lower-precision list: under autocast the floating tensors cast to its
    dtype through the graph (``Tensor.astype``: their gradients come back in their own dtype);
    otherwise unchanged. One tensor in, one out; several in, a tuple out."""
    return _cast(tensors, active_dtype())


def to_float32(*tensors):
    """For the ops of the float32 list: under autocast 16-bit tensors cast up to float32."""
    return _cast(tensors, None if active_dtype() is None else backend.dtypes.float32)
