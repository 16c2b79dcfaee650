"""torch.nn's loss modules and their functions, against torch: values and gradients (float64)
for every reduction, with class weights, ignore_index, label smoothing and pos_weight."""
import numpy as np
import pytest

import minipar.functional as F
from minipar import Tensor, nn

torch = pytest.importorskip("torch")
rng = np.random.default_rng(1)
REDUCTIONS = ("mean", "sum", "none")


def check(ours, theirs, inputs, kwargs, module, tol=1e-12):
    """Build both modules with kwargs (arrays as tensors for torch), call them on inputs, and
    compare the losses and the gradients of the floating inputs."""
    mine = [Tensor(x, requires_grad=x.dtype.kind == "f") for x in inputs]
    tor = [torch.tensor(x, requires_grad=x.dtype.kind == "f") for x in inputs]
    tkw = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    a = getattr(nn, module)(**kwargs)(*mine) if module else ours(*mine, **kwargs)
    b = getattr(torch.nn, module)(**tkw)(*tor) if module else theirs(*tor, **tkw)
    np.testing.assert_allclose(a.numpy(), b.detach().numpy(), rtol=0, atol=tol)
    g = rng.standard_normal(b.shape)
    a.backward(g if g.ndim else None)
    b.backward(torch.tensor(g) if g.ndim else None)
    for m, t in zip(mine, tor):
        if t.requires_grad:
            np.testing.assert_allclose(m.grad, t.grad.numpy(), rtol=0, atol=tol)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", [{}, {"weight": rng.random(5) + 0.5}, {"label_smoothing": 0.2},
                                   {"weight": rng.random(5) + 0.5, "label_smoothing": 0.3},
                                   {"ignore_index": 2}])
@pytest.mark.parametrize("module", [None, "CrossEntropyLoss"])
def test_cross_entropy(reduction, extra, module):
    t = rng.integers(0, 5, 7)
    t[3] = extra.get("ignore_index", -100)
    check(F.cross_entropy, torch.nn.functional.cross_entropy,
          [rng.standard_normal((7, 5)), t], {"reduction": reduction, **extra}, module)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_with_classes_on_axis_1_and_smoothing(reduction):
    t = rng.integers(0, 4, (3, 6))
    check(F.cross_entropy, torch.nn.functional.cross_entropy,
          [rng.standard_normal((3, 4, 6)), t], {"reduction": reduction, "label_smoothing": 0.1,
                                                "weight": rng.random(4)}, "CrossEntropyLoss")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", [{}, {"weight": rng.random(5) + 0.5}, {"ignore_index": 1}])
def test_nll_loss(reduction, extra):
    check(F.nll_loss, torch.nn.functional.nll_loss,
          [rng.standard_normal((6, 5)), rng.integers(0, 5, 6)], {"reduction": reduction, **extra},
          "NLLLoss")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name, module", [("mse_loss", "MSELoss"), ("l1_loss", "L1Loss")])
def test_regression_losses_give_input_and_target_gradients(reduction, name, module):
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    y[0, 0] = x[0, 0]  # l1's gradient where input equals target: 0, as torch's
    for mod in (None, module):
        check(getattr(F, name), getattr(torch.nn.functional, name), [x, y],
              {"reduction": reduction}, mod)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", [{}, {"pos_weight": rng.random(3) + 0.5},
                                   {"weight": rng.random(3), "pos_weight": rng.random(3) * 3}])
def test_bce_with_logits(reduction, extra):
    x = rng.standard_normal((5, 3)) * 30  # large logits: the stable form does not overflow
    y = rng.random((5, 3))
    for mod in (None, "BCEWithLogitsLoss"):
        check(F.binary_cross_entropy_with_logits,
              torch.nn.functional.binary_cross_entropy_with_logits, [x, y],
              {"reduction": reduction, **extra}, mod, tol=1e-10)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        nn.MSELoss(reduction="avg")
    with pytest.raises(ValueError, match="one value per class, shape \\(5,\\)"):
        nn.CrossEntropyLoss(weight=np.ones(3))(Tensor(np.zeros((2, 5))), np.array([0, 1]))
    with pytest.raises(ValueError, match="target size \\(2,\\) must be the same"):
        F.binary_cross_entropy_with_logits(Tensor(np.zeros((2, 1))), Tensor(np.zeros(2)))
    with pytest.warns(UserWarning, match="broadcasts against the input"):
        F.mse_loss(Tensor(np.zeros((2, 1))), Tensor(np.zeros(2)))
    assert repr(nn.L1Loss(reduction="sum")) == "L1Loss(reduction='sum')"
