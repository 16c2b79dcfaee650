"""ZeRO-3's bookkeeping (zero3.py): a unit (one layer, gathered whole only while it computes),
its segments (one per param group, each padded to a multiple of N, rank r keeping chunk r) and
the placeholder a parameter holds between its uses.

    unit = Unit(name, module, params, comm, group_of)  # group_of: id(p) -> its param group
    unit.point(slot[:unit.numel])  # parameters: views of the gathered copy; then
    unit.release()                 # back to placeholders
"""
from ... import backend
from ...comm import chunk_bounds
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
