"""The rank grid: Megatron's documented groups, completeness, orthogonality, clear errors."""
import itertools
import json
import math

import numpy as np
import pytest

from minipar.cli import main
from minipar.parallel.groups import RankGrid
from minipar.testing import run_on_ranks


def test_megatron_documented_example():
    """16 GPUs, tensor size 2, pipeline size 4 (Megatron-LM's parallel_state docstring)."""
    grid = RankGrid(16, tp=2, pp=4)
    assert grid.dp == 2
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                 [14, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                 [13, 15]]
    assert grid.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}


def test_coords_name_every_axis_of_the_grid_at_size_one_too():
    """coords names tp, cp, dp and pp whatever their sizes (cp = 1 included), and a rank's
    ParallelGroups coords add ep and edp (ep = 1 included); minipar groups still shows only
    the axes that have groups."""
    for grid in (RankGrid(8, tp=2), RankGrid(8, tp=2, ep=2), RankGrid(8, cp=2, order="pp-tp-dp")):
        for r in range(8):
            assert set(grid.coords(r)) == {"tp", "cp", "dp", "pp"}
            assert grid.rank(**grid.coords(r)) == r
    assert RankGrid(8, tp=2).all_coords(3) == {"tp": 1, "dp": 1, "pp": 0}


def test_cli_json_reproduces_the_documented_groups(capsys):
    assert main(["groups", "--world", "16", "--tp", "2", "--pp", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensor"][:2] == [[0, 1], [2, 3]]
    assert out["pipeline"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert out["data"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_cli_text(capsys):
    main(["groups", "--world", "8", "--tp", "2", "--pp", "2"])
    text = capsys.readouterr().out
    assert "world 8 = tp 2 × dp 2 × pp 2" in text
    assert "tensor groups (4 of 2): [0,1] [2,3] [4,5] [6,7]" in text


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (8, 2, 2), (12, 3, 2), (16, 4, 2), (24, 2, 3)])
@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])
def test_grid_is_complete_orthogonal_and_invertible(world, tp, pp, order):
    grid = RankGrid(world, tp=tp, pp=pp, order=order)
    assert grid.check()
    seen = set()
    for r in range(world):
        c = grid.coords(r)
        assert grid.rank(**c) == r
        seen.add((c["tp"], c["dp"], c["pp"]))
    assert seen == set(itertools.product(range(grid.tp), range(grid.dp), range(grid.pp)))
    for r in range(world):  # a rank's groups intersect in exactly that rank
        groups = [set(grid.group_of(r, k)) for k in ("tp", "dp", "pp")]
        assert set.intersection(*groups) == {r}


def test_changed_order_changes_neighbours():
    grid = RankGrid(8, tp=2, pp=2, order="dp-tp-pp")
    assert grid.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_bad_input_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"world size 12 is not divisible by tp·pp = 5·1"):
        RankGrid(12, tp=5)
    with pytest.raises(ValueError, match="order 'tp-dp' must name tp, dp and pp"):
        RankGrid(4, order="tp-dp")
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        RankGrid(4, tp=0)
    with pytest.raises(ValueError, match="rank 9 is outside the world of 8"):
        RankGrid(8).coords(9)
    with pytest.raises(ValueError, match="unknown group kind 'xx'"):
        RankGrid(8).groups("xx")
    with pytest.raises(SystemExit, match="not divisible"):
        main(["groups", "--world", "10", "--tp", "4"])


def test_a_16384_rank_grid_is_fast():
    """groups, group_of, check and as_dict are O(world), not quadratic (issue 10: > 60 s)."""
    import time
    start = time.perf_counter()
    grid = RankGrid(16384, tp=2, pp=4)
    assert grid.check()
    assert len(grid.groups("tp")) == 8192 and len(grid.groups("dp")) == 8
    assert grid.group_of(16383, "pp") == [4095, 8191, 12287, 16383]
    assert grid.group_of(5, "dp") == list(range(1, 4096, 2))
    for r in range(0, 16384, 97):
        assert r in grid.group_of(r, "tp") and r in grid.group_of(r, "pp")
    as_dict = grid.as_dict()
    assert len(as_dict["coords"]) == 16384 and as_dict["pipeline"][0] == [0, 4096, 8192, 12288]
    assert len(grid.describe().splitlines()) < 40
    assert time.perf_counter() - start < 10  # about 0.2 s alone


def test_group_of_agrees_with_groups_for_every_rank():
    for order in ("tp-dp-pp", "pp-tp-dp", "dp-pp-tp"):
        grid = RankGrid(24, tp=2, pp=3, order=order)
        for kind in ("tp", "dp", "pp"):
            groups = grid.groups(kind)
            assert groups == sorted(groups)
            for r in range(24):
                assert grid.group_of(r, kind) == next(g for g in groups if r in g)


def test_check_names_overlapping_groups():
    class Broken(RankGrid):
        def groups(self, kind):
            return [[0, 1, 2, 3]] if kind == "dp" else [[0, 1], [2, 3]]

    with pytest.raises(AssertionError, match=r"data group \[0, 1, 2, 3\] has 4 ranks, not 2"):
        Broken(4, tp=2).check()

    class Overlapping(RankGrid):
        def groups(self, kind):
            return [[0], [1], [2], [3]] if kind == "pp" else [[0, 1], [2, 3]]

    with pytest.raises(AssertionError, match=r"tensor group \[0, 1\] and data group \[0, 1\] "
                                             r"share ranks 0 and 1"):
        Overlapping(4, tp=2).check()


def test_describe_summarises_a_large_grid():
    text = RankGrid(16384, tp=2, pp=4).describe()
    assert "world 16384 = tp 2 × dp 2048 × pp 4" in text
    assert "  ... (16368 more ranks) ...\n16376    0 2044    3" in text
    assert ("tensor groups (8192 of 2): [0,1] [2,3] [4,5] [6,7] ... (8184 more groups) ... "
            "[16376,16377] [16378,16379] [16380,16381] [16382,16383]") in text
    assert "data groups (8 of 2048): [0,2,4,...,4094] [1,3,5,...,4095] " in text
    assert len(RankGrid(128, tp=2).describe(full=True).splitlines()) == 128 + 9
    assert "more" not in RankGrid(64, tp=4, pp=2).describe()


# --- the expert dimension (4D: tp × ep × edp × pp, Megatron-core's expert grid) ---------------

def megatron_expert_groups(world, tp, pp, ep, kind):
    """Megatron-core's expert RankGenerator written out: order tp-ep-dp-pp over sizes
    (tp, ep, edp, pp), rank = t + tp·(e + ep·(j + edp·s)); a group varies one coordinate."""
    edp = world // (tp * ep * pp)
    sizes = {"tp": tp, "ep": ep, "edp": edp, "pp": pp}
    groups = {}
    for t, e, j, s in itertools.product(range(tp), range(ep), range(edp), range(pp)):
        c = {"tp": t, "ep": e, "edp": j, "pp": s}
        key = tuple(v for k, v in c.items() if k != kind)
        groups.setdefault(key, []).append(t + tp * (e + ep * (j + edp * s)))
    assert all(len(g) == sizes[kind] for g in groups.values())
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 2, 1, 2), (8, 1, 2, 2), (8, 1, 1, 4), (16, 2, 2, 2),
                                            (24, 2, 3, 2), (32, 2, 2, 4), (8, 2, 2, 1)])
def test_expert_groups_are_megatrons(world, tp, pp, ep):
    """Both orders Megatron documents for the expert grid give its groups; ep splits dp."""
    for order in ("tp-dp-pp", "tp-ep-dp-pp"):
        grid = RankGrid(world, tp=tp, pp=pp, ep=ep, order=order)
        assert grid.check() and (grid.ep, grid.edp) == (ep, grid.dp // ep)
        for kind in ("ep", "edp"):
            assert grid.groups(kind) == megatron_expert_groups(world, tp, pp, ep, kind)
        for kind in ("tp", "pp"):  # the dense and the expert grid share these (Megatron asserts pp)
            assert grid.groups(kind) == megatron_expert_groups(world, tp, pp, ep, kind)


def test_documented_eight_rank_expert_example(capsys):
    grid = RankGrid(8, tp=2, ep=2)
    assert grid.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.expert_coords(6) == {"tp": 0, "ep": 1, "edp": 1, "pp": 0}
    assert grid.order_name == "tp-ep-dp-pp"
    after = RankGrid(8, tp=2, ep=2, order="tp-dp-ep-pp")  # ep after dp: d = j + edp·e
    assert after.groups("ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert after.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert main(["groups", "--world", "8", "--tp", "2", "--ep", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 8 = tp 2 × dp 4 × pp 1, dp 4 = ep 2 × edp 2  (order tp-ep-dp-pp" in text
    assert " rank   tp   dp   pp   ep  edp\n    0    0    0    0    0    0" in text
    assert "expert groups (4 of 2): [0,2] [1,3] [4,6] [5,7]" in text
    assert "expert-data groups (4 of 2): [0,4] [1,5] [2,6] [3,7]" in text


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 1, 1, 2), (16, 2, 2, 2), (48, 2, 3, 4),
                                            (24, 3, 1, 8)])
@pytest.mark.parametrize("order", ["tp-ep-dp-pp", "tp-dp-ep-pp", "pp-ep-dp-tp", "dp-ep-tp-pp",
                                   "tp-pp-dp"])
def test_expert_and_expert_data_groups_tile_each_data_group(world, tp, pp, ep, order):
    grid = RankGrid(world, tp=tp, pp=pp, ep=ep, order=order)
    assert grid.check()
    for r in range(world):
        data, expert, edp = (set(grid.group_of(r, k)) for k in ("dp", "ep", "edp"))
        assert expert & edp == {r} and expert <= data and edp <= data
        assert set().union(*(grid.group_of(x, "ep") for x in edp)) == data  # ep × edp = dp
        assert grid.group_of(r, "ep") in grid.groups("ep")
        assert grid.group_of(r, "edp") in grid.groups("edp")
        assert set(grid.group_of(r, "tp")) & expert == {r} == set(grid.group_of(r, "pp")) & edp


def test_expert_bad_input_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"dp = 12/\(tp·pp\) = 6 is not divisible by ep = 4"):
        RankGrid(12, tp=2, ep=4)
    with pytest.raises(ValueError, match="ep must be a positive integer, got 0"):
        RankGrid(8, ep=0)
    with pytest.raises(ValueError, match=r"may name ep once, beside dp"):
        RankGrid(8, ep=2, order="ep-tp-dp-pp")
    with pytest.raises(ValueError, match=r"may name ep once, beside dp"):
        RankGrid(8, ep=2, order="tp-ep-dp-ep-pp")
    with pytest.raises(SystemExit, match="2"):
        main(["groups", "--world", "12", "--tp", "2", "--ep", "4"])
    assert "argument --ep: the data-parallel size dp = 12/(tp·pp) = 6 is not divisible by ep = 4" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["groups", "--world", "8", "--ep", "2", "--order", "ep-tp-dp-pp"])
    assert "argument --order: invalid choice" in capsys.readouterr().err


def test_cli_json_and_one_rank_with_experts(capsys):
    assert main(["groups", "--world", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ep"], out["edp"], out["order"]) == (2, 2, "tp-ep-dp-pp")
    assert out["expert"][:2] == [[0, 2], [1, 3]] and out["expert_data"][:2] == [[0, 4], [1, 5]]
    assert out["coords"][5] == {"tp": 1, "dp": 2, "pp": 0, "ep": 0, "edp": 1}
    assert main(["groups", "--world", "16", "--tp", "2", "--pp", "2", "--ep", "2",
                 "--rank", "5"]) == 0
    text = capsys.readouterr().out
    assert "rank 5: tp 1 dp 2 pp 0 ep 0 edp 1" in text
    assert "expert group (2 ranks): [5,7]\nexpert-data group (2 ranks): [1,5]" in text
    assert main(["groups", "--world", "16", "--tp", "2", "--pp", "2", "--ep", "2",
                 "--rank", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["expert"] == [5, 7] and out["expert_data"] == [1, 5] and out["data"] == [1, 3, 5, 7]


def test_check_names_an_expert_group_outside_its_data_group():
    class Straddling(RankGrid):
        def groups(self, kind):  # complete and orthogonal, but [0, 5] mixes two data groups
            return [[0, 5], [1, 4], [2, 7], [3, 6]] if kind == "ep" else super().groups(kind)

    with pytest.raises(AssertionError, match=r"expert group \[0, 5\] spans more than one data "
                                             r"group"):
        Straddling(8, pp=2, ep=2).check()


# --- the context dimension (5D: tp × cp × dp × pp, Megatron-core's tp-cp-ep-dp-pp) ------------

def megatron_groups(world, order, sizes, tokens):
    """Megatron-core's documented rule, written out: the ranks enumerated with the coordinates of
    ``order`` (fastest first, every name of tp cp ep dp pp once) as the digits of a mixed radix
    over ``sizes``; a group of a token ("cp", "tp-cp", ...) holds the ranks that agree on every
    coordinate outside it. The dense grid takes ep = 1, the expert grid cp = 1 and dp = edp.
    Returns {token: its groups, sorted}."""
    names = order.split("-")
    assert math.prod(sizes[n] for n in names) == world
    groups = {token: {} for token in tokens}
    for digits in itertools.product(*(range(sizes[n]) for n in reversed(names))):
        c = dict(zip(reversed(names), digits))
        rank, stride = 0, 1
        for n in names:
            rank, stride = rank + c[n] * stride, stride * sizes[n]
        for token in tokens:
            key = tuple(c[n] for n in names if n not in token.split("-"))
            groups[token].setdefault(key, []).append(rank)
    return {token: sorted(sorted(g) for g in groups[token].values()) for token in tokens}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


# minipar's order -> Megatron's, each name placed (cp and ep unnamed: cp, then ep, before dp)
ORDERS_5D = {"tp-dp-pp": "tp-cp-ep-dp-pp", "tp-cp-ep-dp-pp": "tp-cp-ep-dp-pp",
             "tp-cp-dp-ep-pp": "tp-cp-dp-ep-pp", "tp-dp-cp-pp": "tp-ep-dp-cp-pp",
             "pp-dp-cp-tp": "pp-ep-dp-cp-tp", "tp-pp-cp-dp": "tp-pp-cp-ep-dp"}
DENSE_TOKENS = ("tp", "cp", "dp", "pp", "tp-cp", "dp-cp")


def sweep(world):
    """(tp, cp, pp, ep) with tp·cp·pp | W and ep | dp·cp: every divisor of W up to 4 for tp,
    cp and pp, ep in 1, 2, 3 and 4."""
    small = [d for d in divisors(world) if d <= 4]
    for tp, cp, pp in itertools.product(small, repeat=3):
        if world % (tp * cp * pp) == 0:
            block = world // (tp * pp)  # dp·cp
            yield from ((tp, cp, pp, ep) for ep in (1, 2, 3, 4) if block % ep == 0)


@pytest.mark.parametrize("world", [1, 2, 6, 8, 12, 16, 24, 36, 64, 96, 512])
def test_context_grid_is_megatron_cores(world):
    """Every group kind, dense and expert, equals the groups Megatron-core's rule builds, for
    each (tp, cp, pp, ep) of the sweep and each order; each pair of coordinates' groups meet in
    one rank (orthogonal), each kind partitions the ranks (coverage)."""
    grids = 0
    for (tp, cp, pp, ep), order in itertools.product(sweep(world), ORDERS_5D):
        if world > 64 and order != "tp-dp-pp":
            continue  # the large grids in Megatron's default order only (time)
        grid = RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep, order=order)
        dp = world // (tp * cp * pp)
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
        megatron = ORDERS_5D[order]
        want = megatron_groups(world, megatron, dense, DENSE_TOKENS)
        for kind in DENSE_TOKENS:
            assert grid.groups(kind) == want[kind], (world, tp, cp, pp, ep, order, kind)
        want = megatron_groups(world, megatron, expert, ("ep", "dp", "tp", "pp"))
        for kind, token in (("ep", "ep"), ("edp", "dp"), ("tp", "tp"), ("pp", "pp")):
            assert grid.groups(kind) == want[token], (world, tp, cp, pp, ep, order, kind)
        label = {}  # kind -> the index of each rank's group
        for kind in (*DENSE_TOKENS, "ep", "edp"):
            label[kind] = np.full(world, -1)
            for i, g in enumerate(grid.groups(kind)):
                assert (label[kind][g] == -1).all()
                label[kind][g] = i
            assert (label[kind] >= 0).all(), (kind, "does not cover every rank")
        for a, b in [*itertools.combinations(("tp", "cp", "dp", "pp"), 2), ("ep", "edp"),
                     ("tp", "ep"), ("ep", "pp"), ("tp", "edp"), ("edp", "pp")]:
            pairs = label[a] * world + label[b]  # two ranks with one pair: groups share two
            assert len(set(pairs.tolist())) == world, (world, tp, cp, pp, ep, order, a, b)
        assert grid.check()
        grids += 1
    assert grids >= (1 if world == 1 else 6)


@pytest.mark.parametrize("world,tp,cp,pp,ep", [(8, 2, 2, 1, 1), (16, 2, 2, 2, 2), (24, 1, 3, 2, 2),
                                               (32, 2, 4, 1, 8)])
def test_context_coords_rank_and_combined_groups(world, tp, cp, pp, ep):
    """coords and rank are inverse with cp; tp-cp = tp × cp, dp-cp = dp × cp, and the expert
    groups tile each data-context group (ep × edp = dp·cp)."""
    grid = RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep)
    for r in range(world):
        c = grid.coords(r)
        assert list(c) == ["tp", "cp", "dp", "pp"] and grid.rank(**c) == r
        tensor, context = set(grid.group_of(r, "tp")), set(grid.group_of(r, "cp"))
        data, data_context = set(grid.group_of(r, "dp")), set(grid.group_of(r, "dp-cp"))
        assert set(grid.group_of(r, "tp-cp")) == {x for y in context for x in grid.group_of(y, "tp")}
        assert data_context == {x for y in context for x in grid.group_of(y, "dp")}
        assert tensor & context == {r} == data & context
        expert, edp = set(grid.group_of(r, "ep")), set(grid.group_of(r, "edp"))
        assert expert <= data_context and edp <= data_context and expert & edp == {r}
        assert set().union(*(grid.group_of(x, "ep") for x in edp)) == data_context
    with pytest.raises(ValueError, match=r"coordinates .* are outside the grid"):
        grid.rank(cp=cp)


def test_documented_context_example(capsys):
    """8 ranks, tp = 2, cp = 2 (dp = 2), Megatron-core's order tp-cp-ep-dp-pp."""
    grid = RankGrid(8, tp=2, cp=2)
    assert (grid.cp, grid.dp, grid.order_name) == (2, 2, "tp-cp-dp-pp")
    assert grid.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert main(["groups", "--world", "8", "--tp", "2", "--cp", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 8 = tp 2 × cp 2 × dp 2 × pp 1  (order tp-cp-dp-pp, fastest first)" in text
    assert " rank   tp   cp   dp   pp\n    0    0    0    0    0\n    1    1    0    0    0" in text
    assert "context groups (4 of 2): [0,2] [1,3] [4,6] [5,7]" in text
    assert "tensor-context groups (2 of 4): [0,1,2,3] [4,5,6,7]" in text
    assert "data-context groups (2 of 4): [0,2,4,6] [1,3,5,7]" in text
    assert main(["groups", "--world", "16", "--tp", "2", "--cp", "2", "--ep", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 16 = tp 2 × cp 2 × dp 4 × pp 1, dp·cp 8 = ep 2 × edp 4  (order " \
           "tp-cp-ep-dp-pp" in text
    assert "expert groups (8 of 2): [0,2] [1,3] [4,6]" in text  # with ep = cp: the cp groups


def test_cli_json_and_one_rank_with_context(capsys):
    assert main(["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["cp"], out["dp"], out["order"]) == (2, 2, "tp-cp-dp-pp")
    assert out["context"][:2] == [[0, 2], [1, 3]]
    assert out["tensor_context"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["data_context"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert out["coords"][6] == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}
    assert main(["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--rank", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"] == [4, 6] and out["data_context"] == [0, 2, 4, 6]
    assert main(["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2",
                 "--rank", "6"]) == 0
    text = capsys.readouterr().out
    assert "rank 6: tp 0 cp 1 dp 1 pp 0" in text
    assert "context group (2 ranks): [4,6]\ntensor-context group (4 ranks): [4,5,6,7]" in text


def test_cp_one_leaves_the_output_as_it_was(capsys):
    """cp = 1 (given or not) shows no context column, size or groups."""
    for argv in (["groups", "--world", "8", "--tp", "2", "--ep", "2", "--json"],
                 ["groups", "--world", "8", "--tp", "2", "--ep", "2", "--cp", "1", "--json"]):
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert list(out) == ["world", "tp", "dp", "pp", "order", "tensor", "pipeline", "data",
                             "ep", "edp", "expert", "expert_data", "coords"]
    assert "context" not in RankGrid(8, tp=2, cp=1, order="tp-cp-dp-pp").describe()
    assert RankGrid(8, tp=2, order="tp-cp-dp-pp").all_coords(3) == {"tp": 1, "dp": 1, "pp": 0}


def test_context_bad_input_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"world size 12 is not divisible by tp·cp·pp = 2·4·1 = "
                                         r"8: the ranks cannot form a tp × cp × dp × pp grid"):
        RankGrid(12, tp=2, cp=4)
    with pytest.raises(ValueError, match=r"dp·cp = 12/\(tp·pp\) = 6 is not divisible by ep = 4"):
        RankGrid(12, tp=2, cp=3, ep=4)
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        RankGrid(8, cp=0)
    with pytest.raises(ValueError, match=r"and cp once, beside dp or that ep"):
        RankGrid(8, cp=2, order="cp-tp-dp-pp")
    with pytest.raises(SystemExit, match="2"):
        main(["groups", "--world", "12", "--tp", "2", "--cp", "4"])
    assert "argument --world: world size 12 is not divisible by tp·cp·pp = 2·4·1 = 8" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["groups", "--world", "12", "--tp", "2", "--cp", "3", "--ep", "4"])
    assert "argument --ep: the data-parallel size dp·cp = 12/(tp·pp) = 6 is not divisible by " \
           "ep = 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["groups", "--world", "8", "--cp", "0"])
    assert "argument --cp" in capsys.readouterr().err


def context_communicators_body():
    """On each rank: the members and the rank of every communicator of ParallelGroups with
    tp = 2, cp = 2 (dp = 2), against the grid's groups; the mismatches."""
    from minipar import comm
    from minipar.parallel.groups import KEYS, ParallelGroups

    world = comm.world()
    groups = ParallelGroups(world, tp=2, cp=2)
    wrong = []
    for kind, key in KEYS.items():
        members = getattr(groups, key).all_gather_object(world.rank)
        expected = groups.grid.group_of(world.rank, kind)
        if members != expected or getattr(groups, key).rank != expected.index(world.rank):
            wrong.append(f"{kind}: {members}, rank {getattr(groups, key).rank}")
    return {"wrong": wrong, "coords": groups.coords, "described": groups.describe(),
            "context": groups.context.all_gather_object(world.rank),
            "data_context": groups.data_context.all_gather_object(world.rank)}


@pytest.mark.mpi
def test_eight_ranks_context_communicators():
    results = run_on_ranks(context_communicators_body, 8, timeout=120)
    for rank, r in enumerate(results):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["context"] == [[0, 2], [1, 3], [4, 6], [5, 7]][rank // 4 * 2 + rank % 2]
        assert r["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7]][rank % 2]
        assert r["coords"]["cp"] == rank // 2 % 2 and r["coords"]["dp"] == rank // 4
        assert f"rank {rank}: tp {rank % 2} cp {rank // 2 % 2} dp {rank // 4} pp 0" in r["described"]
        assert "context " in r["described"] and "expert" not in r["described"]


def test_a_billion_rank_grid_counts_without_building_the_array():
    """Sizes, coordinates, ranks and strides are arithmetic: only a group asked for builds the
    grid (np.arange(10^9) would be 7.45 GiB)."""
    import tracemalloc
    tracemalloc.start()
    grid = RankGrid(10 ** 9, tp=8, cp=2, pp=8, ep=4)
    r = 10 ** 9 - 1
    assert grid.coords(r) == {"tp": 7, "cp": 1, "dp": grid.dp - 1, "pp": 7}
    assert grid.rank(**grid.coords(r)) == r and grid.expert_coords(r)["ep"] == 3
    assert grid.stride("dp", "pp") == 8 * 2 * grid.dp
    assert tracemalloc.get_traced_memory()[1] < 2 ** 20
    tracemalloc.stop()


# --- all five axes at once: dp × cp × tp × pp × ep (issue 38 item 3) --------------------------

FIVE = ["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "2"]


class RecordingWorld:
    """A stand-in world communicator for ParallelGroups on one process: it records the color of
    each split, so the members of a rank's communicator are the ranks that gave the same color."""

    def __init__(self, rank, size):
        self.rank, self.size, self.colors = rank, size, []

    def split(self, color, key=None):
        self.colors.append(color)
        return None


def parse_groups_text(text):
    """(title, {rank: {axis: coordinate}}, {group name: [[ranks], ...]}) from the text of
    ``minipar groups``."""
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.startswith(" rank")))
    columns = lines[header].split()[1:]
    coords, groups = {}, {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        rank, *values = map(int, line.split())
        coords[rank] = dict(zip(columns, values))
    for line in lines:
        if " groups (" in line:
            name, rest = line.split(" groups (")
            count, size = map(int, rest.split("):")[0].split(" of "))
            groups[name] = json.loads("[" + rest.split("): ")[1].replace("] [", "],[") + "]")
            assert len(groups[name]) == count and {len(g) for g in groups[name]} == {size}
    return lines[0], coords, groups


def test_five_axis_text_equals_the_grid_and_parallel_groups(capsys):
    """16 ranks, tp = cp = pp = ep = 2 (dp = 2): the coordinates on all five axes and every
    group the text prints equal what RankGrid and each rank's ParallelGroups compute."""
    from minipar.parallel.groups import KEYS, KINDS, ParallelGroups

    assert main(FIVE) == 0
    title, coords, groups = parse_groups_text(capsys.readouterr().out)
    grid = RankGrid(16, tp=2, cp=2, pp=2, ep=2)
    assert title == grid.title() and grid.check()
    assert "tp 2 × cp 2 × dp 2 × pp 2, dp·cp 4 = ep 2 × edp 2" in title
    assert "(order tp-cp-ep-dp-pp, fastest first)" in title  # Megatron-core's order
    assert sorted(coords) == list(range(16))
    assert set(groups) == set(KINDS.values())  # tp, cp, dp, pp, ep, edp, tp×cp and dp×cp
    for kind, name in KINDS.items():
        assert groups[name] == grid.groups(kind), kind
    members = {}  # rank -> the color of each of its ParallelGroups splits, in KINDS order
    for r in range(16):
        ranks = ParallelGroups(RecordingWorld(r, 16), tp=2, cp=2, pp=2, ep=2)
        assert coords[r] == ranks.coords == {**grid.coords(r), **grid.expert_coords(r)}
        assert set(ranks.coords) == {"tp", "cp", "dp", "pp", "ep", "edp"}
        members[r] = ranks.world.colors
    for i, (kind, key) in enumerate(KEYS.items()):  # the communicators hold the printed groups
        for r in range(16):
            printed = next(g for g in groups[KINDS[kind]] if r in g)
            assert printed == [x for x in range(16) if members[x][i] == members[r][i]], (kind, r)


def test_five_axis_grid_is_megatrons_order():
    """Spot checks derived from Megatron-core's tp-cp-ep-dp-pp: the dense grid numbers rank
    = t + tp·(c + cp·(d + dp·p)); the expert grid (cp folded into dp, dp·cp = ep × edp) numbers
    it t + tp·(e + ep·(j + edp·p)), the data-context group the one place both grids differ."""
    grid = RankGrid(16, tp=2, cp=2, pp=2, ep=2)
    for r in range(16):
        t, c, d, p = r % 2, r // 2 % 2, r // 4 % 2, r // 8
        e, j = (c + 2 * d) % 2, (c + 2 * d) // 2
        assert grid.all_coords(r) == {"tp": t, "cp": c, "dp": d, "pp": p, "ep": e, "edp": j}
    assert grid.all_coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "ep": 0, "edp": 1}
    assert grid.group_of(0, "dp-cp") == [0, 2, 4, 6]  # where the trainer averages gradients
    assert grid.group_of(0, "ep") == [0, 2] and grid.group_of(0, "edp") == [0, 4]


def test_five_axis_json_and_every_rank_alone(capsys):
    """--json gives the same groups and coordinates; --rank r (text and JSON) gives r's row and
    its group of each kind."""
    from minipar.parallel.groups import KEYS, KINDS

    grid = RankGrid(16, tp=2, cp=2, pp=2, ep=2)
    assert main([*FIVE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in ("tp", "cp", "dp", "pp", "ep", "edp", "order")} == \
        {"tp": 2, "cp": 2, "dp": 2, "pp": 2, "ep": 2, "edp": 2, "order": "tp-cp-ep-dp-pp"}
    assert out["coords"] == [grid.all_coords(r) for r in range(16)]
    assert all(out[KEYS[kind]] == grid.groups(kind) for kind in KINDS)
    for r in range(16):
        assert main([*FIVE, "--rank", str(r), "--json"]) == 0
        one = json.loads(capsys.readouterr().out)
        assert one["coords"] == grid.all_coords(r)
        assert all(one[KEYS[kind]] == grid.group_of(r, kind) for kind in KINDS)
        assert main([*FIVE, "--rank", str(r)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == f"rank {r}: " + " ".join(f"{k} {v}" for k, v in one["coords"].items())
        assert lines[2:] == [f"{KINDS[kind]} group ({len(g)} ranks): " + str(g).replace(" ", "")
                             for kind in KINDS for g in [grid.group_of(r, kind)]]


def test_five_axis_ep_is_cut_from_dp_times_cp(capsys):
    """As in Megatron-core, ep need divide only dp·cp: ep = 4 over dp = cp = 2 makes each expert
    group a whole data-context group, one expert-data rank each."""
    assert main(["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dp"], out["ep"], out["edp"]) == (2, 4, 1)
    assert out["expert"] == out["data_context"] == RankGrid(16, tp=2, cp=2, pp=2, ep=4).groups("ep")


@pytest.mark.parametrize("argv,flag,message", [
    (["--world", "12", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "2"], "--world",
     "world size 12 is not divisible by tp·cp·pp = 2·2·2 = 8"),
    (["--world", "16", "--tp", "2", "--cp", "2", "--pp", "3", "--ep", "2"], "--world",
     "world size 16 is not divisible by tp·cp·pp = 2·2·3 = 12"),
    (["--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "3"], "--ep",
     "the data-parallel size dp·cp = 16/(tp·pp) = 4 is not divisible by ep = 3"),
    (["--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "8"], "--ep",
     "the data-parallel size dp·cp = 16/(tp·pp) = 4 is not divisible by ep = 8"),
])
def test_five_axis_refusals_name_the_flag(capsys, argv, flag, message):
    """Sizes that do not tile the world name --world; an ep that does not divide dp·cp, --ep."""
    with pytest.raises(SystemExit):
        main(["groups", *argv])
    assert f"minipar groups: error: argument {flag}: {message}" in capsys.readouterr().err
