"""ZeRO-3's bookkeeping (zero3.py): a unit (one layer, gathered whole only while it computes),
its segments (one per param group, each padded to a multiple of N, rank r keeping chunk r), the
placeholder a parameter holds between its uses, and the all-gather in FP8 (``Float8Gather``).

    unit = Unit(name, module, params, comm, group_of)  # group_of: id(p) -> its param group
    unit.point(slot[:unit.numel])  # parameters: views of the gathered copy; then
    unit.release()                 # back to placeholders

FP8: torchao's float8 all-gather for FSDP2 (precompute_float8_dynamic_scale_for_fsdp), one
tensor-wise scale a parameter; bytes and rounding points in docs/float8.md.
"""
from ... import backend
from ...amp.float8_recipes import (Quantized, dequantize, float8_dtype, saturate,
                                  tensorwise_scale)
from ...backend import dtypes
from ...comm import chunk_bounds
from ...comm.nonblocking import iall_gather
from ...flat import flatten_parameters, offsets, padded_numel
from ...nn.module import Parameter


def layer_units(module):
    """(module, its own trainable parameters) for each module holding some (Linear, LayerNorm,
    Embedding); ``units=[...]`` names coarser ones (a GPT Block), taking every parameter below."""
    pairs = [(m, [v for _, v in m._members() if isinstance(v, Parameter) and v.requires_grad])
             for m in module.modules()]
    return [(m, params) for m, params in pairs if params]


def placeholder(p):
    """A read-only array of p's shape and dtype holding one element: p between its uses."""
    xp = backend.get_array_module(p.data)
    return xp.broadcast_to(xp.zeros((), p.dtype), p.shape)


class Segment:
    """The parameters of one param group in a unit, end to end in one flat vector padded to a
    multiple of N, at ``start`` in the unit's; rank r keeps chunk r as a Parameter (``shard``),
    the only one the optimizer sees, in group ``group`` (updates are elementwise)."""

    def __init__(self, group, params, start, comm):
        self.group, self.params, self.start = group, params, start
        self.offsets, n = offsets(params)
        self.numel = padded_numel(n, comm.size)
        flat = flatten_parameters(params, self.numel)
        # [lo, hi): this rank's chunk of the segment's flat vector
        self.lo, hi = chunk_bounds(self.numel, comm.size)[comm.rank:comm.rank + 2]
        self.shard = Parameter(flat[self.lo:hi].copy())

    def stretch(self, offset, size):
        """[a, b) in this rank's shard of the parameter at ``offset`` with ``size`` elements
        (a == b when none of it falls here)."""
        hi = self.lo + self.shard.size
        a, b = min(max(offset, self.lo), hi), max(min(offset + size, hi), self.lo)
        return a - self.lo, b - self.lo


class Unit:
    """One layer: its parameters, their place in the flat vector, this rank's shards."""

    def __init__(self, name, module, params, comm, group_of):
        self.name, self.module, self.params = name, module, params
        # one segment per param group among its parameters (a Linear's weight decayed, its
        # bias not: two), end to end in the unit's flat vector; each is gathered and
        # reduce-scattered whole, so each shard holds one group's elements only
        self.segments = []
        self.numel = 0
        for g in sorted({group_of[id(p)] for p in params}):
            segment = Segment(g, [p for p in params if group_of[id(p)] == g], self.numel, comm)
            self.segments.append(segment)
            self.numel += segment.numel
        self.starts = {id(p): segment.start + o for segment in self.segments
                       for p, o in zip(segment.params, segment.offsets)}
        self.slot = None  # its gathered copy's slot, from the first forward on
        self.work = None  # the all-gathers under way, one per segment
        self.grad_work = None  # the reduce-scatters under way, one per segment
        self.state = "sharded"  # -> gathered (forward) -> resharded -> backward -> done
        self.missing = len(params)  # gradients backward has still to produce
        self.reduced = False  # its gradient was reduce-scattered since the last step
        self.release()

    def point(self, flat):
        """Every parameter a view of its place in ``flat``, the unit's whole flat vector."""
        for p in self.params:
            o = self.starts[id(p)]
            p.data = flat[o:o + p.size].reshape(p.shape)

    def release(self):
        """Every parameter back to its placeholder: between uses ``.data`` is a zero-stride
        array of its shape."""
        for p in self.params:
            p.data = placeholder(p)


class Float8Gather:
    """ZeRO-3's parameter all-gather in FP8 (``ZeRO3(all_gather_dtype="float8_e4m3fn")``): at
    each forward's start ``cast`` makes every shard FP8, each parameter's stretch with the
    tensor-wise scale of the whole parameter (the amaxes of all the model's stretches in one
    all-reduce under max, so every rank has every scale and none travels with the data); the
    forward's and backward's all-gathers move those bytes, 1 an element, and ``finish``
    dequantises them into the unit's slot, in the slot's dtype."""

    def __init__(self, dtype):
        self.dtype = float8_dtype(dtype, "ZeRO3 all_gather_dtype")

    def check(self, units):
        """A TypeError naming the unit whose parameters are FP8 already (a Parameter is a
        float: the engine refuses others): the shards are the masters, wider than the wire."""
        for u in units:
            for seg in u.segments:
                if seg.shard.dtype in dtypes.FLOAT8:
                    raise TypeError(f"ZeRO3 all_gather_dtype={self.dtype.name}: unit {u.name!r} "
                                    f"has {seg.shard.dtype} parameters; an FP8 all-gather casts "
                                    f"float16, bfloat16, float32 or float64 parameters")

    def cast(self, comm, units, algorithm):
        """``seg.float8`` (this rank's shard in FP8) and ``seg.scales`` (one a parameter)."""
        segments = [seg for u in units for seg in u.segments]
        wide = [seg.shard.data.astype(dtypes.float32) for seg in segments]
        stretches = [[seg.stretch(o, q.size) for q, o in zip(seg.params, seg.offsets)]
                     for seg in segments]
        xp = backend.get_array_module(wide[0]) if wide else backend.xp()
        amax = xp.array([abs(x[a:b]).max(initial=0) for x, st in zip(wide, stretches)
                         for a, b in st], dtypes.float32)
        # one all-reduce for the model, on the thread that runs the all-gathers, after any
        # collective still under way
        s = iter(tensorwise_scale(comm.iall_reduce(amax, op="max", algorithm=algorithm).wait(),
                                  self.dtype))
        for seg, x, st in zip(segments, wide, stretches):
            factor, seg.scales = xp.zeros(x.size, dtypes.float32), []  # padding: 0, cast to 0
            for a, b in st:
                scale = next(s)
                factor[a:b] = scale
                seg.scales.append(dtypes.float32.type(1) / scale)
            seg.float8 = saturate(x * factor, self.dtype)

    def start(self, comm, seg, algorithm):
        """The all-gather of seg's FP8 shard: a Work whose wait() gives (p, chunk) FP8."""
        return iall_gather(comm, seg.float8, algorithm)

    def finish(self, seg, gathered, flat):
        """Each parameter of seg dequantised from ``gathered`` into ``flat``, seg's place."""
        data = gathered.reshape(-1)
        for q, o, scale in zip(seg.params, seg.offsets, seg.scales):
            flat[o:o + q.size] = dequantize(Quantized(data[o:o + q.size], scale, (q.size,)),
                                            flat.dtype)
