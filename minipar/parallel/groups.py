"""The rank grid of 3D (and 4D) parallelism: which ranks share a tensor, a pipeline, a data or an
expert group, and the communicators built from it (``ParallelGroups``: one per group kind, for
this rank).

W ranks are arranged as a grid of tp × dp × pp = W. Megatron-LM's default order makes the tensor
coordinate vary fastest, then data, then pipeline (its order string "tp-dp-pp"), so

    rank = tp_rank + tp · (dp_rank + dp · pp_rank)

which keeps each tensor group, the chattiest (two all-reduces per layer, forward and backward), on
neighbouring ranks, i.e. inside one node. A group of one kind is the set of ranks that differ
only in that coordinate. For W = 16, tp = 2, pp = 4 (so dp = 2), as in Megatron's documentation:

    tensor   [0, 1] [2, 3] [4, 5] ... [14, 15]
    pipeline [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    data     [0, 2] [1, 3] [4, 6] [5, 7] ... [13, 15]

The expert dimension (mixture of experts). Megatron-core builds a second grid for the expert
layers over the same ranks, tp × ep × edp × pp in the order "tp-ep-dp-pp" (its default
"tp-cp-ep-dp-pp" with cp = 1), where dp there means edp = W / (tp·ep·pp): the expert-data
size. With the experts' tensor size equal to tp (Megatron's ETP = TP), both grids share the
tensor and pipeline groups, so the expert grid cuts each data group in two directions:

    d = e + ep · j      (dp coordinate d, expert rank e, expert-data rank j; ep divides dp)

    expert       (ep)   the ranks of a data group holding different experts: the tokens of each
                        move to the rank holding their expert (all-to-all) and back
    expert-data  (edp)  the ranks holding the same experts: expert gradients are reduced here,
                        the rest over the whole data group

For W = 8, tp = 2, pp = 1, ep = 2 (so dp = 4, edp = 2), order tp-ep-dp-pp:

    data         [0, 2, 4, 6] [1, 3, 5, 7]
    expert       [0, 2] [1, 3] [4, 6] [5, 7]
    expert-data  [0, 4] [1, 5] [2, 6] [3, 7]

An order that does not name ep puts it just before dp (Megatron's default); naming it places it
beside dp on either side ("tp-dp-ep-pp": d = j + edp · e). Anywhere else the expert grid's
pipeline groups would differ from the dense grid's, which Megatron refuses too.
"""
import itertools

KINDS = ("tp", "dp", "pp")
EXPERT_KINDS = ("ep", "edp")  # the expert grid's own kinds; it shares tp and pp
NAMES = {"tp": "tensor", "dp": "data", "pp": "pipeline", "ep": "expert", "edp": "expert-data"}


def orders():
    """Every order string RankGrid takes: the dense axes in any order, with or without ep
    beside dp."""
    out = []
    for axes in itertools.permutations(KINDS):
        out.append("-".join(axes))
        d = axes.index("dp")
        out += ["-".join(axes[:d + k] + ("ep",) + axes[d + k:]) for k in (0, 1)]
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
        self.order = tuple(a for a in axes if a != "ep")
        self.ep_first = "ep" not in axes or axes.index("ep") < axes.index("dp")
        self.sizes = {"tp": tp, "dp": dp, "pp": pp, "ep": ep, "edp": dp // ep}
        self.tp, self.dp, self.pp = self.sizes["tp"], self.sizes["dp"], self.sizes["pp"]
        self.ep, self.edp = ep, dp // ep
        d = self.order.index("dp")
        inner = ("ep", "edp") if self.ep_first else ("edp", "ep")
        self.expert_order = self.order[:d] + inner + self.order[d + 1:]

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

    def expert_coords(self, rank):
        """{'tp', 'ep', 'edp', 'pp'} of a rank: its place in the expert grid, the dp coordinate d
        split as d = e + ep·j (or d = j + edp·e when the order puts ep after dp)."""
        c = self.coords(rank)
        fast, slow = ("ep", "edp") if self.ep_first else ("edp", "ep")
        slow_rank, fast_rank = divmod(c["dp"], self.sizes[fast])
        return {"tp": c["tp"], fast: fast_rank, slow: slow_rank, "pp": c["pp"]}

    @property
    def order_name(self):
        """The order as given, with ep shown beside dp when there are expert groups."""
        if self.ep == 1:
            return "-".join(self.order)
        return "-".join("dp" if a == "edp" else a for a in self.expert_order)

    def stride(self, kind):
        """How far apart two ranks are whose ``kind`` coordinates differ by one: the product of
        the sizes of the axes that vary faster (before ``kind`` in ``order``, or in
        ``expert_order`` for the expert kinds)."""
        if kind not in KINDS + EXPERT_KINDS:
            raise ValueError(f"unknown group kind {kind!r}: choose one of "
                             f"{', '.join(KINDS + EXPERT_KINDS)}")
        axes = self.order if kind in KINDS else self.expert_order
        stride = 1
        for axis in axes[:axes.index(kind)]:
            stride *= self.sizes[axis]
        return stride

    def groups(self, kind):
        """Every group of one kind ('tp', 'dp', 'pp', 'ep' or 'edp'), each a sorted list of
        ranks, in order of their lowest rank. A group is its lowest rank b (``kind`` coordinate
        0) plus multiples of the stride: [b, b + s, ..., b + (size - 1)·s]; one pass over the
        ranks, O(world)."""
        stride, size = self.stride(kind), self.sizes[kind]
        return [list(range(b, b + size * stride, stride))
                for b in range(self.world) if (b // stride) % size == 0]

    def group_of(self, rank, kind):
        """The group of one kind that contains ``rank``: computed from its coordinate, O(size)."""
        stride, size = self.stride(kind), self.sizes[kind]
        coord = (self.coords if kind in KINDS else self.expert_coords)(rank)[kind]
        base = rank - coord * stride
        return list(range(base, base + size * stride, stride))

    def check(self):
        """The groups are complete (each kind partitions the ranks) and orthogonal (groups of two
        different kinds of one grid share at most one rank), and every expert and expert-data
        group lies inside one data group; raises AssertionError naming what is wrong.
        O(world): each rank gets the index of its group of each kind, and two ranks with the same
        pair of indices for two kinds would be two ranks those groups share."""
        label = {}
        expert_pairs = [p for p in itertools.combinations(("tp", "ep", "edp", "pp"), 2)
                        if p != ("tp", "pp")]  # tp and pp: checked with the dense grid
        for kinds, pairs in ((KINDS, itertools.combinations(KINDS, 2)),
                             (EXPERT_KINDS, expert_pairs)):
            for kind in kinds:
                label[kind] = self._labels(kind)
            for a, b in pairs:
                seen = {}
                for r in range(self.world):
                    first = seen.setdefault((label[a][r], label[b][r]), r)
                    assert first == r, (f"{NAMES[a]} group {self.groups(a)[label[a][r]]} and "
                                        f"{NAMES[b]} group {self.groups(b)[label[b][r]]} share "
                                        f"ranks {first} and {r}")
        for kind in EXPERT_KINDS:
            for g in self.groups(kind):
                assert len({label["dp"][r] for r in g}) == 1, \
                    f"{NAMES[kind]} group {g} spans more than one data group"
        return True

    def _labels(self, kind):
        """[index of the ``kind`` group holding rank r for each r], checking the groups have the
        right size and cover every rank once."""
        label = [None] * self.world
        for i, g in enumerate(self.groups(kind)):
            assert len(g) == self.sizes[kind], \
                f"{NAMES[kind]} group {g} has {len(g)} ranks, not {self.sizes[kind]}"
            for r in g:
                assert 0 <= r < self.world and label[r] is None, \
                    f"{NAMES[kind]} groups do not cover every rank once (rank {r})"
                label[r] = i
        assert None not in label, f"{NAMES[kind]} groups do not cover every rank once"
        return label

    def as_dict(self):
        """{'tensor': [[...]], 'pipeline': [[...]], 'data': [[...]]} plus sizes and each rank's
        coordinates; with ep > 1 also ep, edp, 'expert' and 'expert_data' groups, and each
        rank's ep and edp coordinates."""
        out = {"world": self.world, "tp": self.tp, "dp": self.dp, "pp": self.pp,
               "order": self.order_name, "tensor": self.groups("tp"),
               "pipeline": self.groups("pp"), "data": self.groups("dp")}
        if self.ep > 1:
            out.update(ep=self.ep, edp=self.edp, expert=self.groups("ep"),
                       expert_data=self.groups("edp"))
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
        kinds = ("tp", "pp", "dp") + (EXPERT_KINDS if self.ep > 1 else ())
        columns = kinds[:1] + ("dp", "pp") + kinds[3:]
        lines = [self.title(), "", " rank" + "".join(f"{k:>5}" for k in columns)]
        short = not full and self.world > SHOW_ALL
        for r in _ends(range(self.world), 8 if short else self.world, "ranks"):
            if isinstance(r, str):
                lines.append(f"  {r}")
                continue
            c = self.all_coords(r)
            lines.append(f"{r:5d}" + "".join(f"{c[k]:5d}" for k in columns))
        for kind in kinds:
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
    """This rank's place in the grid and one communicator per group kind: ``tensor``,
    ``pipeline``, ``data``, ``expert`` and ``expert_data``, each ordered by that coordinate
    (``pipeline.rank`` is this rank's stage, ``expert.rank`` its expert rank). ``coords`` holds
    tp, dp, pp, ep and edp."""

    def __init__(self, world, tp=1, pp=1, order="tp-dp-pp", ep=1):
        self.world = world
        self.grid = RankGrid(world.size, tp=tp, pp=pp, order=order, ep=ep)
        self.coords = {**self.grid.coords(world.rank), **self.grid.expert_coords(world.rank)}
        comms = {}
        for kind in ("tp", "pp", "dp", "ep", "edp"):  # every rank joins every split, in order
            color = self.grid.group_of(world.rank, kind)[0]  # a group is named by its lowest rank
            comms[kind] = world.split(color, key=self.coords[kind])
        self.tensor, self.pipeline, self.data = comms["tp"], comms["pp"], comms["dp"]
        self.expert, self.expert_data = comms["ep"], comms["edp"]

    def describe(self):
        c, r = self.coords, self.world.rank
        text = (f"rank {r}: tp {c['tp']} dp {c['dp']} pp {c['pp']}  "
                f"tensor {self.grid.group_of(r, 'tp')} pipeline {self.grid.group_of(r, 'pp')} "
                f"data {self.grid.group_of(r, 'dp')}")
        if self.grid.ep > 1:
            text += (f"  ep {c['ep']} edp {c['edp']}  expert {self.grid.group_of(r, 'ep')} "
                     f"expert-data {self.grid.group_of(r, 'edp')}")
        return text
