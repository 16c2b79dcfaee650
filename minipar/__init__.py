"""minipar: distributed deep-learning training built from scratch, for teaching.

    import minipar
    x = minipar.tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()
    x.grad   # array([[2., 4.]], dtype=float32)
"""
from . import backend, functional  # noqa: F401
from .autograd import (Tensor, as_tensor, concat, embedding, enable_grad, gather,  # noqa: F401
                       is_grad_enabled, masked_fill, no_grad, set_grad_enabled, split, stack,
                       tensor, where)
from .random import get_rng_state, manual_seed, set_rng_state  # noqa: F401
from .backend import to_numpy  # noqa: F401
from .backend.dtypes import bfloat16, float16, float32, float64  # noqa: F401
from .io import load, save  # noqa: F401

__version__ = "0.1.0"


def zeros(*shape, dtype="float32", requires_grad=False):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(backend.xp().zeros(shape, dtype=backend.check_dtype(dtype)),
                  requires_grad=requires_grad)


def ones(*shape, dtype="float32", requires_grad=False):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(backend.xp().ones(shape, dtype=backend.check_dtype(dtype)),
                  requires_grad=requires_grad)


def randn(*shape, dtype="float32", requires_grad=False):
    """Standard normal values from minipar's seeded stream (``manual_seed``)."""
    from . import random

    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    data = random.generator().standard_normal(shape).astype(backend.check_dtype(dtype))
    return Tensor(data, requires_grad=requires_grad)
