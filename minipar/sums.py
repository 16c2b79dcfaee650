"""Sums (and a max) over the last axis, or over all the others, when rows are many and short.

NumPy reduces a (512, 128) array over its last axis in about four times the time of one pass
over it: the loop restarts on every short row. The same sums are a matrix-vector product with a
ones vector, Σ_j a_ij = (A 1)_i and Σ_i a_ij = (1ᵀ A)_j, one BLAS call that streams the array
once. Layer norm's and softmax's row sums and the biases' gradients use them; below ``SMALL``
elements the reduction's smaller overhead wins and is used instead. The max has no BLAS form,
but NumPy's argmax runs vectorised over short rows where its max does not (a (2048, 64) array of
attention scores: about 30 µs against 120), so ``max_last`` reads each row's max at its argmax.
"""
from . import backend

SMALL = 8192  # elements


def sum_last(a):
    """Σ over the last axis, kept as an axis of 1 (``a.sum(axis=-1, keepdims=True)``)."""
    if a.size < SMALL:
        return a.sum(axis=-1, keepdims=True)
    return a @ backend.get_array_module(a).ones((a.shape[-1], 1), a.dtype)


def sum_rows(a):
    """Σ over every axis but the last (``a.reshape(-1, a.shape[-1]).sum(axis=0)``)."""
    a2 = a.reshape(-1, a.shape[-1])
    if a2.size < SMALL:
        return a2.sum(axis=0)
    return backend.get_array_module(a).ones(a2.shape[0], a.dtype) @ a2


def max_last(a):
    """The max over the last axis, kept as an axis of 1 (``a.max(axis=-1, keepdims=True)``, the
    same values: NaN where a row holds one, as argmax points at it)."""
    if a.size < SMALL:
        return a.max(axis=-1, keepdims=True)
    return backend.get_array_module(a).take_along_axis(a, a.argmax(axis=-1)[..., None], axis=-1)
