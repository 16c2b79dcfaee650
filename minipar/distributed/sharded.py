"""A tensor spread over ranks, described by GLOBAL coordinates, so it can be saved by one layout
and loaded by another (torch's ShardedTensor/DTensor, reduced to what a checkpoint needs).

A ``ShardedTensor`` is the serial tensor of ``shape`` of which this rank holds ``pieces``, each a
pair ``(index, array)``: a tuple of slices is a box of the global tensor (tensor parallelism's
row or column split; a fused QKV weight is three boxes), one slice a range of the global tensor
flattened in C order (ZeRO's flat shards, which cut through parameters wherever a bucket is cut).

    ShardedTensor((8, 4), "float64", [((slice(4, 8), slice(0, 4)), local)])   rows 4..7
    ShardedTensor((8, 4), "float64", [(slice(10, 20), flat_piece)])          elements 10..19

``write=False`` marks a replica (a data-parallel copy of a shard held elsewhere too): it is loaded
into but not written, so every element goes to disk once. ``ShardedStateDict`` gives the
tensor- and expert-parallel modules state dicts of them, as torch's DTensor does.
"""
import numpy

from .. import backend
from ..autograd import Tensor
from ..nn.module import refuse_load


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

    def __array__(self, dtype=None, copy=None):
        # numpy.asarray(t) is the global tensor, which only a rank holding all of it can give
        # (torch's DTensor.full_tensor() gathers; a state dict's reader gathers nothing)
        if len(self.pieces) != 1 or self.pieces[0][1].size != numpy.prod(self.shape):
            raise TypeError(f"{self!r} holds only part of its tensor: read .pieces, or load it "
                            f"through distributed.checkpoint")
        return backend.to_numpy(self.pieces[0][1]).reshape(self.shape).astype(dtype or self.dtype)


def split(local, axis, stride, rank, size, write=True):
    """``local``, rank's part of a tensor cut along ``axis`` as ``parallel.tensor.shard`` cuts it
    (each of ``stride`` blocks into ``size`` pieces), as a ShardedTensor of the whole tensor."""
    n = local.shape[axis] // stride
    shape = list(local.shape)
    shape[axis] *= size
    pieces = []
    for b in range(stride):  # block b (q, k or v of a fused weight): this rank's rows of it
        start = (b * size + rank) * n
        index = [slice(0, m) for m in shape]
        part = [slice(None)] * local.ndim
        index[axis] = slice(start, start + n)
        part[axis] = slice(b * n, (b + 1) * n)
        pieces.append((tuple(index), local[tuple(part)]))
    return ShardedTensor(shape, local.dtype, pieces, write)


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


def fill(array, value):
    """Copy ``value`` (a piece, on any device) into ``array`` in place, in its shape and dtype."""
    if not backend.is_gpu_array(array):
        value = backend.to_numpy(value)
    array[...] = backend.get_array_module(array).asarray(value, dtype=array.dtype).reshape(
        array.shape)


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
        # the saved entry's dtype: a 16-bit parameter's float32 master and moments stay float32
        kept = value.dtype if backend.is_low_precision(dtype) else dtype
        out = chunk[key] = numpy.zeros(hi - lo, kept)
        for entry, p, o in found:
            if tuple(entry[key].shape) != p.shape:
                raise ValueError(f"optimizer state {key!r} has shape {tuple(entry[key].shape)}, "
                                 f"the parameter {p.shape}")
            a, b = max(o, lo), min(o + p.size, hi)
            if a < b:
                out[a - lo:b - lo] = backend.to_numpy(entry[key]).reshape(-1)[a - o:b - o]
    return chunk


# ----------------------------------------------------------------------------------------------
# The state dict of a tensor- or expert-parallel module: torch's DTensor state dict
# ----------------------------------------------------------------------------------------------

def serial_names(model):
    """{parameter name in ``model``: its name in the serial twin}: the local expert i of an
    expert-parallel layer is the serial ``experts.{expert_ids[i]}`` (its ``serial_name``)."""
    out = {name: name for name, _ in model.named_parameters()}
    for prefix, m in model.named_modules():
        if hasattr(m, "serial_name"):
            head = f"{prefix}." if prefix else ""
            out.update({head + name: head + m.serial_name(name)
                        for name, _ in m.named_parameters()})
    return out


def placements(module):
    """(serial name, parameter, ``place``) for every parameter of ``module``; ``place(array)``
    is what a state dict holds for an array shaped like the parameter (its values, its optimizer
    state): a split parameter's the ShardedTensor of its slices, an expert's the whole tensor
    this expert rank alone holds, a replicated one's the array itself (rank 0 writes it)."""
    cuts, groups = {}, {}
    for _, m in module.named_modules():
        for attr, (axis, stride) in getattr(m, "tp_split", {}).items():
            if getattr(m, attr) is not None:
                cuts[id(getattr(m, attr))] = (axis, stride)
        if hasattr(m, "tp_split"):  # a tensor-parallel layer: its parameters and its group
            groups.update((id(p), m.group) for p in m.parameters())
    experts = {id(p) for _, m in module.named_modules() if hasattr(m, "expert_ids")
               for p in m.experts.parameters()}
    names = serial_names(module)
    for name, p in module.named_parameters():
        group = groups.get(id(p))
        if id(p) in cuts:
            def place(a, cut=cuts[id(p)], g=group):
                return split(a, *cut, g.rank, g.size)
        elif id(p) in experts:  # of its copies over a tensor group, tensor rank 0 writes it
            def place(a, g=group):
                return ShardedTensor(a.shape, a.dtype, [(box(a.shape), a)],
                                     write=g is None or g.rank == 0)
        else:
            def place(a):
                return a
        yield names[name], p, place


def held_elsewhere(module):
    """``others(name)``: whether ``name`` is a parameter of an expert another expert rank holds:
    a key of this layout, only not this rank's."""
    prefixes = tuple(f"{prefix}.experts.{e}." if prefix else f"experts.{e}."
                     for prefix, m in module.named_modules() if hasattr(m, "expert_ids")
                     for e in range(m.n_experts) if e not in m.expert_ids)
    return lambda name: bool(prefixes) and str(name).startswith(prefixes)


def local(p, place, value):
    """This rank's part of ``value`` (an array of the serial parameter's shape), shaped like
    ``p``: what ``place`` cut, read back."""
    out = backend.get_array_module(p.data).empty(p.shape, dtype=value.dtype)
    for array, piece in _sources(place(out), value):
        fill(array, piece)
    return out


class ShardedStateDict:
    """Mixin of the tensor- and expert-parallel modules: ``state_dict()`` under the serial
    twin's names and global shapes (``placements``), so ``distributed.checkpoint`` reshards it into
    a serial model or another layout; ``load_state_dict`` takes the serial twin's arrays, or a
    state dict of the same layout, and keeps this rank's slices."""

    def state_dict(self):
        state = {name: place(p.data) for name, p, place in placements(self)}
        state.update(self.named_buffers())
        return state

    def load_state_dict(self, state, strict=True):
        """As ``Module.load_state_dict``: every problem named before anything changes; returns
        ``(missing, unexpected)``."""
        mine = [(name, place(p.data)) for name, p, place in placements(self)]
        mine += list(self.named_buffers())
        missing = [name for name, _ in mine if name not in state]
        others = held_elsewhere(self)
        unexpected = sorted(k for k in set(state) - {name for name, _ in mine}
                            if not others(k))
        copies, misfits = [], []
        for name, held in mine:
            if name in state:
                try:
                    copies += _sources(held, state[name])
                except ValueError as e:
                    misfits.append(f"{name}: {e}")
        refuse_load(self, missing, unexpected, misfits, strict)
        for array, value in copies:
            fill(array, value)
        return missing, unexpected


def _sources(held, source):
    """[(this rank's piece, the value for it)] from ``source``: the global array, or a
    ShardedTensor holding the very same pieces."""
    pieces = held.pieces if isinstance(held, ShardedTensor) else [(box(held.shape), held)]
    source = source.data if isinstance(source, Tensor) else source
    if tuple(source.shape) != tuple(held.shape):
        raise ValueError(f"checkpoint {tuple(source.shape)} vs model {tuple(held.shape)}")
    if not isinstance(source, ShardedTensor):
        return [(array, view(source, index)) for index, array in pieces]
    theirs = {encode_index(index): array for index, array in source.pieces}
    lacking = [encode_index(index) for index, _ in pieces if encode_index(index) not in theirs]
    if lacking:
        raise ValueError(f"the given ShardedTensor lacks this rank's pieces {lacking} (load "
                         f"another layout's state dict through distributed.checkpoint)")
    return [(array, theirs[encode_index(index)]) for index, array in pieces]
