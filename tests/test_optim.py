"""Optimizers against PyTorch's update rules over several steps; clipping; state round trips."""
import numpy as np
import pytest

import minipar
from minipar import nn, optim
from nn_torch_twins import requires_torch, torch

RNG = np.random.default_rng(0)
SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _params(values):
    return [nn.Parameter(v.copy()) for v in values]


def _run(ours, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = minipar.backend.asarray(g.copy())  # on the parameters' device
        ours.step()


def _run_with_torch(ours, params, theirs, tparams, grads_per_step):
    """Both optimizers through the same gradients (None: the parameter has none that step)."""
    for grads in grads_per_step:
        for p, t, g in zip(params, tparams, grads):
            p.grad = None if g is None else minipar.backend.asarray(g.copy())
            t.grad = None if g is None else torch.tensor(g)
        ours.step()
        theirs.step()


CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.5)),
]


@requires_torch
@pytest.mark.parametrize("name,kwargs", CASES)
def test_updates_match_torch(name, kwargs):
    values = [RNG.standard_normal(s) for s in SHAPES]
    steps = [[RNG.standard_normal(s) for s in SHAPES] for _ in range(5)]
    params = _params(values)
    ours = getattr(optim, name)(params, **kwargs)
    _run(ours, params, steps)
    tparams = [torch.tensor(v, requires_grad=True) for v in values]
    theirs = getattr(torch.optim, name)(tparams, **kwargs)
    for grads in steps:
        for p, g in zip(tparams, grads):
            p.grad = torch.tensor(g)
        theirs.step()
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-12, atol=1e-14)


@requires_torch
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_matches_torch(max_norm):
    grads = [RNG.standard_normal(s) for s in SHAPES]
    params = _params([np.zeros(s) for s in SHAPES])
    for p, g in zip(params, grads):
        p.grad = g.copy()
    tparams = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    for p, g in zip(tparams, grads):
        p.grad = torch.tensor(g)
    total = optim.clip_grad_norm_(params, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(tparams, max_norm)
    assert abs(total - ref.item()) < 1e-12
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-12)


def test_clip_does_not_touch_shared_gradient_arrays():
    shared = np.ones(4)
    a, b = _params([np.zeros(4), np.zeros(4)])
    a.grad = b.grad = shared
    optim.clip_grad_norm(params=[a, b], max_norm=1.0)
    np.testing.assert_array_equal(shared, np.ones(4))


def test_step_builds_no_graph_and_keeps_arrays():
    model = nn.Linear(3, 2)
    opt = optim.AdamW(model.parameters(), lr=0.1)
    arrays = [p.data for p in model.parameters()]
    model(minipar.ones(4, 3)).sum().backward()
    opt.step()
    assert all(p.is_leaf and p.data is a for p, a in zip(model.parameters(), arrays))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_is_keyed_by_index_and_counted():
    params = _params([np.zeros(s, dtype=np.float32) for s in SHAPES])
    opt = optim.Adam(params)
    _run(opt, params, [[np.ones(s, dtype=np.float32) for s in SHAPES]])
    assert sorted(opt.state) == [0, 1, 2] and opt.state[0]["step"] == 1
    assert opt.state_bytes() == 2 * 4 * sum(int(np.prod(s)) for s in SHAPES)
    sgd = optim.SGD(params, lr=0.1)
    _run(sgd, params, [[np.ones(s, dtype=np.float32) for s in SHAPES]])
    assert sgd.state_bytes() == 0


def test_state_dict_round_trip_continues_identically():
    values = [RNG.standard_normal(s) for s in SHAPES]
    steps = [[RNG.standard_normal(s) for s in SHAPES] for _ in range(4)]
    a_params = _params(values)
    a = optim.AdamW(a_params, lr=0.05)
    _run(a, a_params, steps[:2])
    b_params = _params([p.numpy() for p in a_params])
    b = optim.AdamW(b_params, lr=0.9)
    b.load_state_dict(a.state_dict())
    assert b.lr == 0.05
    _run(a, a_params, steps[2:])
    _run(b, b_params, steps[2:])
    for p, q in zip(a_params, b_params):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_load_state_dict_mismatch_errors():
    params = _params([np.zeros(s) for s in SHAPES])
    adam = optim.Adam(params)
    _run(adam, params, [[np.ones(s) for s in SHAPES]])
    with pytest.raises(ValueError, match="hyperparameters"):
        optim.SGD(params, lr=0.1).load_state_dict(adam.state_dict())
    other = optim.Adam(_params([np.zeros(s) for s in [(3, 4), (5,), (2, 2, 2)]]))
    with pytest.raises(ValueError, match=r"state\[1\]\['exp_avg'\] has shape \(4,\), parameter 1 "
                                         r"has shape \(5,\)"):
        other.load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="optimizer has 1 parameters"):
        optim.Adam(params[:1]).load_state_dict(adam.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD(_params([np.zeros(2)]), lr=0.1, nesterov=True)


BAD_HYPERPARAMETERS = [
    ("SGD", dict(lr=-1.0), r"SGD: invalid lr=-1\.0: the learning rate must be >= 0"),
    ("SGD", dict(lr=float("nan")), r"invalid lr=nan"),
    ("SGD", dict(lr="0.1"), r"invalid lr='0\.1'"),
    ("SGD", dict(lr=0.1, momentum=-0.5), r"SGD: invalid momentum=-0\.5: must be >= 0"),
    ("SGD", dict(lr=0.1, weight_decay=-1e-4), r"invalid weight_decay=-0\.0001: must be >= 0"),
    ("Adam", dict(lr=-0.01), r"Adam: invalid lr=-0\.01"),
    ("Adam", dict(betas=(1.0, 0.999)), r"Adam: invalid betas\[0\]=1\.0: must be in \[0, 1\)"),
    ("Adam", dict(betas=(0.9, -0.1)), r"invalid betas\[1\]=-0\.1: must be in \[0, 1\)"),
    ("Adam", dict(betas=(0.9, 1.5)), r"invalid betas\[1\]=1\.5"),
    ("Adam", dict(betas=(0.9,)), r"invalid betas=\(0\.9,\): give two numbers"),
    ("Adam", dict(eps=0.0), r"Adam: invalid eps=0\.0: must be > 0"),
    ("Adam", dict(eps=-1e-8), r"invalid eps=-1e-08: must be > 0"),
    ("Adam", dict(weight_decay=-0.1), r"Adam: invalid weight_decay=-0\.1"),
    ("AdamW", dict(lr=-1.0), r"AdamW: invalid lr=-1\.0"),
    ("AdamW", dict(betas=(0.9, 1.0)), r"AdamW: invalid betas\[1\]=1\.0"),
    ("AdamW", dict(eps=0), r"AdamW: invalid eps=0: must be > 0"),
    ("AdamW", dict(weight_decay=-0.01), r"AdamW: invalid weight_decay=-0\.01"),
]


@pytest.mark.parametrize("name,kwargs,message", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters_name_the_argument_and_its_value(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        getattr(optim, name)(_params([np.zeros(2)]), **kwargs)


@pytest.mark.parametrize("name,kwargs", [("SGD", dict(lr=0.0, momentum=0.0, weight_decay=0.0)),
                                         ("Adam", dict(lr=0.0, betas=(0.0, 0.0))),
                                         ("AdamW", dict(betas=(0.999, 0.9999), eps=1e-12)),
                                         ("SGD", dict(lr=np.float32(0.1)))])
def test_edge_hyperparameters_are_accepted(name, kwargs):
    getattr(optim, name)(_params([np.zeros(2)]), **kwargs)


def test_negative_max_norm_is_refused():
    params = _params([np.ones(3)])
    params[0].grad = np.ones(3)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=r"clip_grad_norm_: invalid max_norm=.*must be >= 0"):
            optim.clip_grad_norm_(params, bad)
    assert (params[0].grad == 1).all()  # nothing was changed
    assert optim.clip_grad_norm_(params, 0.0) == pytest.approx(3 ** 0.5)


def test_adam_lays_the_parameters_and_moments_end_to_end():
    """One flat vector: every p.data a view of it, and the moments views of theirs, so the
    state_dict keeps its per-parameter format."""
    params = _params([RNG.standard_normal(s) for s in SHAPES])
    opt = optim.AdamW(params, lr=0.1)
    assert opt.flat is not None and opt.flat.holds(params)
    assert opt.flat.data.size == sum(int(np.prod(s)) for s in SHAPES)
    _run(opt, params, [[np.ones(s) for s in SHAPES]])
    opt.flat.data[...] = 7.0  # writing the vector writes the parameters
    assert all((p.numpy() == 7.0).all() for p in params)
    for i, s in enumerate(SHAPES):
        assert opt.state[i]["exp_avg"].shape == s and opt.state[i]["step"] == 1
    opt.flat.vectors["exp_avg"][...] = 3.0
    assert all((minipar.to_numpy(opt.state[i]["exp_avg"]) == 3.0).all() for i in range(3))


@requires_torch
def test_adam_falls_back_per_parameter_and_still_matches_torch():
    """A parameter without a gradient at one step (skipped, as in torch) leaves the parameters
    at different steps: the update then goes parameter by parameter, with the same result."""
    values = [RNG.standard_normal(s) for s in SHAPES]
    steps = [[RNG.standard_normal(s) for s in SHAPES] for _ in range(4)]
    steps[1][1] = None
    params = _params(values)
    ours = optim.AdamW(params, lr=0.01, weight_decay=0.1)
    tparams = [torch.tensor(v, requires_grad=True) for v in values]
    theirs = torch.optim.AdamW(tparams, lr=0.01, weight_decay=0.1)
    _run_with_torch(ours, params, theirs, tparams, steps)
    assert [ours.state[i]["step"] for i in range(3)] == [4, 3, 4]
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_adam_leaves_views_of_another_buffer_where_they_are():
    """Parameters that are views of someone else's vector (ZeRO's shards) are not moved."""
    xp = minipar.backend.xp()
    buffer = xp.zeros(10)
    shard = nn.Parameter(buffer[2:8])
    opt = optim.Adam([shard], lr=0.5)
    assert opt.flat is None
    shard.grad = xp.ones(6)
    opt.step()
    np.testing.assert_allclose(minipar.to_numpy(buffer)[2:8], -0.5)
    assert (minipar.to_numpy(buffer)[[0, 1, 8, 9]] == 0).all()


def test_adam_follows_replaced_parameter_arrays():
    """A parameter given a new array (PipeDream's stash, module.to(dtype)) is laid out anew:
    the step updates the new arrays and leaves the old ones, which may be stashed, alone."""
    params = _params([np.zeros(s) for s in SHAPES])
    opt = optim.Adam(params, lr=0.5)
    _run(opt, params, [[np.ones(s) for s in SHAPES]])
    old = [p.data for p in params]
    before = [p.numpy().copy() for p in params]
    for p in params:
        p.data = p.data.copy()
    _run(opt, params, [[np.ones(s) for s in SHAPES]])
    for p, a, b in zip(params, old, before):
        np.testing.assert_array_equal(minipar.to_numpy(a), b)  # the stashed arrays unchanged
        np.testing.assert_allclose(p.numpy(), b - 0.5)
    assert opt.flat.holds(params)


@pytest.mark.parametrize("name, kwargs", [c for c in CASES if c[0] != "SGD"])
def test_adam_flat_and_per_parameter_paths_run_one_formula(name, kwargs):
    """The flat step and the per-parameter step (views of someone else's buffer, as ZeRO's
    shards are) run the same ``Adam.adam``: the very same bits, step after step."""
    xp = minipar.backend.xp()
    values = [RNG.standard_normal(s) for s in SHAPES]
    steps = [[RNG.standard_normal(s) for s in SHAPES] for _ in range(3)]
    flat = _params(values)
    buffer = xp.zeros(sum(v.size for v in values))
    starts = np.cumsum([0] + [v.size for v in values])
    shards = [nn.Parameter(buffer[a:b].reshape(v.shape)) for v, a, b in
              zip(values, starts, starts[1:])]
    for p, v in zip(shards, values):
        p.data[...] = minipar.backend.asarray(v)
    ours, fallback = getattr(optim, name)(flat, **kwargs), getattr(optim, name)(shards, **kwargs)
    assert ours.flat is not None and fallback.flat is None
    _run(ours, flat, steps)
    _run(fallback, shards, steps)
    for p, q in zip(flat, shards):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def _decay_groups(params):
    """The common split: weight decay on matrices, none on biases and norms."""
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 0.03}]


@requires_torch
@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_param_groups_match_torch(name):
    """Two groups (decay, and no decay with its own lr) equal torch's over several steps, in
    float64 to 1e-12, with a parameter without a gradient at one step (left alone)."""
    shapes = [(3, 4), (4,), (2, 5), (5,)]
    values = [RNG.standard_normal(s) for s in shapes]
    steps = [[RNG.standard_normal(s) for s in shapes] for _ in range(6)]
    steps[2][3] = None
    kwargs = dict(lr=0.01, weight_decay=0.2) if name != "SGD" else dict(lr=0.01, momentum=0.9,
                                                                         weight_decay=0.2)
    params = _params(values)
    ours = getattr(optim, name)(_decay_groups(params), **kwargs)
    tparams = [torch.tensor(v, requires_grad=True) for v in values]
    theirs = getattr(torch.optim, name)(_decay_groups(tparams), **kwargs)
    _run_with_torch(ours, params, theirs, tparams, steps)
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.2, 0.0]


def test_optimizers_leave_a_parameter_without_gradient_alone():
    """No momentum, no weight decay, no step count for a parameter whose grad is None (torch)."""
    for name, kwargs in [("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
                         ("AdamW", dict(lr=0.1, weight_decay=0.1))]:
        a, b = _params([np.ones(3), np.ones(2)])
        opt = getattr(optim, name)([a, b], **kwargs)
        for _ in range(3):
            a.grad, b.grad = minipar.backend.asarray(np.ones(3)), None
            opt.step()
        assert (b.numpy() == 1).all() and 1 not in opt.state
        assert opt.state[0]["step"] == 3


def test_add_param_group_and_group_errors():
    a, b, c = _params([np.zeros(2), np.zeros(3), np.zeros(4)])
    opt = optim.AdamW([a], lr=0.1, weight_decay=0.5)
    opt.add_param_group({"params": b, "weight_decay": 0.0})
    assert opt.params == [a, b] and opt.param_groups[1]["lr"] == 0.1
    assert len(opt.flats) == 2 and opt.flats[1].holds([b])
    with pytest.raises(AttributeError, match="param groups differ"):
        opt.weight_decay
    opt.lr = 0.2  # sets every group's
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.2] and opt.lr == 0.2
    with pytest.raises(ValueError, match="appears twice"):
        opt.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match=r"AdamW: invalid weight_decay=-1"):
        opt.add_param_group({"params": [c], "weight_decay": -1})
    with pytest.raises(TypeError, match="'params' key"):
        opt.add_param_group([c])
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD([{"params": [c], "nesterov": True}], lr=0.1)


def test_state_dict_carries_the_groups():
    """torch's format (param_groups with their indices), loaded into a fresh optimizer: the
    per-group hyperparameters come back and training continues identically; a checkpoint of
    another group layout is refused before anything changes."""
    values = [RNG.standard_normal(s) for s in [(3, 4), (4,), (2, 2)]]
    steps = [[RNG.standard_normal(v.shape) for v in values] for _ in range(4)]
    a_params = _params(values)
    a = optim.AdamW(_decay_groups(a_params), lr=0.05, weight_decay=0.3)
    _run(a, a_params, steps[:2])
    saved = a.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2]]  # counted over groups
    assert saved["hyperparameters"]["param_groups"][1]["weight_decay"] == 0.0
    b_params = _params([p.numpy() for p in a_params])
    b = optim.AdamW(_decay_groups(b_params), lr=0.9)
    b.load_state_dict(saved)
    assert [g["lr"] for g in b.param_groups] == [0.05, 0.03]
    # the trainers' checkpoint form: state and hyperparameters only
    c_params = _params([p.numpy() for p in a_params])
    c = optim.AdamW(_decay_groups(c_params), lr=0.9)
    c.load_state_dict({"state": saved["state"], "hyperparameters": saved["hyperparameters"]})
    _run(a, a_params, steps[2:])
    for opt, ps in ((b, b_params), (c, c_params)):
        _run(opt, ps, steps[2:])
        for p, q in zip(a_params, ps):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    one = optim.AdamW(_params(values), lr=0.9)
    with pytest.raises(ValueError, match="param groups"):
        one.load_state_dict(saved)
    with pytest.raises(ValueError, match="param groups"):
        one.load_state_dict({"state": {}, "hyperparameters": saved["hyperparameters"]})
    assert one.lr == 0.9 and not one.state


def test_a_dry_run_on_a_shallow_copy_leaves_the_groups_alone():
    """The checkpoint adapters try a load on copy.copy(optimizer) first (load_after_dry_run)."""
    import copy
    opt = optim.AdamW(_params([np.zeros(2)]), lr=0.1)
    copy.copy(opt).load_state_dict({"state": {}, "hyperparameters": {
        "lr": 0.5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}})
    assert opt.lr == 0.1 and opt.weight_decay == 0.01
