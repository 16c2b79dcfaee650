"""GradScaler against torch.amp.GradScaler("cpu"): the same scale after every update() and the
same skipped steps for scripted gradients with infs and NaNs; its errors, its state dict, the
disabled pass-through; and, on 2 and 3 ranks, an inf on one rank skips the step on every rank."""
import contextlib

import numpy as np
import pytest

import minipar
from minipar import nn, optim
from minipar.amp import GradScaler
from minipar.testing import run_on_ranks
from nn_torch_twins import requires_torch, torch

RNG = np.random.default_rng(0)
BAD = {2: np.inf, 7: -np.inf, 8: np.nan, 9: np.inf, 20: np.nan}  # step -> a gradient entry
STEPS = 32


def host(a):
    return minipar.backend.to_numpy(a)


def param(value):
    """A Parameter on the device (a copy of the host array ``value``)."""
    return nn.Parameter(minipar.backend.asarray(np.array(value)))


def coefficients(steps=STEPS, bad=BAD, size=5):
    """The loss of step k is sum(w · c_k): its gradient is c_k (times the scale)."""
    out = []
    for k in range(steps):
        c = (RNG.standard_normal(size) * 1e-3).astype("float32")
        if k in bad:
            c[k % size] = bad[k]
        out.append(c)
    return out


def ours_run(coefs, scaler, new_scales=None, w0=None):
    """(scale after each update, skipped or not, final weights) of minipar's scaler with SGD."""
    w = param(np.ones(coefs[0].size, "float32") if w0 is None else w0)
    opt = optim.SGD([w], lr=0.5)
    scales, skipped = [], []
    for k, c in enumerate(coefs):
        before = host(w.data).copy()
        scaler.scale((w * minipar.tensor(c)).sum()).backward()
        scaler.step(opt)
        scaler.update((new_scales or {}).get(k))
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(bool(np.array_equal(before, host(w.data))))
    return scales, skipped, host(w.data)


def torch_run(coefs, scaler, new_scales=None):
    w = torch.nn.Parameter(torch.ones(coefs[0].size))
    opt = torch.optim.SGD([w], lr=0.5)
    scales, skipped = [], []
    for k, c in enumerate(coefs):
        before = w.detach().clone()
        scaler.scale((w * torch.tensor(c)).sum()).backward()
        scaler.step(opt)
        scaler.update((new_scales or {}).get(k))
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(bool(torch.equal(before, w.detach())))
    return scales, skipped, w.detach().numpy()


SETTINGS = [dict(growth_interval=3),
            dict(init_scale=3.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),
            dict(init_scale=2.0**126, growth_interval=1),  # growth stops at float32's top
            dict()]


@requires_torch
@pytest.mark.parametrize("settings", SETTINGS)
def test_scale_trajectory_and_skips_equal_torch(settings):
    coefs = coefficients()
    new_scales = {12: 1024.0} if not settings else None
    ours = ours_run(coefs, GradScaler(**settings), new_scales)
    theirs = torch_run(coefs, torch.amp.GradScaler("cpu", **settings), new_scales)
    assert ours[0] == theirs[0]  # every scale, exactly
    assert ours[1] == theirs[1]
    assert [k for k, s in enumerate(ours[1]) if s] == sorted(BAD)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-6)
    if settings.get("growth_interval") == 3:  # growth seen, not only backoff
        assert any(b > a for a, b in zip(ours[0], ours[0][1:]))


@requires_torch
def test_state_dict_has_torch_keys_and_values():
    coefs = coefficients()[:11]
    ours, theirs = GradScaler(growth_interval=4), torch.amp.GradScaler("cpu", growth_interval=4)
    ours_run(coefs, ours)
    torch_run(coefs, theirs)
    assert ours.state_dict() == theirs.state_dict()
    loaded = GradScaler()
    loaded.load_state_dict(theirs.state_dict())  # torch's dict loads as it is
    assert loaded.state_dict() == ours.state_dict()
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler().load_state_dict({})


def test_resume_continues_the_same_trajectory():
    coefs = coefficients()
    whole = GradScaler(growth_interval=4)
    scales, skipped, _ = ours_run(coefs, whole)
    head = GradScaler(growth_interval=4)
    _, _, w = ours_run(coefs[:11], head)
    tail = GradScaler()
    tail.load_state_dict(head.state_dict())
    scales2, skipped2, _ = ours_run(coefs[11:], tail, w0=w)
    assert scales2 == scales[11:] and skipped2 == skipped[11:]


def one_step_setup(grad, scaler=None):
    """A weight with gradient ``grad`` and its SGD; ``scaler.scale`` called once, as a script's
    ``scaler.scale(loss)`` (torch refuses to unscale or step before)."""
    w = param(np.ones(3, "float32"))
    w.grad = minipar.backend.asarray(np.array(grad, "float32"))
    if scaler is not None:
        scaler.scale(minipar.tensor(np.float32(0.0)))
    return w, optim.SGD([w], lr=0.1)


def test_unscale_twice_and_step_twice_are_torch_errors():
    scaler = GradScaler()
    w, opt = one_step_setup([1.0, 2.0, 3.0], scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler(growth_factor=1.0)


def test_unscale_divides_by_the_scale_and_16_bit_comes_back_float32():
    scaler = GradScaler(init_scale=2.0**10)
    w = param(np.ones(3, "float16"))
    grad16 = np.array([2.0**-14, 3.0, 2.0**-24], "float16") * np.float16(2.0**10)
    w.grad = minipar.backend.asarray(grad16)
    opt = optim.SGD([w], lr=0.1)
    scaler.scale(minipar.tensor(np.float32(0.0)))
    scaler.unscale_(opt)
    got = host(w.grad)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, grad16.astype("float32") / 2.0**10)
    assert got[2] == 2.0**-24  # fp16's smallest subnormal survives the unscaling


def test_disabled_scaler_is_a_pass_through():
    scaler = GradScaler(enabled=False)
    w, opt = one_step_setup([np.inf, 1.0, 1.0])
    loss = (w * 2.0).sum()
    assert scaler.scale(loss) is loss
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    assert np.isinf(host(w.data)[0])  # the step ran, inf and all
    scaler.update()
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})  # a no-op


def test_skipped_step_leaves_weights_and_state_alone():
    scaler = GradScaler()
    w = param(np.ones(3, "float32"))
    opt = optim.AdamW([w], lr=0.1)
    w.grad = minipar.backend.asarray(np.array([1.0, np.nan, 1.0], "float32"))
    scaler.scale(minipar.tensor(np.float32(0.0)))
    assert scaler.step(opt) is None
    scaler.update()
    assert opt.state == {} and scaler.get_scale() == 2.0**15
    np.testing.assert_array_equal(host(w.data), np.ones(3))


# --- on 2 and 3 ranks: an inf on one rank skips the step on every rank -----------------------
def inf_on_one_rank_body():
    """For DDP, ZeRO 1 and 2, ZeRO3, and plain optimizers with group=world: the inf enters on
    the last rank only; returns (strategy, skipped steps, scales, a digest of the weights)."""
    from minipar import comm
    from minipar.parallel.data import ZeRO3, DistributedDataParallel, ZeRO

    world = comm.world()
    bad_step, out = 1, []
    for strategy in ("ddp", "zero1", "zero2", "zero3", "group", "groups", "no-group"):
        minipar.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        make_opt = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
        scaler = GradScaler(growth_interval=2)
        if strategy == "ddp":
            net, stepper = DistributedDataParallel(model, world, overlap=False), None
            stepper = make_opt(model.parameters())
        elif strategy.startswith("zero"):
            net = model
            stepper = (ZeRO3(model, make_opt, world) if strategy == "zero3" else
                       ZeRO(model, make_opt, world, stage=int(strategy[-1]), bucket_cap_mb=1e-4))
        else:  # each rank its own parameters (as tensor parallelism's)
            net, stepper = model, make_opt(model.parameters())
            # "groups": a tuple, as (tp, pp) would be
            scaler.group = {"group": world, "groups": (world, world)}.get(strategy)
        rng = np.random.default_rng(world.rank)
        skipped, scales = [], []
        for step in range(4):
            x = rng.standard_normal((3, 4)).astype("float32")
            if step == bad_step and world.rank == world.size - 1:
                x[0, 0] = np.inf
            watched = list(getattr(stepper, "optimizer", stepper).params)  # ZeRO: the shards
            before = [host(p.data).copy() for p in watched]
            y = net(minipar.tensor(x))
            scaler.scale((y * y).mean()).backward()
            scaler.step(stepper)
            scaler.update()
            stepper.zero_grad()
            skipped.append(all(np.array_equal(b, host(p.data)) for b, p in zip(before, watched)))
            scales.append(scaler.get_scale())
        out.append((strategy, skipped, scales))
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_inf_on_one_rank_skips_on_every_rank(nprocs):
    per_rank = run_on_ranks(inf_on_one_rank_body, nprocs, timeout=240)
    for rank, results in enumerate(per_rank):
        for strategy, skipped, scales in results:
            last = rank == nprocs - 1
            if strategy == "no-group" and not last:  # without the group only the bad rank knows
                assert scales == [2.0**16, 2.0**17, 2.0**17, 2.0**18], (rank, strategy, scales)
                continue
            assert scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16], (rank, strategy, scales)
            assert skipped == [False, True, False, False], (rank, strategy, skipped)


# --- wrappers that reduce inside their step: unscaled after the reduction -------------------
def wrapped(kind, model, make_opt):
    from minipar import comm
    from minipar.parallel.data import AllReduceOptimizer, ZeRO, ZeRO3
    if kind == "serial":
        return make_opt(model.parameters())
    if kind == "zero3":
        return ZeRO3(model, make_opt, comm.world())
    if kind == "allreduce":
        return AllReduceOptimizer(model, make_opt, comm.world())
    return ZeRO(model, make_opt, comm.world(), stage=int(kind[-1]))


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3", "allreduce"])
def test_wrapper_unscales_16_bit_gradients_after_its_reduction(kind):
    # true gradients about 2**-26, below float16's smallest subnormal (2**-24): unscaled in
    # 16 bits before ZeRO's reduction they would flush to zero and Adam would not move
    def train(kind):
        minipar.manual_seed(0)
        model = nn.Linear(4, 3).half()
        opt = wrapped(kind, model, lambda ps: optim.Adam(ps, lr=1e-3))
        scaler = GradScaler()
        x = minipar.tensor(np.random.default_rng(0).standard_normal((5, 4)).astype("float16"))
        for _ in range(2):
            y = model(x).to("float32")
            scaler.scale((y * minipar.tensor(np.float32(2.0**-26))).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        with getattr(opt, "summon_full_params", contextlib.nullcontext)():  # ZeRO3: whole
            return [host(p.data).copy() for p in model.parameters()]

    minipar.manual_seed(0)
    start = [host(p.data) for p in nn.Linear(4, 3).half().parameters()]
    serial = train("serial")
    assert all(not np.array_equal(a, b) for a, b in zip(serial, start))
    for a, b in zip(train(kind), serial):
        np.testing.assert_array_equal(a, b)
