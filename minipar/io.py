"""``minipar.save(obj, path)`` and ``minipar.load(path)``: checkpoints that run no code.

``obj`` is a tree of dicts, lists and tuples whose leaves are Tensors, NumPy or CuPy arrays,
NumPy scalars, Python numbers, bools, None and strings: a model's and an optimizer's
``state_dict()``, ``minipar.get_rng_state()``, the step, the sampler's epoch. ``load`` gives the
same tree back: Tensors as Tensors (``requires_grad`` kept; a Parameter as a Parameter), arrays as
arrays (a CuPy array goes to the host on save and comes back on the current device), integer
dict keys as integers, tuples as tuples, floats to the bit.

The file is a NumPy ``.npz`` read with ``allow_pickle=False``: the tree as JSON in one entry, one
entry per array, each with its SHA-256, and a SHA-256 trailer over the whole; it is written
atomically. The layout, and why not pickle or safetensors: docs/engine.md.
"""
import hashlib
import io
import json
import os
import re
import tempfile

import numpy

from . import backend
from .autograd import Tensor
from .nn.module import Parameter

FORMAT, VERSION = "minipar-checkpoint", 1
MAGIC = b"\nMINIPAR-SHA256 "
TRAILER = len(MAGIC) + 64
# write_atomic's temporary file for ``name``: ".<name>.<mkstemp's 8 characters>.tmp"
TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: damaged, truncated, not minipar's, or holding pickle."""


# --------------------------------------------------------------------------------------------
# The tree <-> JSON and a list of arrays
# --------------------------------------------------------------------------------------------

def _encode(obj, arrays, where):
    """JSON for ``obj``; array leaves are appended to ``arrays`` and named by their index."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):  # (bool is handled above)
        return {"int": str(obj)}
    if isinstance(obj, float):
        return {"float": float.hex(obj)}  # exact, and nan/inf survive
    if isinstance(obj, Tensor):
        arrays.append(backend.to_numpy(obj.data))
        return {"tensor": len(arrays) - 1, "requires_grad": bool(obj.requires_grad),
                "parameter": isinstance(obj, Parameter)}
    if isinstance(obj, numpy.generic):
        arrays.append(numpy.asarray(obj))
        return {"scalar": len(arrays) - 1}
    if isinstance(obj, numpy.ndarray) or backend.is_gpu_array(obj):
        arrays.append(backend.to_numpy(obj))
        return {"array": len(arrays) - 1, "gpu": backend.is_gpu_array(obj)}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"tuple": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        return {"dict": [[_encode(k, arrays, f"{where} key"), _encode(v, arrays, f"{where}[{k!r}]")]
                         for k, v in obj.items()]}
    raise TypeError(f"minipar.save: {where} is a {type(obj).__name__}; a checkpoint holds dicts, "
                    f"lists, tuples, Tensors, arrays, numbers, bools, None and strings")


def _decode(node, arrays):
    if node is None or isinstance(node, (bool, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, arrays) for v in node]
    (kind, value), *_ = node.items()
    if kind == "int":
        return int(value)
    if kind == "float":
        return float.fromhex(value)
    if kind == "tuple":
        return tuple(_decode(v, arrays) for v in value)
    if kind == "dict":
        return {_freeze(_decode(k, arrays)): _decode(v, arrays) for k, v in value}
    if kind == "scalar":
        return arrays[value][()]
    data = arrays[value]
    if kind == "array":
        return backend.asarray(data) if node["gpu"] else data
    cls = Parameter if node["parameter"] else Tensor
    return cls(backend.asarray(data), requires_grad=node["requires_grad"])


def _freeze(key):
    """A dict key back as it went in: a tuple key's items are hashable again."""
    return tuple(_freeze(k) for k in key) if isinstance(key, (tuple, list)) else key


def _sha(array):
    return hashlib.sha256(numpy.ascontiguousarray(array).view(numpy.uint8).reshape(-1)).hexdigest()


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------

def to_bytes(obj):
    """The whole file ``save`` writes, as bytes: the .npz payload, then its SHA-256 trailer."""
    arrays = []
    tree = _encode(obj, arrays, "obj")
    names = [f"a{i}" for i in range(len(arrays))]
    structure = {"format": FORMAT, "version": VERSION, "tree": tree,
                 "entries": {n: _sha(a) for n, a in zip(names, arrays)},
                 # .npz keeps bfloat16 as 2 raw bytes (NumPy has no such type): its name, so
                 # load reads the bytes back as bfloat16
                 "dtypes": {n: a.dtype.name for n, a in zip(names, arrays)
                            if a.dtype == backend.bfloat16}}
    blob = numpy.frombuffer(json.dumps(structure, allow_nan=False).encode(), dtype=numpy.uint8)
    buffer = io.BytesIO()
    numpy.savez(buffer, structure=blob, **dict(zip(names, arrays)))
    payload = buffer.getvalue()
    return payload + MAGIC + hashlib.sha256(payload).hexdigest().encode()


def save(obj, path):
    """Write ``obj`` to exactly ``path`` (no suffix added), atomically. Returns ``path``."""
    data = to_bytes(obj)
    write_atomic(path, data)
    return path


def write_atomic(path, data):
    """Write ``data`` to a temporary file beside ``path`` (``TEMPORARY``), fsync it, rename it
    over ``path``, then fsync the folder so the rename itself is on disk."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)  # a crash leaves the old file or the new one, never half
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors (Windows)
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------

def load(path):
    """The tree ``save`` wrote to ``path``; ``CheckpointError`` naming the file (and the entry)
    if a byte of it differs from what was written, and nothing loaded."""
    return read(path)[0]


def read(path):
    """``(tree, digest)``: ``load``'s tree and the file's SHA-256 (hex) as its trailer records it,
    which a manifest can quote to tie files of one save together."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a folder, not a file: a distributed checkpoint? "
                              f"(minipar.distributed.checkpoint.load)") from None
    return from_bytes(data, path)


def from_bytes(data, path="<bytes>"):
    # The trailer's digest covers every byte before it, and its fixed place at the very end makes
    # a truncation or an appended byte as visible as a flipped bit. Any damage: CheckpointError
    # naming the file (and the first damaged entry where one can be found), nothing loaded.
    payload, trailer = data[:-TRAILER], data[-TRAILER:]
    if not trailer.startswith(MAGIC) or not _is_hex(trailer[len(MAGIC):]):
        if data[:1] == b"\x80" or data[:2] != b"PK":
            raise CheckpointError(f"{path} is not a minipar checkpoint (no .npz payload and no "
                                  f"checksum trailer; a pickle file is never loaded)")
        raise CheckpointError(f"{path} is damaged: its checksum trailer is missing or altered "
                              f"(the file was truncated, extended, or changed at its end)")
    digest = trailer[len(MAGIC):].decode()
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path} is damaged: its SHA-256 does not match the one it was "
                              f"written with{_first_bad_entry(payload)}")
    structure, arrays = _open(payload, path)
    return _decode(structure["tree"], arrays), digest


def _is_hex(b):
    return len(b) == 64 and all(c in b"0123456789abcdef" for c in b)


def _open(payload, path):
    """The structure and the arrays of a payload whose whole-file digest has been checked:
    each array checked against its own digest, object (pickle) arrays refused."""
    try:
        with numpy.load(io.BytesIO(payload), allow_pickle=False) as npz:
            structure = json.loads(bytes(npz["structure"]).decode())
            if structure.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a minipar checkpoint (format "
                                      f"{structure.get('format')!r})")
            if structure.get("version") != VERSION:
                raise CheckpointError(f"{path} has format version {structure.get('version')}; "
                                      f"this minipar reads version {VERSION}")
            arrays = []
            for i, (name, digest) in enumerate(structure["entries"].items()):
                if name != f"a{i}":
                    raise CheckpointError(f"{path}: unexpected entry name {name!r}")
                array = _array(npz, name, path)
                if _sha(array) != digest:
                    raise CheckpointError(f"{path} is damaged: entry {name!r} does not match "
                                          f"its SHA-256")
                if name in structure.get("dtypes", {}):
                    array = array.view(backend.dtype(structure["dtypes"][name]))
                arrays.append(array)
    except CheckpointError:
        raise
    except Exception as e:  # a zip, .npy or JSON that does not parse
        raise CheckpointError(f"{path} cannot be read as a minipar checkpoint: "
                              f"{type(e).__name__}: {e}") from None
    return structure, arrays


def _array(npz, name, path):
    try:
        return npz[name]
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise CheckpointError(f"{path}: entry {name!r} is a pickled object array; minipar "
                                  f"never unpickles (it could run code from the file)") from None
        raise


def _first_bad_entry(payload):
    """', first damaged entry: a3' when the damaged payload still parses, else ''."""
    try:
        with numpy.load(io.BytesIO(payload), allow_pickle=False) as npz:
            structure = json.loads(bytes(npz["structure"]).decode())
            for name, digest in structure["entries"].items():
                try:
                    bad = _sha(npz[name]) != digest
                except Exception:
                    bad = True
                if bad:
                    return f" (first damaged entry: {name!r})"
    except Exception:
        return " (its index or structure is damaged too)"
    return " (every array entry checks out: the damage is in the zip's own bookkeeping)"
