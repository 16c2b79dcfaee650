"""The engine on CuPy arrays: the same numbers as on NumPy. Skipped without CuPy and a GPU."""
import numpy as np
import pytest

import minipar
import minipar.functional as F
from minipar import backend
from minipar.checkpoint import checkpoint_sequential
from minipar.gradcheck import gradcheck

pytestmark = pytest.mark.gpu
if backend._cupy_or_none() is None:
    pytest.skip("CuPy with a CUDA device is not available", allow_module_level=True)


@pytest.fixture(autouse=True)
def on_gpu():
    previous = backend.device()
    backend.set_device("gpu")
    yield
    backend.set_device(previous)


def run_both(fn, *arrays):
    """fn on NumPy then on CuPy inputs: outputs and gradients as host arrays."""
    results = []
    for device in ("cpu", "gpu"):
        backend.set_device(device)
        inputs = [minipar.tensor(a, requires_grad=True) for a in arrays]
        out = fn(*inputs)
        out.backward(backend.xp().ones(out.shape))
        results.append([out.numpy()] + [backend.to_numpy(t.grad) for t in inputs])
    backend.set_device("gpu")
    return results


def test_arrays_live_on_the_gpu():
    x = minipar.tensor([1.0, 2.0], requires_grad=True)
    assert backend.is_gpu_array(x.data)
    (x * x).sum().backward()
    assert backend.is_gpu_array(x.grad)
    np.testing.assert_allclose(x.numpy(), [1.0, 2.0])


def test_fused_functions_match_numpy():
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((4, 6, 8)), rng.standard_normal((5, 8)), rng.standard_normal(5)
    cases = [
        (lambda a, w, b: F.gelu(F.linear(a, w, b)), (x, w, b)),
        (lambda a: F.layer_norm(a), (x,)),
        (lambda a: F.softmax(a) * F.log_softmax(a, 0), (x,)),
        (lambda a: F.cross_entropy(a, np.arange(24).reshape(4, 6) % 8), (x,)),
        (lambda q: F.causal_self_attention(q, q * 2, q.tanh()), (x.reshape(2, 2, 6, 8),)),
        (lambda a: (a @ a.transpose(1, 2)).max(axis=1).sum(axis=0), (x,)),
        (lambda a: a[:, np.array([0, 0, 3])].exp().mean(), (x,)),
    ]
    for fn, arrays in cases:
        cpu, gpu = run_both(fn, *arrays)
        for c, g in zip(cpu, gpu):
            np.testing.assert_allclose(g, c, rtol=1e-9, atol=1e-10)


def test_gradcheck_on_gpu():
    rng = np.random.default_rng(1)
    gradcheck(lambda a, b: (a * b + a / (1 + b * b)).tanh() @ b.T,
              rng.standard_normal((3, 4)), rng.standard_normal((3, 4)))


def test_checkpoint_with_dropout_on_gpu():
    rng = np.random.default_rng(2)
    ws = [minipar.tensor(rng.standard_normal((16, 16)) / 4, requires_grad=True) for _ in range(4)]
    layers = [lambda h, w=w: F.dropout(F.linear(h, w).tanh(), 0.2) for w in ws]
    x_data = rng.standard_normal((4, 16))
    grads = []
    for segments in (0, 2):
        for w in ws:
            w.grad = None
        minipar.manual_seed(0)
        x = minipar.tensor(x_data)
        y = checkpoint_sequential(layers, segments, x) if segments else x
        if not segments:
            for layer in layers:
                y = layer(y)
        (y * y).sum().backward()
        grads.append([backend.to_numpy(w.grad) for w in ws])
    for a, b in zip(*grads):
        np.testing.assert_allclose(b, a, atol=1e-12)


# --- what the strict device (MINIPAR_DEVICE=strict) cannot model: CuPy's own kernels and streams --
def test_scatter_adds_with_repeated_indices_match_numpy():
    """Backward of indexing, embedding and gather runs CuPy's add.at (atomic adds, CuPy >= 13);
    the strict device computes it with NumPy's, so only a GPU proves CuPy's."""
    rng = np.random.default_rng(3)
    x, ids = rng.standard_normal((5, 4)), np.array([[0, 2, 2], [4, 0, 0]])
    cases = [
        (lambda a: a[np.array([1, 1, 3])].sum(axis=0), (x,)),
        (lambda w: minipar.embedding(w, ids) * 2, (x,)),
        (lambda a: a.gather(1, np.array([[0, 3, 3]] * 5)) ** 2, (x,)),
        (lambda a: a.gather(0, np.array([[4, 4, 0, 1]])), (x,)),
    ]
    for fn, arrays in cases:
        cpu, gpu = run_both(fn, *arrays)
        for c, g in zip(cpu, gpu):
            np.testing.assert_allclose(g, c, rtol=1e-12, atol=1e-12)


def test_cupy_random_stream_replays():
    """CuPy's generator draws other numbers than NumPy's for a seed (strict uses NumPy's): the
    same seed must still give the same draws on the GPU, as checkpoint replay and ranks rely on."""
    minipar.manual_seed(7)
    a = minipar.randn(3, 4)
    minipar.manual_seed(7)
    b = minipar.randn(3, 4)
    assert backend.is_gpu_array(a.data) and a.dtype == np.float32
    np.testing.assert_array_equal(a.numpy(), b.numpy())
