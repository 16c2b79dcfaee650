"""The flat layout (minipar.flat) and average_grads, the one reduction both data-parallel
optimizers (AllReduceOptimizer, the 4D trainer's ExpertDataParallelOptimizer) step with."""
import numpy as np

import minipar
from minipar import nn
from minipar.comm import world
from minipar.flat import flatten_grads, flatten_parameters, offsets, views
from minipar.parallel.data import average_grads

SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _params():
    rng = np.random.default_rng(0)
    return [nn.Parameter(rng.standard_normal(s)) for s in SHAPES]


def test_flatten_parameters_makes_every_array_a_view_of_one_vector():
    params = _params()
    values = [p.numpy().copy() for p in params]
    flat = flatten_parameters(params, size=30)  # zero-padded past the 24 values
    assert offsets(params) == ([0, 12, 16], 24)
    for p, v, view in zip(params, values, views(flat, params)):
        np.testing.assert_array_equal(p.numpy(), v)
        assert view.shape == p.shape
    flat[...] = 5.0
    assert all((p.numpy() == 5.0).all() for p in params)


def test_flatten_grads_counts_a_missing_gradient_as_zero():
    params = _params()
    xp = minipar.backend.xp()
    for i, p in enumerate(params):
        p.grad = None if i == 1 else xp.full(p.shape, float(i + 1))
    out = flatten_grads(params, xp.full(24, 9.0))
    np.testing.assert_array_equal(minipar.to_numpy(out), [1.0] * 12 + [0.0] * 4 + [3.0] * 8)


def test_average_grads_scales_and_leaves_views_of_the_buffer():
    params = _params()
    xp = minipar.backend.xp()
    for p in params:
        p.grad = xp.ones(p.shape)
    flat = xp.zeros(24)
    average_grads(params, flat, world(), "ring", scale=0.5)  # a group of one
    np.testing.assert_array_equal(minipar.to_numpy(flat), np.full(24, 0.5))
    for p in params:
        assert p.grad.shape == p.shape and p.grad.base is not None
    flat[...] = 2.0
    assert all((minipar.to_numpy(p.grad) == 2.0).all() for p in params)
