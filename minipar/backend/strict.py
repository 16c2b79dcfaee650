"""A NumPy-backed stand-in for CuPy that keeps CuPy's rules (``MINIPAR_DEVICE=strict``).

NumPy converts, mixes and reads back silently; CuPy does not, and code only ever run on NumPy
breaks on the first GPU. Under ``MINIPAR_DEVICE=strict`` this module is ``xp``: its arrays hold
host memory, yet refuse what a CuPy array refuses, so the one code path is proven on a laptop:

    numpy.asarray(a), numpy.exp(a), numpy.sum(a)   TypeError: use .get() / to_numpy, or xp.exp
    numpy_array + a, xp.add(numpy_array, a)        TypeError: move it first with xp.asarray
    float(a) for a of more than one element        TypeError (one element: read back, as CuPy)
    MPI reading a's memory                         fails: no buffer protocol (staged, as CuPy)
    xp.indices(..., sparse=True)                   TypeError: CuPy's indices has no sparse

Allowed as in CuPy: Python and NumPy scalars in arithmetic, ``xp.asarray(host)`` (a copy),
a NumPy array as an index or assigned into a slice, ``a.get()``, ``a.set(host)``, ``a.item()``.
"""
import operator as _op
import weakref as _weakref

import numpy as _np

from .dtypes import HOST_ONLY as _HOST_ONLY
from .dtypes import refusal as _refusal

_SCALARS = (bool, int, float, complex, _np.generic)
_HOST = _np.ndarray
_OWNERS = _weakref.WeakValueDictionary()  # id(host memory) -> the device array that owns it


def _wrap(x):
    """NumPy results as device arrays (scalars become 0-d arrays, as CuPy returns them: a
    reduction gives a 0-d array, not a NumPy scalar)."""
    if isinstance(x, (_HOST, _np.generic)):
        if x.dtype in _HOST_ONLY:
            raise _refusal(x.dtype, "strict")
        return _device(_np.asarray(x) if isinstance(x, _np.generic) else x)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _device(a):
    """The device array of host array ``a``: an owner's one wrapper (NumPy returns the same
    object, a wrapper each time would be a second owner of one memory), a view's new one."""
    if a.base is None:
        owner = _OWNERS.get(id(a))
        if owner is not None and owner._a is a:
            return owner
    out = ndarray.__new__(ndarray)
    out._a = a
    # A view holds its owner, as a CuPy view holds its .base: one owner object per memory for
    # as long as a view of it lives (ActivationMemory counts a buffer once by its owner)
    out._base = None if a.base is None else _owner(a)
    if a.base is None:
        _OWNERS[id(a)] = out
    return out


def _owner(a):
    """The device array that owns view a's memory, like cupy.ndarray.base."""
    while isinstance(a.base, _HOST):
        a = a.base
    return _device(a)


def _unwrap(x, where, host_ok=False):
    """The host arrays inside x; a NumPy array refused unless ``host_ok`` (CuPy's rule)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _HOST) and not host_ok:
        raise TypeError(f"{where} was given a numpy.ndarray {x.shape}: CuPy takes device arrays "
                        f"only; move it first with xp.asarray(...) (or bring the device array "
                        f"to the host with to_numpy)")
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap(v, where, host_ok) for v in x)
    return x


def _unwrap_all(args, kwargs, where, host_ok=False):
    return (tuple(_unwrap(a, where, host_ok) for a in args),
            {k: _unwrap(v, where, host_ok) for k, v in kwargs.items()})


def _operand(other, name):
    """The other side of an operator: device array, scalar, or a refusal."""
    if isinstance(other, ndarray):
        return other._a
    if isinstance(other, _SCALARS):
        return other
    if isinstance(other, (_HOST, list, tuple)):
        raise TypeError(f"Unsupported type {type(other)} in '{name}' with a device array: CuPy "
                        f"does not mix host data into device arithmetic; move it first with "
                        f"xp.asarray(...) (or bring the device array to the host with to_numpy)")
    return NotImplemented


def _binary(fn, reflected=False):
    def method(self, other):
        other = _operand(other, fn.__name__)
        if other is NotImplemented:
            return other
        return _wrap(fn(other, self._a) if reflected else fn(self._a, other))
    return method


def _inplace(fn):
    def method(self, other):
        other = _operand(other, fn.__name__)
        if other is NotImplemented:
            return other
        fn(self._a, other)  # NumPy's in-place operators write into self._a
        return self
    return method


def _with_operators(cls):
    """Give the class every binary operator, reflected and in-place forms included."""
    for name in "add sub mul truediv floordiv mod pow matmul and_ or_ xor lshift rshift".split():
        base = name.rstrip("_")
        setattr(cls, f"__{base}__", _binary(getattr(_op, name)))
        setattr(cls, f"__r{base}__", _binary(getattr(_op, name), reflected=True))
        setattr(cls, f"__i{base}__", _inplace(getattr(_op, f"i{base}")))
    for name in "lt le eq ne gt ge".split():
        setattr(cls, f"__{name}__", _binary(getattr(_op, name)))
    return cls


# NumPy ufuncs that Python operators call when a NumPy scalar is on the left (2.0 * a)
_OPERATOR_UFUNCS = {_np.add: _op.add, _np.subtract: _op.sub, _np.multiply: _op.mul,
                    _np.true_divide: _op.truediv, _np.floor_divide: _op.floordiv,
                    _np.remainder: _op.mod, _np.power: _op.pow, _np.matmul: _op.matmul,
                    _np.less: _op.lt, _np.less_equal: _op.le, _np.equal: _op.eq,
                    _np.not_equal: _op.ne, _np.greater: _op.gt, _np.greater_equal: _op.ge}
_METHODS = frozenset(
    "all any argmax argmin argpartition argsort astype clip compress conj conjugate copy cumprod "
    "cumsum diagonal dot fill flatten max mean min nonzero partition prod put ravel repeat "
    "reshape round sort squeeze std sum swapaxes take trace transpose var view".split())
_NO_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                "construct a NumPy array explicitly. (minipar: to_numpy(a); the array is on the "
                "strict device, MINIPAR_DEVICE=strict)")


class _Device:
    """What ``a.device`` gives: device 0, usable as a context like cupy.cuda.Device."""
    id = 0

    def use(self):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@_with_operators
class ndarray:
    """A device array by CuPy's rules, its values in host memory (``_a``) that only this module
    reads. ``ndarray(shape, dtype)`` is uninitialised, like ``cupy.ndarray``."""

    __slots__ = ("_a", "_base", "__weakref__")
    __hash__ = None

    def __init__(self, shape, dtype=float):
        self._a = _np.empty(shape, dtype)
        self._base = None
        _OWNERS[id(self._a)] = self

    # --- no implicit trip to the host -------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_NO_IMPLICIT)

    def __array_function__(self, func, types, args, kwargs):
        name = f"{func.__module__}.{func.__name__}"
        raise TypeError(f"{name}() was given a device array: use the array module instead, "
                        f"xp.{name.partition('.')[2]}(...) with xp = get_array_module(a) (or "
                        f"backend.xp()), or copy it to the host first with to_numpy(a)")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out") or ()
        if any(isinstance(x, _HOST) for x in inputs + tuple(outs)):
            raise TypeError(f"Unsupported type {_HOST} in numpy.{ufunc.__name__} with a device "
                            f"array: CuPy does not mix host and device arrays; move it first with "
                            f"xp.asarray(...) (or the device array to the host with to_numpy)")
        if method == "__call__" and ufunc in _OPERATOR_UFUNCS and not kwargs and len(inputs) == 2 \
                and all(isinstance(x, (ndarray,) + _SCALARS) for x in inputs):
            a, b = (x._a if isinstance(x, ndarray) else x for x in inputs)
            return _wrap(_OPERATOR_UFUNCS[ufunc](a, b))  # numpy_scalar <op> a, as in CuPy
        raise TypeError(f"numpy.{ufunc.__name__}{'' if method == '__call__' else '.' + method} "
                        f"was given a device array: use the array module instead, "
                        f"xp.{ufunc.__name__} with xp = get_array_module(a) (or backend.xp())")

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy (NumPy array): the explicit device -> host transfer."""
        if out is not None:
            out[...] = self._a
            return out
        return _np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Copy a host NumPy array of the same shape and dtype into this array."""
        if not isinstance(arr, _HOST):
            raise TypeError(f"Only numpy.ndarray can be set to a device array, got {type(arr)}")
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch: old {self._a.shape}, new {arr.shape}")
        if arr.dtype != self._a.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self._a.dtype} array")
        self._a[...] = arr

    # --- Python scalars: one element is read back (a sync on a GPU), more are an error ------
    def _scalar(self, kind):
        if self._a.size != 1:
            raise TypeError(f"{kind.__name__}() of a device array of shape {self._a.shape}: only "
                            f"one-element arrays convert to a Python scalar; reduce it first or "
                            f"copy it to the host with .get() / to_numpy")
        return kind(self._a.reshape(())[()])

    def __float__(self): return self._scalar(float)
    def __int__(self): return self._scalar(int)
    def __complex__(self): return self._scalar(complex)
    def __bool__(self): return bool(self._a)  # NumPy's and CuPy's rule: ambiguous if size > 1
    def __index__(self): return _op.index(self._a)
    def item(self, *args): return self._a.item(*args)
    def tolist(self): return self._a.tolist()
    def __format__(self, spec): return format(self._a, spec)
    def __repr__(self): return repr(self._a)
    def __str__(self): return str(self._a)

    # --- operators: device arrays and scalars only (the binary ones: see _with_operators) ----
    def __neg__(self): return _wrap(-self._a)
    def __pos__(self): return _wrap(+self._a)
    def __abs__(self): return _wrap(abs(self._a))
    def __invert__(self): return _wrap(~self._a)

    # --- indexing: a NumPy array may index or be assigned (CuPy copies it over) --------------
    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key, "indexing", host_ok=True)])

    def __setitem__(self, key, value):
        self._a[_unwrap(key, "indexing", host_ok=True)] = _unwrap(value, "assignment", True)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (_wrap(row) for row in self._a)

    def __copy__(self):
        return _wrap(self._a.copy())

    def __deepcopy__(self, memo):
        return _wrap(self._a.copy())

    # --- attributes and methods -------------------------------------------------------------
    shape = property(lambda self: self._a.shape,
                     lambda self, shape: setattr(self._a, "shape", shape))
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: _wrap(self._a.T))
    mT = property(lambda self: _wrap(self._a.mT))
    real = property(lambda self: _wrap(self._a.real))
    imag = property(lambda self: _wrap(self._a.imag))
    base = property(lambda self: self._base)
    device = property(lambda self: _Device())

    def __getattr__(self, name):
        if name not in _METHODS:
            raise AttributeError(f"'ndarray' object (strict device, like cupy.ndarray) has no "
                                 f"attribute {name!r}")
        method = getattr(self._a, name)

        def call(*args, **kwargs):
            args, kwargs = _unwrap_all(args, kwargs, f"ndarray.{name}()")
            return _wrap(method(*args, **kwargs))
        return call


# --- the module: CuPy's namespace, each NumPy function behind the same rules ------------------
def _function(name, fn, host_ok=False):
    def call(*args, **kwargs):
        args, kwargs = _unwrap_all(args, kwargs, f"xp.{name}()", host_ok)
        return _wrap(fn(*args, **kwargs))
    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    return call


class _Ufunc:
    """A NumPy ufunc behind the rules; ``.at`` only where CuPy has it."""
    _AT = {"add", "subtract", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor"}

    def __init__(self, ufunc):
        self._ufunc, self.__name__ = ufunc, ufunc.__name__
        self.nin, self.nout = ufunc.nin, ufunc.nout

    def __call__(self, *args, **kwargs):
        return _function(self.__name__, self._ufunc)(*args, **kwargs)

    def __getattr__(self, method):
        if method not in ("reduce", "accumulate", "outer", "at") or \
                (method == "at" and self.__name__ not in self._AT):
            raise AttributeError(f"CuPy's ufunc {self.__name__} has no method {method!r}")
        return _function(f"{self.__name__}.{method}", getattr(self._ufunc, method))


class _Namespace:
    """A submodule (``xp.random``, ``xp.linalg``): its functions behind the same rules."""

    def __init__(self, name, module, overrides=()):
        self.__name__, self._module = name, module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if callable(value) and not isinstance(value, type):
            value = _function(f"{self.__name__}.{name}", value)
        setattr(self, name, value)
        return value


class _Generator:
    """``xp.random.default_rng(seed)``: NumPy's stream, with the methods CuPy's Generator has."""
    _METHODS = {"random", "standard_normal", "integers", "uniform", "normal", "exponential",
                "standard_exponential", "gamma", "standard_gamma", "beta", "binomial", "poisson"}

    def __init__(self, seed=None):
        self._rng = _np.random.default_rng(seed)

    def __getattr__(self, name):
        if name not in self._METHODS:
            raise AttributeError(f"CuPy's random.Generator has no method {name!r}: draw on the "
                                 f"host (numpy.random) and copy with xp.asarray, or use another")
        return _function(f"random.Generator.{name}", getattr(self._rng, name))


def asarray(a, dtype=None, order=None, *, blocking=False):
    """An array on the device; host data is copied over (a device array of that dtype is kept)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return _wrap(_np.array(_unwrap(a, "xp.asarray()", host_ok=True), dtype=dtype, order=order))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A new device array from host data, a device array or nested lists."""
    return _wrap(_np.array(_unwrap(obj, "xp.array()", host_ok=True), dtype=dtype,
                           copy=True if copy or not isinstance(obj, ndarray) else None,
                           order=order, ndmin=ndmin))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """A host copy of a device array (a NumPy array or host data passes through asarray)."""
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return _np.asarray(a, order=order)


def get_array_module(*args):
    """This module if any argument is one of its arrays, else NumPy (cupy.get_array_module)."""
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def indices(dimensions, dtype=int, sparse=False):
    """``numpy.indices`` without ``sparse``, which CuPy's does not have."""
    if sparse:
        raise TypeError("indices() got an unexpected keyword argument 'sparse': CuPy's indices "
                        "has no sparse form; build open grids with xp.arange(n).reshape(...) "
                        "or xp.ix_")
    return _wrap(_np.indices(dimensions, dtype=dtype))


random = _Namespace("random", _np.random, {"default_rng": _Generator})
linalg = _Namespace("linalg", _np.linalg)
_CACHE = {}


def __getattr__(name):
    """Every other NumPy name: types and constants as they are, functions behind the rules."""
    if name.startswith("__") or name not in dir(_np):
        raise AttributeError(f"the strict device (a stand-in for cupy) has no attribute {name!r}")
    if name not in _CACHE:
        value = getattr(_np, name)
        if isinstance(value, _np.ufunc):
            value = _Ufunc(value)
        elif callable(value) and not isinstance(value, type):
            value = _function(name, value)
        elif type(value).__name__ == "module":
            raise AttributeError(f"the strict device does not model numpy.{name} (CuPy has its "
                                 f"own, or none); add it to minipar/backend/strict.py if needed")
        _CACHE[name] = value
    return _CACHE[name]
