"""The floating-point types minipar computes in, the 16-bit ones of mixed precision included.

float16 (IEEE half: 5 exponent bits, 10 mantissa bits) is NumPy's and CuPy's own; bfloat16
(float32's 8 exponent bits, 7 mantissa bits: Kalamkar et al. 2019, "A Study of BFLOAT16 for
Deep Learning Training") comes from ml_dtypes on NumPy, rounded to nearest even like
``torch.Tensor.to(torch.bfloat16)``. Names resolve as torch and NumPy spell them:

    backend.dtype("bf16") == backend.dtype(torch.bfloat16) == minipar.bfloat16
    backend.is_floating(minipar.bfloat16)    # True, though its NumPy kind is 'V'
    backend.finfo("float16").tiny            # 6.1e-05, fp16's smallest normal
"""
import ml_dtypes
import numpy

bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float16 = numpy.dtype("float16")
float32 = numpy.dtype("float32")
float64 = numpy.dtype("float64")
# torch's names and the short ones papers use, besides NumPy's own; and bfloat16's type
# character ('E', ml_dtypes'), which numpy.dtype() does not read back (headers, message tags)
_ALIASES = {"half": float16, "fp16": float16, "bf16": bfloat16, "float": float32,
            "fp32": float32, "double": float64, "fp64": float64, bfloat16.char: bfloat16}


def dtype(name):
    """The NumPy dtype for ``name``: a dtype, a NumPy or torch name or type character, or a
    torch dtype."""
    if isinstance(name, str) or type(name).__module__ == "torch":
        text = str(name).removeprefix("torch.")
        if text in _ALIASES:
            return _ALIASES[text]
        name = text
    try:
        return numpy.dtype(name)
    except TypeError:
        raise TypeError(f"unknown dtype {name!r}: use a NumPy dtype or a name such as "
                        "'float32', 'float16' ('half') or 'bfloat16' ('bf16')") from None


def is_floating(d):
    """True for float16, bfloat16, float32 and float64 (bfloat16's NumPy kind is 'V')."""
    d = numpy.dtype(d)
    return d.kind == "f" or d == bfloat16


def is_low_precision(d):
    """True for the 16-bit floats of mixed precision."""
    d = numpy.dtype(d)
    # the size first: float32 and float64, the common case, answer without the name check
    return d.itemsize == 2 and (d.kind == "f" or d == bfloat16)


def finfo(d):
    """Machine limits (eps, tiny, max, smallest_subnormal) of any floating dtype, bf16 too."""
    return ml_dtypes.finfo(dtype(d))
