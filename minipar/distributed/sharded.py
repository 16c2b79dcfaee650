"""A tensor spread over ranks, described by GLOBAL coordinates, so it can be saved by one layout
and loaded by another (torch's ShardedTensor/DTensor, reduced to what a checkpoint needs).

A ``ShardedTensor`` is the serial tensor of ``shape`` of which this rank holds ``pieces``, each a
pair ``(index, array)``: a tuple of slices is a box of the global tensor (tensor parallelism's
row or column split; a fused QKV weight is three boxes), one slice a range of the global tensor
flattened in C order (ZeRO's flat shards, which cut through parameters wherever a bucket is cut).

    ShardedTensor((8, 4), "float64", [((slice(4, 8), slice(0, 4)), local)])   rows 4..7
    ShardedTensor((8, 4), "float64", [(slice(10, 20), flat_piece)])          elements 10..19

``write=False`` marks a replica (a data-parallel copy of a shard held elsewhere too): it is loaded
into but not written, so every element goes to disk once.
"""
import numpy

from .. import backend


class ShardedTensor:
    """This rank's pieces of a global tensor (module docstring)."""

    def __init__(self, shape, dtype, pieces, write=True):
        self.shape, self.dtype = tuple(int(n) for n in shape), numpy.dtype(dtype)
        self.pieces, self.write = list(pieces), bool(write)
        for index, array in self.pieces:
            size = _extent(index, self.shape)
            if tuple(array.shape) != size and not (isinstance(index, slice) and
                                                   array.size == size[0]):
                raise ValueError(f"a piece at {encode_index(index)} of a tensor of shape "
                                 f"{self.shape} has shape {tuple(array.shape)}, not {size}")

    def __repr__(self):
        return (f"ShardedTensor(shape={self.shape}, dtype={self.dtype}, pieces="
                f"{[encode_index(i) for i, _ in self.pieces]}, write={self.write})")


def box(shape):
    """The index of the whole tensor: a replicated tensor is one piece covering everything."""
    return tuple(slice(0, n) for n in shape)


def _extent(index, shape):
    if isinstance(index, slice):
        return (index.stop - index.start,)
    return tuple(s.stop - s.start for s in index)


def encode_index(index):
    """A piece's index as plain data for the manifest: ("flat", start, stop) or
    ("box", starts, stops)."""
    if isinstance(index, slice):
        return ("flat", int(index.start), int(index.stop))
    return ("box", tuple(int(s.start) for s in index), tuple(int(s.stop) for s in index))


def decode_index(encoded):
    kind, start, stop = encoded
    if kind == "flat":
        return slice(start, stop)
    return tuple(slice(a, b) for a, b in zip(start, stop))


def view(array, index):
    """The part of ``array`` (global shape) at ``index``, as an array of the piece's shape."""
    if isinstance(index, slice):
        return array.reshape(-1)[index]
    return array[tuple(index) + (Ellipsis,)]  # a 0-d array stays an array, not a scalar


def assemble(shape, dtype, pieces, name):
    """The global NumPy array from ``(index, array)`` pieces; a ValueError naming ``name`` when
    the pieces leave part of it uncovered."""
    out = numpy.zeros(shape, dtype=dtype)
    covered = numpy.zeros(shape, dtype=bool)
    for index, array in pieces:
        target = view(out, index)
        target[...] = backend.to_numpy(array).reshape(target.shape)
        view(covered, index)[...] = True  # reshape(-1) of a fresh array is a view
    if not covered.all():
        raise ValueError(f"{name}: the checkpoint holds only {int(covered.sum())} of its "
                         f"{covered.size} elements")
    return out


def flat_pieces(members, lo, hi, state):
    """{name: {key: ShardedTensor or value}}: the optimizer ``state`` of the flat shard [lo, hi)
    of parameters laid end to end, ``members`` = [(name, parameter, offset)], cut at the
    parameters' edges into ranges of their flattened arrays (padding dropped)."""
    out = {}
    for name, p, o in members:
        a, b = max(o, lo), min(o + p.size, hi)  # this shard's part of p
        out[name] = {key: ShardedTensor(p.shape, value.dtype, [(slice(a - o, b - o),
                                                                value[a - lo:b - lo])]
                                        if a < b else []) if hasattr(value, "shape") else value
                     for key, value in state.items()}
    return out


def flat_chunk(members, lo, hi, saved, dtype):
    """The inverse of ``flat_pieces``: the shard's state from ``saved`` = {name: {key: whole
    array or value}} (zeros in the padding), or None when no member has state; a KeyError or
    ValueError names what does not fit."""
    found = [(saved[name], p, o) for name, p, o in members if name in saved]
    if not found:
        return None
    if len(found) != len(members):
        raise KeyError(f"optimizer state for only some parameters of a flat shard: "
                       f"{[name for name, _, _ in members if name not in saved]} lack it")
    chunk = {}
    for key, value in found[0][0].items():
        if not hasattr(value, "shape"):
            chunk[key] = value
            continue
        out = chunk[key] = numpy.zeros(hi - lo, dtype)
        for entry, p, o in found:
            if tuple(entry[key].shape) != p.shape:
                raise ValueError(f"optimizer state {key!r} has shape {tuple(entry[key].shape)}, "
                                 f"the parameter {p.shape}")
            a, b = max(o, lo), min(o + p.size, hi)
            if a < b:
                out[a - lo:b - lo] = backend.to_numpy(entry[key]).reshape(-1)[a - o:b - o]
    return chunk
