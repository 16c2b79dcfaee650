"""Helpers for the nn tests: PyTorch twins of minipar modules, built from their own parameters,
and the same computation run on the CPU and on the GPU."""
import numpy as np
import pytest

from minipar import backend

try:
    import torch
except ImportError:  # the comparisons are skipped, the other tests still run
    torch = None


def requires_torch(test):
    """Mark a test as a PyTorch comparison, skipped when PyTorch is not installed."""
    skip = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
    return pytest.mark.torch(skip(test))


def torch_params(module):
    """{name: float64 torch leaf} holding a copy of each of ``module``'s parameters."""
    return {name: torch.tensor(p.numpy().astype(np.float64), requires_grad=True)
            for name, p in module.named_parameters()}


def assert_grads_match(module, params, rtol=1e-7, atol=1e-9):
    """Each minipar gradient equals the torch twin's, parameter by parameter."""
    for name, p in module.named_parameters():
        np.testing.assert_allclose(backend.to_numpy(p.grad), params[name].grad.numpy(), rtol=rtol,
                                   atol=atol, err_msg=name)


def torch_block(P, x, n_head, prefix=""):
    """GPT-2 pre-LN block written with torch.nn.functional, from a dict of torch parameters."""
    F = torch.nn.functional
    B, T, C = x.shape

    def ln(name, h):
        return F.layer_norm(h, (C,), P[prefix + name + ".weight"], P[prefix + name + ".bias"])

    def lin(name, h):
        return F.linear(h, P[prefix + name + ".weight"], P.get(prefix + name + ".bias"))

    h = lin("attn.c_attn", ln("ln_1", x)).view(B, T, 3, n_head, C // n_head)
    q, k, v = h.permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + lin("attn.c_proj", y.transpose(1, 2).reshape(B, T, C))
    return x + lin("mlp.c_proj", F.gelu(lin("mlp.c_fc", ln("ln_2", x)), approximate="tanh"))


def cpu_and_gpu(fn):
    """``fn()`` (a list of arrays) run with NumPy, then with CuPy: the two lists, on the host.
    Skips the test without CuPy and a GPU."""
    if backend._cupy_or_none() is None:
        pytest.skip("CuPy with a CUDA device is not available")
    previous, results = backend.device(), []
    try:
        for device in ("cpu", "gpu"):
            backend.set_device(device)
            results.append([backend.to_numpy(a) for a in fn()])
    finally:
        backend.set_device(previous)
    return results
