"""fp32 master weights: an optimizer over 16-bit parameters equals, bit for bit, the same optimizer
over float32 parameters whose value is rounded to 16 bits after each step; checkpoints carry the
master copies and resume bit for bit; clipping works on the unscaled gradients; memory by kind."""
import copy

import numpy as np
import pytest

import minipar
from minipar import nn, optim
from minipar.amp import GradScaler

RNG = np.random.default_rng(3)
SHAPES = [(3, 4), (4,), (2, 2, 2)]
CASES = [("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
         ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
         ("Adam", dict(lr=0.01, weight_decay=0.1)),
         ("AdamW", dict(lr=0.01, weight_decay=0.1))]
# bfloat16 lives on the CPU only (CuPy has none)
DTYPES = [pytest.param(np.dtype("float16"), id="float16"),
          pytest.param(minipar.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
              minipar.backend.device() != "cpu", reason="bfloat16 lives on the CPU only"))]


def host(a):
    return minipar.backend.to_numpy(a)


def param(value):
    """A Parameter on the device (a copy of the host array ``value``)."""
    return nn.Parameter(minipar.backend.asarray(np.array(value)))


def steps_of_grads(n=5, dtype="float16"):
    return [[RNG.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(n)]


def run(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = None if g is None else minipar.backend.asarray(g)
        opt.step()


@pytest.mark.parametrize("missing", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, kwargs", CASES)
def test_16_bit_parameters_equal_fp32_reference_rounded_after_each_step(dtype, name, kwargs,
                                                                       missing):
    # missing: parameter 1 has no gradient at the first step (Adam then steps parameter by
    # parameter, later in its flat layout: both keep master copies)
    start = [RNG.standard_normal(s).astype(dtype) for s in SHAPES]
    ours = [param(v) for v in start]
    ref = [param(v.astype("float32")) for v in start]
    opt, ref_opt = getattr(optim, name)(ours, **kwargs), getattr(optim, name)(ref, **kwargs)
    steps = steps_of_grads(dtype=dtype)
    if missing:
        steps[0][1] = None
    for k, grads in enumerate(steps):
        run(opt, ours, [grads])
        # the 16-bit gradient, upcast
        run(ref_opt, ref, [[None if g is None else g.astype("float32") for g in grads]])
        if missing and k == 0:
            assert 1 not in opt.state and 1 not in ref_opt.state
            continue
        for i, (p, r) in enumerate(zip(ours, ref)):
            assert p.data.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(host(p.data), host(r.data).astype(dtype))
            master = opt.state[i]["master"]
            assert master.dtype == np.float32
            np.testing.assert_array_equal(host(master), host(r.data))
            for key, value in ref_opt.state[i].items():  # moments: float32, the reference's
                if key != "step":
                    assert opt.state[i][key].dtype == np.float32
                    np.testing.assert_array_equal(host(opt.state[i][key]), host(value))


@pytest.mark.parametrize("dtype", DTYPES)
def test_master_keeps_updates_smaller_than_half_a_16_bit_step(dtype):
    # lr·g = 1e-4 is below half of float16's spacing at 1.0 (2**-11 below it): added to the
    # 16-bit weight each step it would round away every time; the master accumulates it
    p = param(np.ones(4, dtype))
    opt = optim.SGD([p], lr=1e-4)
    run(opt, [p], [[np.ones(4, dtype)]] * 40)
    lost = (np.ones(4, dtype) - np.asarray(1e-4, dtype)).astype(dtype)
    assert np.all(lost == 1.0)  # the update without a master: nothing
    assert np.all(host(p.data) < 1)
    np.testing.assert_array_equal(host(p.data), np.full(4, 1 - 40e-4, "float32").astype(dtype))


@pytest.mark.parametrize("name, kwargs", CASES)
def test_checkpoint_with_master_copies_resumes_bit_for_bit(name, kwargs):
    start = [RNG.standard_normal(s).astype("float16") for s in SHAPES]
    grads = steps_of_grads(6)
    whole = [param(v) for v in start]
    whole_opt = getattr(optim, name)(whole, **kwargs)
    run(whole_opt, whole, grads)

    first = [param(v) for v in start]
    first_opt = getattr(optim, name)(first, **kwargs)
    run(first_opt, first, grads[:3])
    saved = copy.deepcopy(first_opt.state_dict())
    assert saved["state"][0]["master"].dtype == np.float32
    resumed = [param(host(p.data)) for p in first]
    resumed_opt = getattr(optim, name)(resumed, **kwargs)
    resumed_opt.load_state_dict(saved)
    assert resumed_opt.state[0]["master"].dtype == np.float32  # not cast to the parameter's
    run(resumed_opt, resumed, grads[3:])
    for p, q in zip(resumed, whole):
        np.testing.assert_array_equal(host(p.data), host(q.data))
    for i in whole_opt.state:
        np.testing.assert_array_equal(host(resumed_opt.state[i]["master"]),
                                      host(whole_opt.state[i]["master"]))


def test_clip_after_unscale_sees_the_true_gradients():
    true = [(RNG.standard_normal(s) * 10).astype("float16") for s in SHAPES]
    params = [param(np.zeros(s, "float16")) for s in SHAPES]
    scaler, opt = GradScaler(init_scale=2.0**8), optim.SGD(params, lr=1.0)
    loss = sum((p * minipar.tensor(g)).sum() for p, g in zip(params, true))
    scaler.scale(loss).backward()  # 16-bit gradients, scaled
    scaler.unscale_(opt)
    norm = float(optim.clip_grad_norm_(params, max_norm=1.0))
    expected = np.sqrt(sum((g.astype("float64") ** 2).sum() for g in true))
    assert norm == pytest.approx(expected, rel=1e-12)  # not 2**8 times it
    scaler.step(opt)
    scaler.update()
    step = np.concatenate([-host(p.data).astype("float64").ravel() for p in params])
    assert np.linalg.norm(step) == pytest.approx(1.0, rel=2e-3)  # clipped to 1, in float16


def test_clip_norm_of_16_bit_gradients_in_float64():
    # squares of 1000 overflow float16 (max 65504): the norm is taken in float64
    p = param(np.zeros(4, "float16"))
    p.grad = minipar.backend.asarray(np.full(4, 1000.0, "float16"))
    assert float(optim.clip_grad_norm_([p], max_norm=1e9)) == 2000.0
    optim.clip_grad_norm_([p], max_norm=1.0)
    assert p.grad.dtype == np.float16
    np.testing.assert_allclose(host(p.grad).astype("float64"), 0.5, rtol=1e-3)


def test_memory_by_kind_is_16_bytes_per_parameter_with_adam():
    params = [param(np.zeros(s, "float16")) for s in SHAPES]
    n = sum(int(np.prod(s)) for s in SHAPES)
    opt = optim.AdamW(params)
    run(opt, params, steps_of_grads(1))
    kinds = opt.memory_bytes()
    assert kinds == {"params": 2 * n, "grads": 2 * n, "master": 4 * n, "moments": 8 * n}
    assert opt.state_bytes() == 12 * n and sum(kinds.values()) == 16 * n
    fp32 = [param(np.zeros(s, "float32")) for s in SHAPES]
    sgd = optim.SGD(fp32, lr=0.1, momentum=0.9)
    run(sgd, fp32, steps_of_grads(1, "float32"))
    assert sgd.memory_bytes() == {"params": 4 * n, "grads": 4 * n, "master": 0, "moments": 4 * n}
