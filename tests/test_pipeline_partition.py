"""The partitioner: explicit split points, and the balanced split equal to brute force."""
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.pipeline.partition import (balanced_split, measure_costs, split_after, split_layers,
                                                 stage_costs)


def brute_force(costs, p, transfer=None):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0,) + cuts + (n,)
        best = min(best, max(stage_costs(costs, list(zip(edges[:-1], edges[1:])), transfer)))
    return best


def is_split(bounds, n, p):
    return (len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n
            and all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:])))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 5), st.booleans(), st.data())
def test_balanced_split_equals_brute_force(costs, p, with_transfer, data):
    if p > len(costs):
        with pytest.raises(ValueError, match="every stage needs at least one layer"):
            balanced_split(costs, p)
        return
    n = len(costs)
    transfer = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)) if with_transfer else None
    bounds = balanced_split(costs, p, transfer)
    assert is_split(bounds, len(costs), p)
    assert max(stage_costs(costs, bounds, transfer)) == brute_force(costs, p, transfer)


def test_balanced_split_on_random_float_costs():
    rng = random.Random(0)
    for _ in range(30):
        n, p = rng.randint(1, 10), rng.randint(1, 4)
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        if p <= n:
            assert max(stage_costs(costs, balanced_split(costs, p))) == pytest.approx(brute_force(costs, p))


def test_uniform_layers_split_evenly():
    assert balanced_split([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_layers("abcdefgh", [(0, 3), (3, 8)]) == [list("abc"), list("defgh")]


def test_split_after_named_layers():
    names = ["embed", "block0", "block1", "block2", "block3", "head"]
    assert split_after(names, ["block1", "block3"]) == [(0, 3), (3, 5), (5, 6)]
    assert split_after(names, ["block3", "block1"], n_stages=3) == [(0, 3), (3, 5), (5, 6)]
    assert split_after(names, []) == [(0, 6)]
    with pytest.raises(ValueError, match="no layer named 'block9'"):
        split_after(names, ["block9"])
    with pytest.raises(ValueError, match="last stage would be empty"):
        split_after(names, ["head"])
    with pytest.raises(ValueError, match="give 2 stages, not 4"):
        split_after(names, ["block0"], n_stages=4)
    with pytest.raises(ValueError, match="repeat"):
        split_after(names, ["block0", "block0"])


def test_fewer_layers_than_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        balanced_split([1, 2, 3], 4)
    with pytest.raises(ValueError, match="at least one stage"):
        balanced_split([1, 2, 3], 0)


def test_measure_costs_times_each_layer():
    ticks = iter(range(1000))
    layers = [lambda x: x + 1, lambda x: x * 2]
    costs = measure_costs(layers, 1, repeats=2, clock=lambda: next(ticks))
    assert costs == [1, 1]
