"""Initial values for parameters, drawn from minipar's seeded stream on the host.

Drawing with NumPy and then copying to the device means one seed gives bit-identical parameters
on every rank and on every device (CPU or GPU), which is what lets a parallel model be checked
number for number against its serial twin.
"""
import math

from .. import backend, random


def _host_rng():
    return random.generator(backend.get_array_module())  # the module of no arrays: NumPy


def uniform(shape, bound, dtype="float32"):
    """U(−bound, bound)."""
    return backend.asarray(_host_rng().uniform(-bound, bound, shape).astype(dtype))


def normal(shape, std=1.0, dtype="float32"):
    """N(0, std²)."""
    return backend.asarray((_host_rng().standard_normal(shape) * std).astype(dtype))


def zeros(shape, dtype="float32"):
    return backend.xp().zeros(shape, dtype=dtype)


def ones(shape, dtype="float32"):
    return backend.xp().ones(shape, dtype=dtype)


def fan_in_bound(fan_in):
    """PyTorch's default for Linear and Conv weights and biases: kaiming_uniform_(a=√5) gives
    U(−1/√fan_in, 1/√fan_in)."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
