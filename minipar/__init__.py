"""minipar: distributed deep-learning training built from scratch, for teaching.

    import minipar
    x = minipar.tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()
    x.grad   # array([[2., 4.]], dtype=float32)

``minipar.nn``, ``.optim``, ``.distributed`` and ``.utils`` load at first use, as attributes, as
torch's do (``import minipar as torch`` scripts find them; ``minipar --help`` does not wait for
them). ``FACADE``: the modules that exist only for torch's layout, re-exporting what lives in
minipar's own (docs/torch.md, the port guide).
"""
import importlib

from . import backend, functional  # noqa: F401
from .autograd import (Tensor, as_tensor, concat, embedding, enable_grad, gather,  # noqa: F401
                       is_grad_enabled, masked_fill, no_grad, set_grad_enabled, split, stack,
                       tensor, where)
from .generator import Generator  # noqa: F401
from .random import get_rng_state, manual_seed, set_rng_state  # noqa: F401
from .backend import to_numpy  # noqa: F401
from .backend.dtypes import (bfloat16, float8_e4m3fn, float8_e5m2, float16, float32,  # noqa: F401
                             float64)
from .io import load, save  # noqa: F401

__version__ = "0.1.0"
FACADE = ("minipar.nn.functional", "minipar.nn.parallel", "minipar.utils", "minipar.utils.data",
          "minipar.utils.data.distributed")
int32, int64 = backend.dtypes.dtype("int32"), backend.dtypes.dtype("int64")
long = int64


def __getattr__(name):
    # PEP 562: the subpackages torch's namespace holds, imported when first named
    if name in ("nn", "optim", "distributed", "utils"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'minipar' has no attribute {name!r}")


def _shape(shape):
    """``zeros(2, 3)`` and ``zeros((2, 3))`` alike."""
    return shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def zeros(*shape, dtype="float32", requires_grad=False):
    return Tensor(backend.xp().zeros(_shape(shape), dtype=backend.check_dtype(dtype)),
                  requires_grad=requires_grad)


def ones(*shape, dtype="float32", requires_grad=False):
    return Tensor(backend.xp().ones(_shape(shape), dtype=backend.check_dtype(dtype)),
                  requires_grad=requires_grad)


def randn(*shape, dtype="float32", requires_grad=False):
    """Standard normal values from minipar's seeded stream (``manual_seed``)."""
    from . import random

    data = random.generator().standard_normal(_shape(shape)).astype(backend.check_dtype(dtype))
    return Tensor(data, requires_grad=requires_grad)


def randint(low, high=None, size=None, dtype="int64"):
    """torch.randint(high, size) or (low, high, size): integers in [low, high) from minipar's
    seeded stream (not torch's numbers: torch.manual_seed's stream is not reproduced)."""
    from . import random

    if size is None and isinstance(high, (tuple, list)):  # randint(high, size)
        low, high, size = 0, low, high
    if size is None or high is None:
        raise TypeError("randint: size is required, e.g. randint(10, (3,)) or randint(0, 10, (3,))")
    data = random.generator().integers(low, high, size=tuple(_shape((size,))))
    return Tensor(data.astype(backend.check_dtype(dtype)))


def arange(start, end=None, step=1, dtype=None, requires_grad=False):
    """torch.arange: [start, end) by ``step``; int64 from integers, float32 otherwise."""
    start, end = (0, start) if end is None else (start, end)
    ints = all(isinstance(v, int) for v in (start, end, step))
    dtype = dtype or ("int64" if ints else "float32")
    return Tensor(backend.xp().arange(start, end, step).astype(backend.check_dtype(dtype)),
                  requires_grad=requires_grad)


def randperm(n, generator=None):
    """torch.randperm: with a seeded ``Generator``, torch's very permutation (int64)."""
    from .generator import permutation

    return Tensor(backend.asarray(permutation(n, generator)))


def cat(tensors, dim=0):
    """torch.cat: ``concat`` along ``dim``."""
    return concat(tensors, axis=dim)
