"""The rank grid of 3D parallelism: which ranks share a tensor, a pipeline or a data group, and
the communicators built from it (``ParallelGroups``: one per group kind, for this rank).

W ranks are arranged as a grid of tp × dp × pp = W. Megatron-LM's default order makes the tensor
coordinate vary fastest, then data, then pipeline (its order string "tp-dp-pp"), so

    rank = tp_rank + tp · (dp_rank + dp · pp_rank)

which keeps each tensor group, the chattiest (two all-reduces per layer, forward and backward), on
neighbouring ranks, i.e. inside one node. A group of one kind is the set of ranks that differ
only in that coordinate. For W = 16, tp = 2, pp = 4 (so dp = 2), as in Megatron's documentation:

    tensor   [0, 1] [2, 3] [4, 5] ... [14, 15]
    pipeline [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    data     [0, 2] [1, 3] [4, 6] [5, 7] ... [13, 15]
"""
import itertools

KINDS = ("tp", "dp", "pp")
NAMES = {"tp": "tensor", "dp": "data", "pp": "pipeline"}


class RankGrid:
    """The map rank <-> (tp, dp, pp) coordinates for ``world`` ranks, and every group."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp"):
        for name, value in (("world size", world), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by tp·pp = {tp}·{pp} = "
                             f"{tp * pp}: the ranks cannot form a tp × dp × pp grid")
        axes = order.split("-")
        if sorted(axes) != sorted(KINDS):
            raise ValueError(f"order {order!r} must name tp, dp and pp once each, fastest-varying "
                             f"first (Megatron's default is 'tp-dp-pp')")
        self.world, self.order = world, tuple(axes)
        self.sizes = {"tp": tp, "dp": world // (tp * pp), "pp": pp}
        self.tp, self.dp, self.pp = self.sizes["tp"], self.sizes["dp"], self.sizes["pp"]

    def coords(self, rank):
        """{'tp': i, 'dp': j, 'pp': k} of a rank: its digits in the mixed radix of ``order``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        ### BEGIN SOLUTION rank-grid
        coords = {}
        for axis in self.order:
            rank, coords[axis] = divmod(rank, self.sizes[axis])
        return coords
        ### END SOLUTION

    def rank(self, tp=0, dp=0, pp=0):
        """The rank at the given coordinates (inverse of ``coords``)."""
        ### BEGIN SOLUTION rank-grid
        coords = {"tp": tp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for axis in self.order:
            if not 0 <= coords[axis] < self.sizes[axis]:
                raise ValueError(f"{axis} coordinate {coords[axis]} is outside 0..{self.sizes[axis] - 1}")
            rank += coords[axis] * stride
            stride *= self.sizes[axis]
        return rank
        ### END SOLUTION

    def stride(self, kind):
        """How far apart two ranks are whose ``kind`` coordinates differ by one: the product of
        the sizes of the axes that vary faster (before ``kind`` in ``order``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r}: choose one of {', '.join(KINDS)}")
        stride = 1
        for axis in self.order[:self.order.index(kind)]:
            stride *= self.sizes[axis]
        return stride

    def groups(self, kind):
        """Every group of one kind ('tp', 'dp' or 'pp'), each a sorted list of ranks, in order of
        their lowest rank. A group is its lowest rank b (``kind`` coordinate 0) plus multiples of
        the stride: [b, b + s, ..., b + (size - 1)·s]; one pass over the ranks, O(world)."""
        stride, size = self.stride(kind), self.sizes[kind]
        return [list(range(b, b + size * stride, stride))
                for b in range(self.world) if (b // stride) % size == 0]

    def group_of(self, rank, kind):
        """The group of one kind that contains ``rank``: computed from its coordinate, O(size)."""
        stride, size = self.stride(kind), self.sizes[kind]
        base = rank - self.coords(rank)[kind] * stride
        return list(range(base, base + size * stride, stride))

    def check(self):
        """The groups are complete (each kind partitions the ranks) and orthogonal (groups of two
        different kinds share at most one rank); raises AssertionError naming what is wrong.
        O(world): each rank gets the index of its group of each kind, and two ranks with the same
        pair of indices for two kinds would be two ranks those groups share."""
        label = {}
        for kind in KINDS:
            groups, label[kind] = self.groups(kind), [None] * self.world
            for i, g in enumerate(groups):
                assert len(g) == self.sizes[kind], \
                    f"{NAMES[kind]} group {g} has {len(g)} ranks, not {self.sizes[kind]}"
                for r in g:
                    assert 0 <= r < self.world and label[kind][r] is None, \
                        f"{NAMES[kind]} groups do not cover every rank once (rank {r})"
                    label[kind][r] = i
            assert None not in label[kind], f"{NAMES[kind]} groups do not cover every rank once"
        for a, b in itertools.combinations(KINDS, 2):
            seen = {}
            for r in range(self.world):
                first = seen.setdefault((label[a][r], label[b][r]), r)
                assert first == r, (f"{NAMES[a]} group {self.groups(a)[label[a][r]]} and "
                                    f"{NAMES[b]} group {self.groups(b)[label[b][r]]} share ranks "
                                    f"{first} and {r}")
        return True

    def as_dict(self):
        """{'tensor': [[...]], 'pipeline': [[...]], 'data': [[...]]} plus sizes and coordinates."""
        return {"world": self.world, "tp": self.tp, "dp": self.dp, "pp": self.pp,
                "order": "-".join(self.order),
                "tensor": self.groups("tp"), "pipeline": self.groups("pp"),
                "data": self.groups("dp"),
                "coords": [self.coords(r) for r in range(self.world)]}

    def describe(self, full=False):
        """The grid as text: each rank's coordinates, then every group. Above ``SHOW_ALL`` ranks
        (unless ``full``) it shows the first and last few ranks and groups, the number left out
        in between, and the rank list of a long group as its first ranks and its last."""
        lines = [f"world {self.world} = tp {self.tp} × dp {self.dp} × pp {self.pp}  "
                 f"(order {'-'.join(self.order)}, fastest first)", "",
                 " rank   tp   dp   pp"]
        short = not full and self.world > SHOW_ALL
        for r in _ends(range(self.world), 8 if short else self.world, "ranks"):
            if isinstance(r, str):
                lines.append(f"  {r}")
                continue
            c = self.coords(r)
            lines.append(f"{r:5d} {c['tp']:4d} {c['dp']:4d} {c['pp']:4d}")
        for kind in ("tp", "pp", "dp"):
            groups = self.groups(kind)
            shown = _ends(groups, 4 if short else len(groups), "groups")
            text = " ".join(g if isinstance(g, str) else _ranks(g, short) for g in shown)
            lines.append(f"\n{NAMES[kind]} groups ({len(groups)} of {self.sizes[kind]}): {text}")
        return "\n".join(lines)


SHOW_ALL = 64  # describe() prints every rank and group up to this many ranks


def _ends(items, keep, what):
    """The first ``keep`` and last ``keep`` items, with "... (N more what) ..." between them."""
    if len(items) <= 2 * keep + 1:
        return list(items)
    return [*items[:keep], f"... ({len(items) - 2 * keep} more {what}) ...", *items[-keep:]]


def _ranks(group, short):
    """[0,1,2] -- or, when ``short`` and the group is long, [0,2,4,...,16382]."""
    if short and len(group) > 8:
        return f"[{group[0]},{group[1]},{group[2]},...,{group[-1]}]"
    return str(group).replace(" ", "")


class ParallelGroups:
    """This rank's place in the grid and one communicator per group kind (tensor, pipeline,
    data), each ordered by that coordinate: ``pipeline.rank`` is this rank's stage."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp"):
        self.world = world
        self.grid = RankGrid(world.size, tp=tp, pp=pp, order=order)
        self.coords = self.grid.coords(world.rank)
        comms = {}
        for kind in ("tp", "pp", "dp"):  # every rank joins every split, in the same order
            groups = self.grid.groups(kind)
            color = next(i for i, g in enumerate(groups) if world.rank in g)
            comms[kind] = world.split(color, key=self.coords[kind])
        self.tensor, self.pipeline, self.data = comms["tp"], comms["pp"], comms["dp"]

    def describe(self):
        c = self.coords
        return (f"rank {self.world.rank}: tp {c['tp']} dp {c['dp']} pp {c['pp']}  "
                f"tensor {self.grid.group_of(self.world.rank, 'tp')} "
                f"pipeline {self.grid.group_of(self.world.rank, 'pp')} "
                f"data {self.grid.group_of(self.world.rank, 'dp')}")
