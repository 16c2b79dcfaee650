"""What every collective does with its arrays: chunks, the result buffer, the reduction, checks.

Conventions. Arrays go in and a new array comes out; pass ``out=x`` to work in place. A vector
is cut into p chunks by ``chunk_bounds`` (sizes differ by at most one, so any count works, zero
and counts smaller than p included). ``op="avg"`` is a sum followed by a division by p
(``finish``), as MPI users write it. float16 and bfloat16 travel as 2-byte messages and are
reduced in float32 (``reducer``, ``Accumulator``); the rounding bounds: docs/comm.md. FP8
travels as 1-byte messages and is never reduced (``refuse_float8``).

Checking. Every receive checks size and dtype tag (communicator.py). With ``check=True`` or
``MINIPAR_DEBUG=1`` the ranks first exchange (shape, dtype), and every rank raises the same
error when they differ (``check_call``).
"""
import functools

from minipar import backend
from minipar.backend.dtypes import FLOAT8
from minipar.comm.errors import CommError
from minipar.comm.registry import OPS, check_op

_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}


def chunk_bounds(n, p):
    """Offsets of p nearly equal chunks of n elements: chunk i is [b[i], b[i+1])."""
    return list(bounds(n, p))


@functools.lru_cache(maxsize=256)
def bounds(n, p):
    """``chunk_bounds`` as a cached tuple: the collectives ask for the same (n, p) call after call."""
    q, r = divmod(n, p)
    return tuple(i * q + min(i, r) for i in range(p + 1))


def check_call(comm, what, x, check=None, op=None):
    """Refuse what no rank could run, a CommError naming it: x that is not an array, an
    unknown reduction ``op``. With ``check=True``, or ``check=None`` and MINIPAR_DEBUG=1, also
    the same CommError on every rank when ranks disagree on x's shape or dtype (one small
    gather of metadata: a check, not part of any algorithm)."""
    if x is not None:
        array(x, what)
    if op is not None and op not in OPS:
        check_op(op)
    if op is not None and x is not None:
        refuse_float8(what, x)
    if comm.size == 1 or not (check or (check is None and backend.debug())):
        return
    mine = (tuple(x.shape), x.dtype.name) if x is not None else None
    seen = comm.all_gather_object(mine)
    if any(s != seen[0] for s in seen if s is not None):
        table = ", ".join(f"rank {r}: {s[1]}{list(s[0])}" for r, s in enumerate(seen) if s)
        raise CommError(f"{what}: arrays differ across ranks ({table})")


def refuse_float8(what, x):
    """A reduction of FP8 arrays: the same CommError on every rank (the dtype is part of the
    call). Each addition would round to 2 or 3 mantissa bits, and the partial sums of p ranks
    outgrow the scale their data was cast with; FP8 moves as bytes (all_gather, all_to_all) and
    is added in float32 after dequantising (parallel/data/hooks/float8.py, docs/float8.md)."""
    if x.dtype in FLOAT8:
        raise CommError(f"{what}: cannot reduce {x.dtype.name} arrays (FP8 sums lose what FP8 "
                        f"cannot hold); dequantise and reduce in float32, or all_gather the "
                        f"FP8 data and add it in float32 (float8_compress_hook)")


def result_buffer(x, out, shape=None, dtype=None):
    """The array the result is written into: ``out`` (checked) or a fresh one."""
    if out is None:
        return backend.get_array_module(x).empty(x.shape if shape is None else shape,
                                                 x.dtype if dtype is None else dtype)
    if not out.flags.c_contiguous:
        raise CommError("out must be a C-contiguous array")
    want = tuple(x.shape if shape is None else shape)
    if out.shape != want:
        raise CommError(f"out has shape {out.shape}, expected {want}")
    return out


def reducer(op, like):
    """The in-place reduction ``f(a, b, out=a)`` for op on like's array module."""
    f = getattr(backend.get_array_module(like), _UFUNC[op])
    if not backend.is_low_precision(like.dtype):
        return f

    # 16 bits: both operands upcast, reduced in float32, rounded once into out. For two
    # operands that is the correctly rounded result (float32's 24 bits >= 2 * 11 + 2, so
    # rounding to float32 and then to 16 bits never differs from rounding once: Figueroa 1995),
    # bit for bit what NumPy's float16 and ml_dtypes' bfloat16 ufuncs do inside. It gains over
    # them where one rank folds more than two operands: ``Accumulator``.
    def reduce16(a, b, out):
        out[...] = f(a.astype("float32"), b.astype("float32"))
    return reduce16


class Accumulator:
    """A running reduction of op into ``out``: ``add(x)`` folds x in, ``done()`` leaves the
    result in out. The first operand is read at the second ``add`` (keep it unchanged until
    then; out may alias either operand, as in ``f(a, b, out=a)``). 16-bit out: the running
    value is kept in float32 and rounded once, in ``done``, so a rank folding k vectors rounds
    once, not k - 1 times; other dtypes run in out, as ``reducer`` does, in the same order."""

    def __init__(self, op, out):
        self.out, self.f = out, getattr(backend.get_array_module(out), _UFUNC[op])
        self.wide = backend.is_low_precision(out.dtype)
        self.first = self.acc = None

    def add(self, x):
        if self.first is None:
            self.first = x
        elif self.acc is None and self.wide:
            self.acc = self.f(self.first.astype("float32"), x.astype("float32"))
        elif self.acc is None:
            self.acc = self.f(self.first, x, out=self.out)
        else:
            self.f(self.acc, x.astype("float32") if self.wide else x, out=self.acc)

    def done(self):
        if self.acc is not None:
            if self.wide:
                self.out[...] = self.acc
        elif self.first is not None and self.first is not self.out:
            self.out[...] = self.first
        return self.out


def finish(buf, op, p):
    """avg = sum / p (floor division for integer dtypes, like MPI's SUM followed by // p)."""
    if op == "avg":
        xp = backend.get_array_module(buf)
        divide = xp.floor_divide if buf.dtype.kind in "iub" else xp.true_divide
        divide(buf, buf.dtype.type(p), out=buf)
    return buf


def contiguous(x):
    return backend.get_array_module(x).ascontiguousarray(x)


def copy(x):
    """A fresh C-contiguous copy of x (the work buffer a collective may overwrite)."""
    return backend.get_array_module(x).array(x, order="C", copy=True)


def array(x, what):
    """x itself when it is a NumPy or CuPy array; a CommError naming what it is otherwise."""
    if hasattr(x, "__array_interface__") or backend.is_gpu_array(x):
        return x
    hint = (": a communicator moves arrays and returns new ones; pass tensor.data, or use "
            "minipar.distributed (torch.distributed's calls, in place on Tensors: "
            "dist.all_reduce(tensor))") if hasattr(x, "requires_grad") else ""
    raise CommError(f"{what} takes a NumPy or CuPy array, got {type(x).__name__}{hint}")
