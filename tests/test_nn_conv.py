"""Convolution, pooling, batch norm and the small ResNet: finite differences and PyTorch."""
import numpy as np
import pytest

import minipar
import minipar.nn as nn
from minipar.gradcheck import gradcheck
from minipar.nn import functional_conv as Fc
from nn_torch_twins import cpu_and_gpu, requires_torch, torch

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 2, 5, 5))


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), ((1, 2), (0, 1))])
def test_conv2d_gradcheck(stride, padding):
    w, b = RNG.standard_normal((3, 2, 3, 2)), RNG.standard_normal(3)
    gradcheck(lambda x, w, b: Fc.conv2d(x, w, b, stride, padding), X, w, b)


def test_pools_gradcheck():
    gradcheck(lambda x: Fc.max_pool2d(x, 2), X)
    gradcheck(lambda x: Fc.max_pool2d(x, 3, stride=2, padding=1), X)
    gradcheck(lambda x: Fc.avg_pool2d(x, 3, stride=2, padding=1), X)
    gradcheck(lambda x: Fc.adaptive_avg_pool2d(x), X)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_gradcheck(training):
    mean, var = RNG.standard_normal(2), RNG.random(2) + 0.5
    host = minipar.backend.asarray  # running statistics live on the input's device
    gradcheck(lambda x, w, b: Fc.batch_norm(x, host(mean.copy()), host(var.copy()), w, b, training),
              X, RNG.standard_normal(2), RNG.standard_normal(2))


def test_batch_norm_running_stats_and_recompute_guard(monkeypatch):
    bn = nn.BatchNorm2d(2).double()
    x = minipar.tensor(X * 3 + 1)
    bn(x)
    m = X.size // 2
    mean, var = (X * 3 + 1).mean(axis=(0, 2, 3)), (X * 3 + 1).var(axis=(0, 2, 3)) * m / (m - 1)
    np.testing.assert_allclose(minipar.to_numpy(bn.running_mean), 0.1 * mean)
    np.testing.assert_allclose(minipar.to_numpy(bn.running_var), 0.9 + 0.1 * var)
    monkeypatch.setattr(Fc, "_is_recomputing", lambda: True)
    bn(x)
    np.testing.assert_allclose(minipar.to_numpy(bn.running_mean), 0.1 * mean)


def test_batch_norm_counts_once_under_checkpoint():
    from minipar.checkpoint import checkpoint

    bn = nn.BatchNorm2d(2).double()
    x = minipar.tensor(X, requires_grad=True)
    checkpoint(bn, x).sum().backward()
    np.testing.assert_allclose(minipar.to_numpy(bn.running_mean), 0.1 * X.mean(axis=(0, 2, 3)))


def test_shape_errors_are_explained():
    with pytest.raises(ValueError, match="channels"):
        Fc.conv2d(minipar.tensor(X), minipar.tensor(np.ones((1, 3, 3, 3))))
    with pytest.raises(ValueError, match="does not fit"):
        Fc.max_pool2d(minipar.tensor(X), 7)


def test_resnet_is_a_splittable_sequential():
    minipar.manual_seed(0)
    net = nn.ResNet(blocks=(1, 1), widths=(4, 8), in_channels=1, num_classes=3).double()
    x = minipar.tensor(RNG.standard_normal((2, 1, 8, 8)))
    net.eval()
    full = net(x).numpy()
    np.testing.assert_allclose(net[4:](net[:4](x)).numpy(), full)
    assert full.shape == (2, 3) and len(net) == 3 + 2 + 3
    net.train()
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    assert any(k.endswith("running_var") for k in net.state_dict())


@pytest.mark.gpu
def test_resnet_on_gpu_matches_cpu():
    x = RNG.standard_normal((2, 1, 8, 8))

    def train_step():
        minipar.manual_seed(0)
        net = nn.ResNet(blocks=(1, 1), widths=(4, 8), num_classes=3).double()
        out = net(minipar.tensor(minipar.backend.asarray(x)))
        (out * out).sum().backward()
        return [out.data] + [p.grad for p in net.parameters()] + list(net.state_dict().values())

    for a, b in zip(*cpu_and_gpu(train_step)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


TF = torch.nn.functional if torch else None


def _compare(ours_fn, theirs_fn, *arrays):
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    ms = [minipar.tensor(a, requires_grad=True) for a in arrays]
    ours, theirs = ours_fn(*ms), theirs_fn(*ts)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-10, atol=1e-12)
    proj = RNG.standard_normal(ours.shape)
    ours.backward(proj)
    (theirs * torch.tensor(proj)).sum().backward()
    for m, t in zip(ms, ts):
        np.testing.assert_allclose(minipar.to_numpy(m.grad), t.grad.numpy(), rtol=1e-9, atol=1e-11)


@requires_torch
def test_conv_and_pools_match_torch():
    x = RNG.standard_normal((2, 3, 9, 8))
    w, b = RNG.standard_normal((4, 3, 3, 3)), RNG.standard_normal(4)
    _compare(lambda x, w, b: Fc.conv2d(x, w, b, 2, 1),
             lambda x, w, b: TF.conv2d(x, w, b, 2, 1), x, w, b)
    _compare(lambda x: Fc.max_pool2d(x, 3, 2, 1), lambda x: TF.max_pool2d(x, 3, 2, 1), x)
    _compare(lambda x: Fc.avg_pool2d(x, 2), lambda x: TF.avg_pool2d(x, 2), x)
    _compare(lambda x: Fc.adaptive_avg_pool2d(x), lambda x: TF.adaptive_avg_pool2d(x, 1), x)


@requires_torch
def test_batch_norm_module_matches_torch():
    x = RNG.standard_normal((4, 3, 5, 5)) * 2 + 1
    ours, theirs = nn.BatchNorm2d(3).double(), torch.nn.BatchNorm2d(3).double()
    for _ in range(2):
        _compare(lambda x: ours(x), lambda x: theirs(x), x)
    np.testing.assert_allclose(minipar.to_numpy(ours.running_mean), theirs.running_mean.numpy(),
                               rtol=1e-12)
    np.testing.assert_allclose(minipar.to_numpy(ours.running_var), theirs.running_var.numpy(),
                               rtol=1e-12)
    ours.eval(), theirs.eval()
    _compare(lambda x: ours(x), lambda x: theirs(x), x)
