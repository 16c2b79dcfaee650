"""minipar.optim.lr_scheduler against torch's: the same learning rates over 100 steps, step by
step, for each scheduler, the warm-up then cosine of SequentialLR, and state_dict resumes."""
import warnings

import numpy as np
import pytest

from minipar import nn, optim
from minipar.optim import lr_scheduler
from nn_torch_twins import requires_torch, torch

STEPS = 100


def _pair(lrs=(0.1, 0.02)):
    """A minipar and a torch SGD with one param group per lr."""
    ours = optim.SGD([{"params": [nn.Parameter(np.zeros(2))], "lr": lr} for lr in lrs], lr=1.0)
    theirs = torch.optim.SGD([{"params": [torch.zeros(2, requires_grad=True)], "lr": lr}
                              for lr in lrs], lr=1.0)
    return ours, theirs


SCHEDULES = {
    "LambdaLR": lambda m, o: m.LambdaLR(o, lambda e: 0.97 ** e),
    "LambdaLR per group": lambda m, o: m.LambdaLR(o, [lambda e: 1 / (e + 1), lambda e: e % 7]),
    "StepLR": lambda m, o: m.StepLR(o, step_size=7, gamma=0.5),
    "LinearLR": lambda m, o: m.LinearLR(o, start_factor=0.01, total_iters=30),
    "LinearLR down": lambda m, o: m.LinearLR(o, 1.0, end_factor=0.1, total_iters=45),
    "CosineAnnealingLR": lambda m, o: m.CosineAnnealingLR(o, T_max=40, eta_min=1e-3),
    "warm-up then cosine": lambda m, o: m.SequentialLR(
        o, [m.LinearLR(o, start_factor=0.1, total_iters=10),
            m.CosineAnnealingLR(o, T_max=STEPS - 10, eta_min=1e-4)], milestones=[10]),
    "three phases": lambda m, o: m.SequentialLR(
        o, [m.LinearLR(o, 0.2, total_iters=5), m.StepLR(o, 10, 0.7),
            m.CosineAnnealingLR(o, 30)], milestones=[20, 60]),
}


@requires_torch
@pytest.mark.parametrize("name", SCHEDULES)
def test_learning_rates_equal_torch_for_100_steps(name):
    ours, theirs = _pair()
    mine, ref = SCHEDULES[name](lr_scheduler, ours), SCHEDULES[name](torch.optim.lr_scheduler,
                                                                       theirs)
    assert mine.get_last_lr() == ref.get_last_lr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no optimizer.step() came first
        for _ in range(STEPS):
            ours.step()
            theirs.step()
            mine.step()
            ref.step()
            assert mine.get_last_lr() == ref.get_last_lr()  # the same floats
            assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]
    assert mine.last_epoch == ref.last_epoch == STEPS


@requires_torch
def test_state_dict_resumes_where_it_stopped():
    """A schedule saved at step 37 and loaded into a fresh one (built, then the optimizer's
    state loaded, then the schedule's, as torch resumes) continues with torch's numbers."""
    ours, theirs = _pair()
    build = SCHEDULES["warm-up then cosine"]
    mine, ref = build(lr_scheduler, ours), build(torch.optim.lr_scheduler, theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(37):
            mine.step()
            ref.step()
        saved, saved_opt = mine.state_dict(), ours.state_dict()
        assert saved["last_epoch"] == ref.state_dict()["last_epoch"] == 37
        again, _ = _pair()
        resumed = build(lr_scheduler, again)
        again.load_state_dict(saved_opt)
        resumed.load_state_dict(saved)
        for _ in range(STEPS - 37):
            resumed.step()
            ref.step()
            assert resumed.get_last_lr() == ref.get_last_lr()


def test_the_schedule_drives_the_optimizer_step():
    """The learning rate the scheduler sets is the one the next step uses."""
    p = nn.Parameter(np.zeros(1))
    opt = optim.SGD([p], lr=1.0)
    schedule = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = np.ones(1)
        opt.step()
        schedule.step()
    np.testing.assert_allclose(p.numpy(), [-(1 + 0.5 + 0.25)])
    assert opt.lr == 0.125 and opt.param_groups[0]["initial_lr"] == 1.0


def test_bad_arguments_are_named():
    opt = optim.SGD([nn.Parameter(np.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="start_factor"):
        lr_scheduler.LinearLR(opt, start_factor=0.0)
    with pytest.raises(ValueError, match="Expected 1 lr_lambdas, but got 2"):
        lr_scheduler.LambdaLR(opt, [abs, abs])
    with pytest.raises(ValueError, match="2 schedulers need 1 milestones, got 0"):
        lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(opt, 2)] * 2, milestones=[])
    other = optim.SGD([nn.Parameter(np.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(other, 2)], milestones=[])
    with pytest.raises(KeyError, match="initial_lr"):
        lr_scheduler.StepLR(optim.SGD([nn.Parameter(np.zeros(1))], lr=0.1), 2, last_epoch=5)
