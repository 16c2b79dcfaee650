"""The rank grid of 3D to 5D parallelism (Megatron-LM's ``parallel_state``) as slices of one array.

W = tp × cp × dp × pp ranks; a group of one kind holds the ranks differing only in its coordinates.
For W = 16, tp = 2, pp = 4 (so dp = 2), as in Megatron's documentation, order tp-dp-pp:

    tensor   [0, 1] [2, 3] [4, 5] ... [14, 15]
    pipeline [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    data     [0, 2] [1, 3] [4, 6] [5, 7] ... [13, 15]

    grid = RankGrid(16, tp=2, pp=4)        # cp=2: context groups; ep=2: expert groups (ep | dp·cp)
    grid.groups("dp"), grid.group_of(5, "pp"), grid.coords(5), grid.rank(tp=1, pp=1)
    groups = ParallelGroups(world, tp=2, pp=4)   # this rank's communicators: groups.tensor, ...

``minipar groups --world 16 --tp 2 --cp 2 --pp 4`` prints the grid.
"""
import functools
import itertools
import math

import numpy as np  # the grid is host-side integers, whatever the device backend

from minipar.parallel.grid_text import GridText

# The table of group kinds, in the order they are listed (text, JSON, communicators): kind ->
# the name of its groups; KEYS: its key in the JSON and its ParallelGroups attribute. A kind
# "a-b" holds the ranks that differ only in coordinates a and b (Megatron-core's combined groups):
#   context (cp)    the ranks holding different chunks of the same sequences (ring attention)
#   tensor-context  tp × cp: the ranks sharing one layer's weights and one sample's tokens
#   data-context    dp × cp: gradients are averaged here, since each cp rank saw other tokens
#                   of the same samples; the expert grid cuts it in ep × edp
# Megatron also builds tp-dp, tp-dp-cp (fp8 scales, a distributed optimizer over tp), tp-pp (the
# model group) and hierarchical cp groups (all-to-all inside a node): no minipar trainer uses them.
KINDS = {"tp": "tensor", "pp": "pipeline", "dp": "data", "cp": "context",
         "tp-cp": "tensor-context", "dp-cp": "data-context", "ep": "expert", "edp": "expert-data"}
KEYS = {kind: name.replace("-", "_") for kind, name in KINDS.items()}
DENSE = ("tp", "cp", "dp", "pp")  # the coordinates of the dense grid, in the order they are shown
# The expert grid's own kinds: it splits dp·cp in two and shares tp and pp with the dense grid.
EXPERT = ("ep", "edp")
# The pairs of kinds whose groups check() finds orthogonal in the expert grid (tp and pp are
# checked with the dense grid).
EXPERT_PAIRS = (("tp", "ep"), ("tp", "edp"), ("ep", "edp"), ("ep", "pp"), ("edp", "pp"))


@functools.cache  # a tuple built once: the planner builds a grid for each of 10^5 layouts
def orders():
    """Every order string RankGrid takes: the dense axes in any order, cp (if named) beside dp,
    with or without ep beside dp."""
    out = []
    for axes in (*itertools.permutations(("tp", "dp", "pp")), *itertools.permutations(DENSE)):
        d = axes.index("dp")
        if "cp" not in axes or abs(axes.index("cp") - d) == 1:
            out += ["-".join(axes)] + ["-".join(axes[:k] + ("ep",) + axes[k:]) for k in (d, d + 1)]
    return tuple(out)


class RankGrid(GridText):
    """The map rank <-> (tp, cp, dp, pp) coordinates for ``world`` ranks, the expert split of
    dp·cp, and every group (shown as text and JSON by ``GridText``)."""

    KINDS, KEYS, DENSE, EXPERT = KINDS, KEYS, DENSE, EXPERT  # the table, for GridText

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp", ep=1, cp=1):
        for name, value in (("world size", world), ("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        # Megatron-core: W = tp·cp·dp·pp, and the expert grid's W = tp·ep·edp·pp.
        if world % (tp * cp * pp):
            sizes = f"tp·pp = {tp}·{pp}" if cp == 1 else f"tp·cp·pp = {tp}·{cp}·{pp}"
            raise ValueError(f"world size {world} is not divisible by {sizes} = {tp * cp * pp}: "
                             f"the ranks cannot form a tp × {'cp × ' * (cp > 1)}dp × pp grid")
        axes = order.split("-") if isinstance(order, str) else []
        # ep named anywhere but beside dp would give the expert grid other pipeline groups than
        # the dense grid's, which Megatron refuses too; so would cp apart from dp.
        if order not in orders():
            raise ValueError(f"order {order!r} must name tp, dp and pp once each, fastest-varying "
                             f"first (Megatron's default is 'tp-dp-pp'), and may name ep once, "
                             f"beside dp ('tp-ep-dp-pp'), and cp once, beside dp or that ep "
                             f"(Megatron-core's 'tp-cp-ep-dp-pp')")
        dp = world // (tp * cp * pp)
        if dp * cp % ep:
            block = "dp" if cp == 1 else "dp·cp"
            raise ValueError(f"the data-parallel size {block} = {world}/(tp·pp) = {dp * cp} is "
                             f"not divisible by ep = {ep}: "
                             f"each data group splits into expert groups of ep ranks "
                             f"(Megatron: world % (tp·ep·pp) == 0)")
        self.world = world
        self.sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "edp": dp * cp // ep}
        self.sizes.update((k, math.prod(self.sizes[a] for a in k.split("-"))) for k in KINDS)
        vars(self).update((k, self.sizes[k]) for k in DENSE + EXPERT)  # self.tp, self.cp, ...
        # Megatron's default order "tp-dp-pp" makes the tensor coordinate vary fastest, then
        # data, then pipeline: rank = tp_rank + tp · (dp_rank + dp · pp_rank). It keeps each
        # tensor group, the chattiest (two all-reduces per layer, forward and backward), on
        # neighbouring ranks, i.e. inside one node. Megatron-core's "tp-cp-ep-dp-pp" puts the
        # context coordinate next (its ring passes k and v every layer), ep beside it: an order
        # that does not name them puts ep just before dp, and cp before both.
        for axis in ("ep", "cp"):
            if axis not in axes:
                axes.insert(min(axes.index(a) for a in ("ep", "dp") if a in axes), axis)
        self.named = tuple(a for a in axes if self.sizes[a] > 1 or a not in ("ep", "cp"))
        self.axes = tuple(a for a in axes if a != "ep")  # the dense grid's, cp = 1 included
        self.order = tuple(a for a in self.axes if a != "cp" or cp > 1)
        # Megatron-core builds a second grid for the expert layers over the same ranks,
        # tp × ep × edp × pp in the order "tp-ep-dp-pp" (its "tp-cp-ep-dp-pp" with cp = 1), dp
        # there meaning edp = W / (tp·ep·pp). With the experts' tensor size equal to tp (ETP =
        # TP) both grids share the tensor and pipeline groups, and the expert grid cuts each
        # data-context group (cp and dp together: f = c + cp · d) in two directions:
        # f = e + ep · j (expert rank e, expert-data rank j).
        #   expert (ep)        the ranks holding different experts: the tokens of each move to
        #                      the rank holding their expert (all-to-all) and back
        #   expert-data (edp)  the ranks holding the same experts: expert gradients are reduced
        #                      here, the rest over the whole data-context group
        # For W = 8, tp = 2, ep = 2 (dp = 4, edp = 2): data [0, 2, 4, 6] [1, 3, 5, 7], expert
        # [0, 2] [1, 3] [4, 6] [5, 7], expert-data [0, 4] [1, 5] [2, 6] [3, 7].
        # Naming ep after dp ("tp-dp-ep-pp") gives f = j + edp · e.
        inner = ("edp", "ep") if axes.index("ep") > axes.index("dp") else ("ep", "edp")
        self.expert_order = sum((inner if a == "dp" else () if a == "cp" else (a,)
                                 for a in self.axes), ())
        # Each grid is the ranks 0..W-1 in an array with one axis per coordinate, the slowest
        # first (C order), so a rank's coordinates are its index and a group is a slice. kind ->
        # the axes of the grid it is a slice of; tp and pp slice both grids alike, a combined
        # kind (tp-cp, dp-cp) the dense grid.
        self.axes_of = {kind: axes for axes in (self.expert_order[::-1], self.axes[::-1])
                        for kind in [*axes, *(k for k in KINDS if "-" in k)]}

    @functools.cached_property
    def grids(self):
        """kind -> (the array of its grid, that grid's axes), built when a group is first asked
        for: a grid only counted (the planner's, of a billion ranks) holds no W integers."""
        return {kind: (np.arange(self.world).reshape([self.sizes[a] for a in axes]), axes)
                for kind, axes in self.axes_of.items()}

    def stride(self, kind, axis):
        """The distance between two ranks one apart along ``axis`` in the grid holding ``kind``."""
        axes = self.axes_of[kind]
        return math.prod(self.sizes[a] for a in axes[axes.index(axis) + 1:])

    def coords(self, rank):
        """{'tp': i, 'cp': c, 'dp': j, 'pp': k} of a rank, every axis of the grid (cp = 0 when
        cp = 1): its digits in the mixed radix of ``axes``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        ### BEGIN SOLUTION rank-grid
        coords = {}
        for axis in self.axes:
            rank, coords[axis] = divmod(rank, self.sizes[axis])
        return coords
        ### END SOLUTION

    def rank(self, tp=0, dp=0, pp=0, cp=0):
        """The rank at the given coordinates (inverse of ``coords``)."""
        if cp or self.cp > 1:  # the exercise below knows tp, dp and pp; with cp: the grid's strides
            given = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
            if any(not 0 <= given[a] < self.sizes[a] for a in DENSE):
                raise ValueError(f"coordinates {given} are outside the grid of {self.title()}")
            return sum(given[a] * self.stride("cp", a) for a in DENSE)
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

    def _axes(self, kind, rank=0):
        """The axes (slowest first) of the grid that has ``kind``, once ``kind`` and ``rank`` are
        known to be in the grid."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        if kind not in self.axes_of:
            raise ValueError(f"unknown group kind {kind!r}: choose one of {', '.join(KINDS)}")
        return self.axes_of[kind]

    def expert_coords(self, rank):
        """{'tp', 'ep', 'edp', 'pp'} of a rank: its index in the expert grid, the dp·cp
        coordinate f split as f = e + ep·j (or f = j + edp·e when the order puts ep after dp)."""
        axes = self._axes("ep", rank)
        index = dict(zip(axes, np.unravel_index(rank, [self.sizes[a] for a in axes])))
        split = [a for a in self.expert_order if a in EXPERT]  # the faster of ep, edp first
        return {a: int(index[a]) for a in ["tp", *split, "pp"]}

    @property
    def order_name(self):
        """The order as given, with cp and ep shown where they sit when there are such groups."""
        return "-".join(self.named)

    def shown(self, kinds):
        """The ``kinds`` this grid shows (its groups' list: KINDS; a rank's coordinates: DENSE +
        EXPERT): ep and edp only when ep > 1, the kinds naming cp only when cp > 1."""
        return [kind for kind in kinds if (kind not in EXPERT or self.ep > 1) and
                ("cp" not in kind.split("-") or self.cp > 1)]

    def groups(self, kind):
        """Every group of one kind ('tp', 'dp', 'tp-cp', 'ep', ... as in KINDS), each a sorted
        list of ranks, in order of their lowest rank: the grid's slices along the kind's axes."""
        self._axes(kind)
        grid, axes = self.grids[kind]
        # the kind's axes go last, kept in the grid's order: each row ascends
        moved = [i for i, a in enumerate(axes) if a in kind.split("-")]
        rows = np.moveaxis(grid, moved, range(-len(moved), 0)).reshape(-1, self.sizes[kind])
        return rows[np.argsort(rows[:, 0], kind="stable")].tolist()

    def group_of(self, rank, kind):
        """The group of one kind that contains ``rank``: its slice through the rank's index."""
        self._axes(kind, rank)
        grid, axes = self.grids[kind]
        index = np.unravel_index(rank, grid.shape)
        index = [slice(None) if a in kind.split("-") else i for a, i in zip(axes, index)]
        return grid[tuple(index)].ravel().tolist()

    def check(self):
        """The groups are complete (each kind partitions the ranks) and orthogonal (groups of two
        different coordinates of one grid share at most one rank), and every expert and
        expert-data group lies inside one data-context group; raises AssertionError naming what
        is wrong. O(world): each rank gets the index of its group of each kind, and two ranks
        with the same pair of indices for two kinds would be two ranks those groups share."""
        dense = self.shown(DENSE)
        label = {}  # the dense grid (its coordinates, then tp-cp and dp-cp), then the expert grid
        for kinds, pairs in (([*dense, *(k for k in self.shown(KINDS) if "-" in k)],
                              itertools.combinations(dense, 2)), (EXPERT, EXPERT_PAIRS)):
            label.update((kind, self._labels(kind)) for kind in kinds)
            for a, b in pairs:
                seen = {}  # (index of r's group of kind a, of kind b) -> the first such rank
                for r, pair in enumerate(zip(label[a], label[b])):
                    first = seen.setdefault(pair, r)
                    assert first == r, (f"{KINDS[a]} group {self.groups(a)[label[a][r]]} and "
                                        f"{KINDS[b]} group {self.groups(b)[label[b][r]]} share "
                                        f"ranks {first} and {r}")
        block = "dp" if self.cp == 1 else "dp-cp"
        for kind in EXPERT:
            for g in self.groups(kind):
                assert len({label[block][r] for r in g}) == 1, \
                    f"{KINDS[kind]} group {g} spans more than one {KINDS[block]} group"
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


class ParallelGroups:
    """This rank's place in the grid and one communicator per group kind: ``tensor``,
    ``pipeline``, ``data``, ``context``, ``tensor_context``, ``data_context``, ``expert`` and
    ``expert_data``, each ordered by that coordinate (``pipeline.rank`` is this rank's stage,
    ``expert.rank`` its expert rank). ``coords`` holds every axis: tp, cp, dp, pp, ep and edp."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp", ep=1, cp=1):
        self.world = world
        self.grid = RankGrid(world.size, tp=tp, pp=pp, order=order, ep=ep, cp=cp)
        self.coords = {**self.grid.coords(world.rank), **self.grid.expert_coords(world.rank)}
        for kind in KINDS:  # every rank joins every split, in the table's order
            color = self.grid.group_of(world.rank, kind)[0]  # a group is named by its lowest rank
            # ordered by world rank: a group's ranks ascend with its coordinates (tp-cp: t + tp·c)
            setattr(self, KEYS[kind], world.split(color, key=world.rank))

    def describe(self):
        r, c, grid = self.world.rank, self.coords, self.grid
        parts = []  # the coordinates, then the groups: dense, and expert when ep > 1
        for coords, kinds in ((DENSE, set(KINDS) - set(EXPERT)), (EXPERT, EXPERT)):
            parts += [" ".join(f"{k} {c[k]}" for k in grid.shown(coords)),
                      " ".join(f"{KINDS[k]} {grid.group_of(r, k)}" for k in grid.shown(KINDS)
                               if k in kinds)]
        return f"rank {r}: " + "  ".join(part for part in parts if part)
