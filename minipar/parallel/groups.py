"""The rank grid of 3D and 4D parallelism (Megatron-LM's ``parallel_state``) as slices of one array.

W = tp × dp × pp ranks; a group of one kind holds the ranks that differ only in that coordinate.
For W = 16, tp = 2, pp = 4 (so dp = 2), as in Megatron's documentation, order tp-dp-pp:

    tensor   [0, 1] [2, 3] [4, 5] ... [14, 15]
    pipeline [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    data     [0, 2] [1, 3] [4, 6] [5, 7] ... [13, 15]

    grid = RankGrid(16, tp=2, pp=4)        # ep=2 adds expert and expert-data groups (ep | dp)
    grid.groups("dp"), grid.group_of(5, "pp"), grid.coords(5), grid.rank(tp=1, pp=1)
    groups = ParallelGroups(world, tp=2, pp=4)   # this rank's communicators: groups.tensor, ...

``minipar groups --world 16 --tp 2 --pp 4`` prints the grid.
"""
import itertools

import numpy as np  # the grid is host-side integers, whatever the device backend

# The table of group kinds, in the order they are listed (text, JSON, communicators): kind ->
# the name of its groups; KEYS: its key in the JSON and its ParallelGroups attribute.
KINDS = {"tp": "tensor", "pp": "pipeline", "dp": "data", "ep": "expert", "edp": "expert-data"}
KEYS = {kind: name.replace("-", "_") for kind, name in KINDS.items()}
DENSE = ("tp", "dp", "pp")  # the coordinates of the dense grid, in the order they are shown
# The expert grid's own kinds: it splits dp in two and shares tp and pp with the dense grid.
EXPERT = ("ep", "edp")
# The pairs of kinds whose groups check() finds orthogonal in the expert grid (tp and pp are
# checked with the dense grid).
EXPERT_PAIRS = (("tp", "ep"), ("tp", "edp"), ("ep", "edp"), ("ep", "pp"), ("edp", "pp"))


def orders():
    """Every order string RankGrid takes: the dense axes in any order, with or without ep
    beside dp."""
    out = []
    for axes in itertools.permutations(DENSE):
        d = axes.index("dp")
        out += ["-".join(axes)] + ["-".join(axes[:k] + ("ep",) + axes[k:]) for k in (d, d + 1)]
    return out


class RankGrid:
    """The map rank <-> (tp, dp, pp) coordinates for ``world`` ranks, the expert split of dp,
    and every group."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp", ep=1):
        for name, value in (("world size", world), ("tp", tp), ("pp", pp), ("ep", ep)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by tp·pp = {tp}·{pp} = "
                             f"{tp * pp}: the ranks cannot form a tp × dp × pp grid")
        axes = order.split("-") if isinstance(order, str) else []
        # ep named anywhere but beside dp would give the expert grid other pipeline groups than
        # the dense grid's, which Megatron refuses too.
        if order not in orders():
            raise ValueError(f"order {order!r} must name tp, dp and pp once each, fastest-varying "
                             f"first (Megatron's default is 'tp-dp-pp'), and may name ep once, "
                             f"beside dp ('tp-ep-dp-pp')")
        dp = world // (tp * pp)
        if dp % ep:
            raise ValueError(f"the data-parallel size dp = {world}/(tp·pp) = {dp} is not "
                             f"divisible by ep = {ep}: each data group splits into expert groups "
                             f"of ep ranks (Megatron: world % (tp·ep·pp) == 0)")
        self.world = world
        self.sizes = {"tp": tp, "dp": dp, "pp": pp, "ep": ep, "edp": dp // ep}
        self.tp, self.dp, self.pp, self.ep, self.edp = (self.sizes[k] for k in DENSE + EXPERT)
        # Megatron's default order "tp-dp-pp" makes the tensor coordinate vary fastest, then
        # data, then pipeline: rank = tp_rank + tp · (dp_rank + dp · pp_rank). It keeps each
        # tensor group, the chattiest (two all-reduces per layer, forward and backward), on
        # neighbouring ranks, i.e. inside one node.
        self.order = tuple(a for a in axes if a != "ep")
        # Megatron-core builds a second grid for the expert layers over the same ranks,
        # tp × ep × edp × pp in the order "tp-ep-dp-pp" (its "tp-cp-ep-dp-pp" with cp = 1), dp
        # there meaning edp = W / (tp·ep·pp). With the experts' tensor size equal to tp (ETP =
        # TP) both grids share the tensor and pipeline groups, and the expert grid cuts each
        # data group in two directions: d = e + ep · j (expert rank e, expert-data rank j).
        #   expert (ep)        the ranks holding different experts: the tokens of each move to
        #                      the rank holding their expert (all-to-all) and back
        #   expert-data (edp)  the ranks holding the same experts: expert gradients are reduced
        #                      here, the rest over the whole data group
        # For W = 8, tp = 2, ep = 2 (dp = 4, edp = 2): data [0, 2, 4, 6] [1, 3, 5, 7], expert
        # [0, 2] [1, 3] [4, 6] [5, 7], expert-data [0, 4] [1, 5] [2, 6] [3, 7].
        # An order that does not name ep puts it just before dp (Megatron's default); naming it
        # after dp ("tp-dp-ep-pp") gives d = j + edp · e.
        inner = ("edp", "ep") if "ep" in axes[axes.index("dp"):] else ("ep", "edp")
        self.expert_order = sum((inner if a == "dp" else (a,) for a in self.order), ())
        # Each grid is the ranks 0..W-1 in an array with one axis per coordinate, the slowest
        # first (C order), so a rank's coordinates are its index and a group is a slice. kind ->
        # (the grid it is a slice of, that grid's axes); tp and pp slice both grids alike.
        self.grids = {kind: (np.arange(world).reshape([self.sizes[a] for a in axes]), axes)
                      for axes in (self.expert_order[::-1], self.order[::-1]) for kind in axes}

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

    def _grid(self, kind, rank=0):
        """(the array of the grid that has ``kind``, its axes slowest first), once ``kind`` and
        ``rank`` are known to be in the grid."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        if kind not in self.grids:
            raise ValueError(f"unknown group kind {kind!r}: choose one of "
                             f"{', '.join(DENSE + EXPERT)}")
        return self.grids[kind]

    def expert_coords(self, rank):
        """{'tp', 'ep', 'edp', 'pp'} of a rank: its index in the expert grid, the dp coordinate
        d split as d = e + ep·j (or d = j + edp·e when the order puts ep after dp)."""
        grid, axes = self._grid("ep", rank)
        index = dict(zip(axes, np.unravel_index(rank, grid.shape)))
        split = [a for a in self.expert_order if a in EXPERT]  # the faster of ep, edp first
        return {a: int(index[a]) for a in ["tp", *split, "pp"]}

    @property
    def order_name(self):
        """The order as given, with ep shown beside dp when there are expert groups."""
        expert = ("dp" if a == "edp" else a for a in self.expert_order)
        return "-".join(self.order if self.ep == 1 else expert)

    def shown(self, kinds):
        """The ``kinds`` this grid shows (its groups' list: KINDS; a rank's coordinates: DENSE +
        EXPERT): ep and edp only when ep > 1."""
        return [kind for kind in kinds if kind not in EXPERT or self.ep > 1]

    def groups(self, kind):
        """Every group of one kind ('tp', 'dp', 'pp', 'ep' or 'edp'), each a sorted list of
        ranks, in order of their lowest rank: the grid's slices along the ``kind`` axis."""
        grid, axes = self._grid(kind)
        rows = np.moveaxis(grid, axes.index(kind), -1).reshape(-1, self.sizes[kind])
        return rows[np.argsort(rows[:, 0], kind="stable")].tolist()

    def group_of(self, rank, kind):
        """The group of one kind that contains ``rank``: its slice through the rank's index."""
        grid, axes = self._grid(kind, rank)
        index = list(np.unravel_index(rank, grid.shape))
        index[axes.index(kind)] = slice(None)
        return grid[tuple(index)].tolist()

    def check(self):
        """The groups are complete (each kind partitions the ranks) and orthogonal (groups of two
        different kinds of one grid share at most one rank), and every expert and expert-data
        group lies inside one data group; raises AssertionError naming what is wrong.
        O(world): each rank gets the index of its group of each kind, and two ranks with the same
        pair of indices for two kinds would be two ranks those groups share."""
        label = {}
        for kinds, pairs in ((DENSE, itertools.combinations(DENSE, 2)), (EXPERT, EXPERT_PAIRS)):
            label.update((kind, self._labels(kind)) for kind in kinds)
            for a, b in pairs:
                seen = {}  # (index of r's group of kind a, of kind b) -> the first such rank
                for r, pair in enumerate(zip(label[a], label[b])):
                    first = seen.setdefault(pair, r)
                    assert first == r, (f"{KINDS[a]} group {self.groups(a)[label[a][r]]} and "
                                        f"{KINDS[b]} group {self.groups(b)[label[b][r]]} share "
                                        f"ranks {first} and {r}")
        for kind in EXPERT:
            for g in self.groups(kind):
                assert len({label["dp"][r] for r in g}) == 1, \
                    f"{KINDS[kind]} group {g} spans more than one data group"
        return True

    def _labels(self, kind):
        """[index of the ``kind`` group holding rank r for each r], checking the groups have the
        right size and cover every rank once."""
        label = [None] * self.world
        for i, g in enumerate(self.groups(kind)):
            assert len(g) == self.sizes[kind], \
                f"{KINDS[kind]} group {g} has {len(g)} ranks, not {self.sizes[kind]}"
            for r in g:
                assert 0 <= r < self.world and label[r] is None, \
                    f"{KINDS[kind]} groups do not cover every rank once (rank {r})"
                label[r] = i
        assert None not in label, f"{KINDS[kind]} groups do not cover every rank once"
        return label

    def as_dict(self):
        """{'tensor': [[...]], 'pipeline': [[...]], 'data': [[...]]} plus sizes and each rank's
        coordinates; with ep > 1 also ep, edp, 'expert' and 'expert_data' groups, and each
        rank's ep and edp coordinates."""
        out = {"world": self.world, **{k: self.sizes[k] for k in DENSE}, "order": self.order_name}
        out.update((KEYS[kind], self.groups(kind)) for kind in KINDS if kind in DENSE)
        out.update({kind: self.sizes[kind] for kind in self.shown(EXPERT)})
        out.update((KEYS[kind], self.groups(kind)) for kind in self.shown(EXPERT))
        out["coords"] = [self.all_coords(r) for r in range(self.world)]
        return out

    def all_coords(self, rank):
        """``coords(rank)``, with the ep and edp coordinates when ep > 1."""
        c = self.coords(rank)
        return {**c, **self.expert_coords(rank)} if self.ep > 1 else c

    def title(self):
        """"world 16 = tp 2 × dp 4 × pp 2, dp 4 = ep 2 × edp 2  (order ..., fastest first)"."""
        split = f", dp {self.dp} = ep {self.ep} × edp {self.edp}" if self.ep > 1 else ""
        return (f"world {self.world} = tp {self.tp} × dp {self.dp} × pp {self.pp}{split}  "
                f"(order {self.order_name}, fastest first)")

    def describe(self, full=False):
        """The grid as text: each rank's coordinates, then every group (expert and expert-data
        groups too when ep > 1). Above ``SHOW_ALL`` ranks (unless ``full``) it shows the first
        and last few ranks and groups, the number left out in between, and the rank list of a
        long group as its first ranks and its last."""
        columns = self.shown(DENSE + EXPERT)
        lines = [self.title(), "", " rank" + "".join(f"{k:>5}" for k in columns)]
        short = not full and self.world > SHOW_ALL
        for r in _ends(range(self.world), 8 if short else self.world, "ranks"):
            c = self.all_coords(r) if isinstance(r, int) else {}  # or r is "... (N more ranks) ..."
            lines.append(f"{r:5d}" + "".join(f"{c[k]:5d}" for k in columns) if c else f"  {r}")
        for kind in self.shown(KINDS):
            groups = self.groups(kind)
            shown = _ends(groups, 4 if short else len(groups), "groups")
            text = " ".join(g if isinstance(g, str) else _ranks(g, short) for g in shown)
            lines.append(f"\n{KINDS[kind]} groups ({len(groups)} of {self.sizes[kind]}): {text}")
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
    """This rank's place in the grid and one communicator per group kind: ``tensor``,
    ``pipeline``, ``data``, ``expert`` and ``expert_data``, each ordered by that coordinate
    (``pipeline.rank`` is this rank's stage, ``expert.rank`` its expert rank). ``coords`` holds
    tp, dp, pp, ep and edp."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp", ep=1):
        self.world = world
        self.grid = RankGrid(world.size, tp=tp, pp=pp, order=order, ep=ep)
        self.coords = {**self.grid.coords(world.rank), **self.grid.expert_coords(world.rank)}
        for kind in KINDS:  # every rank joins every split, in the table's order
            color = self.grid.group_of(world.rank, kind)[0]  # a group is named by its lowest rank
            setattr(self, KEYS[kind], world.split(color, key=self.coords[kind]))

    def describe(self):
        r, c, grid = self.world.rank, self.coords, self.grid
        parts = []  # the coordinates, then the groups: dense, and expert when ep > 1
        for kinds in (DENSE, EXPERT)[:1 + (grid.ep > 1)]:
            parts += [" ".join(f"{k} {c[k]}" for k in kinds),
                      " ".join(f"{KINDS[k]} {grid.group_of(r, k)}" for k in KINDS if k in kinds)]
        return f"rank {r}: " + "  ".join(parts)
