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
