"""The floating-point types minipar computes in: the 16-bit ones of mixed precision, and FP8.

float16 (IEEE half: 5 exponent bits, 10 mantissa bits) is NumPy's and CuPy's own; bfloat16
(float32's 8 exponent bits, 7 mantissa bits: Kalamkar et al. 2019, "A Study of BFLOAT16 for
Deep Learning Training") comes from ml_dtypes on NumPy, rounded to nearest even like
``torch.Tensor.to(torch.bfloat16)``. Names resolve as torch and NumPy spell them:

    backend.dtype("bf16") == backend.dtype(torch.bfloat16) == minipar.bfloat16
    backend.is_floating(minipar.bfloat16)    # True, though its NumPy kind is 'V'
    backend.finfo("float16").tiny            # 6.1e-05, fp16's smallest normal
    backend.cast(x, "float8_e4m3fn")         # x's 8 bits as torch's x.to(torch.float8_e4m3fn)

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): float8_e4m3fn (no inf, max 448)
and float8_e5m2 (IEEE-like, max 57344), ml_dtypes' types under torch's names (docs/float8.md).
"""
import ml_dtypes
import numpy

bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float16 = numpy.dtype("float16")
float32 = numpy.dtype("float32")
float64 = numpy.dtype("float64")
float8_e4m3fn = numpy.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = numpy.dtype(ml_dtypes.float8_e5m2)
FLOAT8 = (float8_e4m3fn, float8_e5m2)
float8_e8m0fnu = numpy.dtype(ml_dtypes.float8_e8m0fnu)  # MX's power-of-two block scales
# torch's names and the short ones papers use, besides NumPy's own; and the type characters of
# ml_dtypes' types ('E', '4', '5'), which numpy.dtype() does not read back (headers, message tags)
_ALIASES = {"half": float16, "fp16": float16, "bf16": bfloat16, "float": float32,
            "fp32": float32, "double": float64, "fp64": float64, "e4m3": float8_e4m3fn,
            "e5m2": float8_e5m2, **{d.char: d for d in (bfloat16, *FLOAT8)}}


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
                        "'float32', 'float16' ('half'), 'bfloat16' ('bf16'), 'float8_e4m3fn' "
                        "or 'float8_e5m2'") from None


# the dtypes CuPy has no arrays of (nor the strict device, which keeps CuPy's rules): refused by
# name there, with what to use instead
HOST_ONLY = {bfloat16: "use float16 there (with a GradScaler)",
             **{d: "minipar's FP8 (minipar.amp.float8) runs on NumPy"
                for d in (*FLOAT8, float8_e8m0fnu)}}


def refusal(d, device):
    """The TypeError for an array of host-only dtype ``d`` asked for on ``device``."""
    return TypeError(f"{d.name} arrays are not supported on the {device} device: CuPy has no "
                     f"{d.name} dtype; {HOST_ONLY[d]}, or MINIPAR_DEVICE=cpu")


# ml_dtypes' floating types, whose NumPy kind is 'V': a set, as every op asks (autograd.apply)
_V_FLOATS = frozenset((bfloat16, *FLOAT8))


def is_floating(d):
    """True for float16, bfloat16, float32, float64 and the two FP8 formats (torch's
    ``is_floating_point``; ml_dtypes' types have NumPy kind 'V')."""
    d = d if isinstance(d, numpy.dtype) else dtype(d)  # a dtype already: no name to resolve
    return d.kind == "f" or d in _V_FLOATS


def is_low_precision(d):
    """True for the 16-bit floats of mixed precision."""
    d = d if isinstance(d, numpy.dtype) else dtype(d)
    # the size first: float32 and float64, the common case, answer without the name check
    return d.itemsize == 2 and (d.kind == "f" or d == bfloat16)


def finfo(d):
    """Machine limits (eps, tiny, max, smallest_subnormal) of any floating dtype, bf16 and FP8
    too."""
    return ml_dtypes.finfo(dtype(d))


def cast(a, d):
    """Array ``a`` in dtype ``d``, rounded as torch's ``.to(d)``: to nearest, ties to even.
    ml_dtypes' astype does that but for one rule: past float8_e4m3fn's largest value (448;
    above 464, halfway to the next power of two) it gives NaN, torch 2.13 saturates to ±448,
    inf too. float8_e5m2 has an inf and both agree (65536 and past it: inf)."""
    d = dtype(d)
    if d == float8_e4m3fn and a.dtype != d:
        a = a.clip(-448.0, 448.0)  # NaN stays NaN
    return a.astype(d)
