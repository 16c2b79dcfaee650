"""The rank grid: Megatron's documented groups, completeness, orthogonality, clear errors."""
import itertools
import json

import pytest

from minipar.cli import main
from minipar.parallel.groups import RankGrid


def test_megatron_documented_example():
    """16 GPUs, tensor size 2, pipeline size 4 (Megatron-LM's parallel_state docstring)."""
    grid = RankGrid(16, tp=2, pp=4)
    assert grid.dp == 2
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                 [14, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                 [13, 15]]
    assert grid.coords(5) == {"tp": 1, "dp": 0, "pp": 1}


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
