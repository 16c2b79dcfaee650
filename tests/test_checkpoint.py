"""Gradient checkpointing: the same gradients as the plain run, and the memory it promises."""
import numpy as np
import pytest

import minipar
from minipar import to_numpy
import minipar.functional as F
from minipar.checkpoint import checkpoint, checkpoint_sequential, is_recomputing
from minipar.memory import ActivationMemory


class Layer:
    """x -> dropout(gelu(x Wᵀ + b)), written with functional ops (no nn needed)."""

    def __init__(self, d, rng, p_drop=0.1):
        self.w = minipar.tensor(rng.standard_normal((d, d)) / np.sqrt(d), requires_grad=True)
        self.b = minipar.tensor(rng.standard_normal(d) * 0.1, requires_grad=True)
        self.p_drop = p_drop

    def __call__(self, x):
        return F.dropout(F.gelu(F.linear(x, self.w, self.b)), self.p_drop)


def make_net(n=16, d=32, seed=0):
    rng = np.random.default_rng(seed)
    return [Layer(d, rng) for _ in range(n)], rng.standard_normal((8, d))


def train_step(layers, x_data, segments):
    """One forward/backward; returns (grads, peak activation bytes, live bytes after)."""
    params = [p for layer in layers for p in (layer.w, layer.b)]
    for p in params:
        p.grad = None
    x = minipar.tensor(x_data, requires_grad=True)
    minipar.manual_seed(42)
    with ActivationMemory() as mem:
        if segments:
            y = checkpoint_sequential(layers, segments, x)
        else:
            y = x
            for layer in layers:
                y = layer(y)
        loss = (y * y).mean()
        loss.backward()
    return [x.grad] + [p.grad for p in params], mem.peak_bytes, mem.live_bytes, loss.item()


@pytest.mark.parametrize("segments", [1, 2, 4, 5, 16])
def test_same_gradients_as_plain_run_with_dropout(segments):
    layers, x = make_net()
    plain, _, _, loss0 = train_step(layers, x, 0)
    ckpt, _, live, loss1 = train_step(layers, x, segments)
    assert loss0 == loss1
    for a, b in zip(plain, ckpt):
        np.testing.assert_allclose(to_numpy(b), to_numpy(a), rtol=0, atol=1e-12)
    assert live == 0  # everything saved for backward was released


def test_sqrt_n_segments_halve_peak_activation_memory():
    layers, x = make_net(n=16)
    _, plain_peak, _, _ = train_step(layers, x, 0)
    _, sqrt_peak, _, _ = train_step(layers, x, 4)
    _, every_peak, _, _ = train_step(layers, x, 16)
    assert sqrt_peak <= 0.5 * plain_peak, (sqrt_peak, plain_peak)
    assert every_peak <= 0.5 * plain_peak
    assert plain_peak > 0


def test_dropout_masks_replayed_and_stream_not_disturbed():
    """Recomputation rewinds the random stream for itself only: later draws are unchanged."""
    layers, x = make_net(n=4)
    x = minipar.tensor(x, requires_grad=True)
    minipar.manual_seed(7)
    y = checkpoint(lambda h: layers[1](layers[0](h)), x)
    state_after_forward = minipar.get_rng_state()
    y.sum().backward()
    assert minipar.get_rng_state() == state_after_forward


def test_checkpoint_reaches_parameters_when_input_needs_no_grad():
    layers, x = make_net(n=3)
    y = checkpoint(lambda h: layers[1](layers[0](h)), minipar.tensor(x))
    assert y.requires_grad
    y.sum().backward()
    assert layers[0].w.grad is not None and layers[1].b.grad is not None


def test_is_recomputing_is_true_only_during_the_replay():
    seen = []

    def fn(h):
        seen.append(is_recomputing())
        return h * 2

    x = minipar.tensor([1.0, 2.0], requires_grad=True)
    checkpoint(fn, x).sum().backward()
    assert seen == [False, True]
    assert not is_recomputing()


def test_no_graph_no_recompute():
    x = minipar.tensor([1.0, 2.0])
    y = checkpoint(lambda h: h * 2, x)
    assert not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])


def test_bad_segment_counts():
    layers, _ = make_net(n=3)
    with pytest.raises(ValueError, match=r"segments must be an integer between 1 and the number "
                                         r"of modules \(3\), got 4"):
        checkpoint_sequential(layers, 4, minipar.tensor(np.zeros((1, 32))))
    with pytest.raises(ValueError, match="got 0"):
        checkpoint_sequential(layers, 0, minipar.tensor(np.zeros((1, 32))))


def test_fn_must_return_a_tensor():
    with pytest.raises(TypeError, match="fn must return one Tensor, got tuple"):
        checkpoint(lambda h: (h, h), minipar.tensor([1.0], requires_grad=True))


def test_memory_tracker_counts_distinct_buffers_and_releases():
    x = minipar.tensor(np.ones((4, 8)), requires_grad=True)
    with ActivationMemory() as mem:
        h = x.tanh()        # saves its output: 4·8·8 bytes
        v = h.reshape(32)   # a view: same buffer, not counted again
        y = (v * v).sum()   # mul saves v (the same buffer again)
        assert mem.live_bytes == 4 * 8 * 8
        y.backward()
        assert mem.live_bytes == 0
        assert mem.peak_bytes == 256
