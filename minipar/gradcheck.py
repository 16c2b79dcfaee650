"""Check a backward pass against central finite differences (as minitorch's grader does).

For a function f of some arrays, reduce its output to a scalar with a fixed random projection
L = Σ f(x) ⊙ R, then compare each analytic dL/dx[i] with

    (L(x + ε e_i) − L(x − ε e_i)) / 2ε,      error O(ε²).

Use float64 and ε ≈ 1e-6: the rounding error is then about 1e-10 relative, far below any bug.
"""
import numpy

from . import backend
from .autograd import Tensor


def numerical_grads(fn, arrays, projection, eps=1e-6):
    """Central-difference gradients of Σ fn(*arrays) ⊙ projection, one array per input."""
    grads = []
    for k, a in enumerate(arrays):
        g = numpy.zeros(a.shape, dtype=numpy.float64)
        flat = a.reshape(-1)
        for i in range(flat.size):
            saved = flat[i].item()  # a copy: CuPy's flat[i] is a view that the next line changes
            flat[i] = saved + eps
            plus = _scalar(fn, arrays, projection)
            flat[i] = saved - eps
            minus = _scalar(fn, arrays, projection)
            flat[i] = saved
            g.reshape(-1)[i] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


def _scalar(fn, arrays, projection):
    out = fn(*[Tensor(a) for a in arrays])
    return float((backend.to_numpy(out.data) * projection).sum())


def gradcheck(fn, *arrays, eps=1e-6, atol=1e-7, rtol=1e-6, seed=0):
    """Assert that ``fn``'s analytic gradients match finite differences; returns the max error.

    ``arrays`` are float64 backend arrays; the AssertionError names the input and element that
    disagree.
    """
    arrays = [backend.xp().asarray(a, dtype="float64").copy() for a in arrays]
    inputs = [Tensor(a, requires_grad=True) for a in arrays]
    out = fn(*inputs)
    projection = numpy.random.default_rng(seed).standard_normal(out.shape)
    out.backward(backend.xp().asarray(projection))
    numeric = numerical_grads(fn, arrays, projection, eps)
    worst = 0.0
    for k, (t, expected) in enumerate(zip(inputs, numeric)):
        got = numpy.zeros(t.shape) if t.grad is None else backend.to_numpy(t.grad)
        err = numpy.abs(got - expected)
        bad = err > atol + rtol * numpy.abs(expected)
        if bad.any():
            i = numpy.unravel_index(numpy.argmax(err), err.shape)
            raise AssertionError(f"gradient of input {k} (shape {t.shape}) is wrong at {i}: "
                                 f"backward gives {got[i]!r}, finite differences {expected[i]!r}")
        worst = max(worst, float(err.max(initial=0.0)))
    return worst
