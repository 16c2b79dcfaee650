"""Layers and the tiny GPT against PyTorch (float64), plus dropout and sampling behaviour."""
import warnings
from contextlib import nullcontext

import numpy as np
import pytest

import minipar
import minipar.nn as nn
from minipar import backend, optim
from nn_torch_twins import (assert_grads_match, cpu_and_gpu, requires_torch, torch, torch_block,
                            torch_params)

TF = torch.nn.functional if torch else None
RNG = np.random.default_rng(0)


def run_both(module, x, torch_fn):
    """Forward both, backward a random projection; return the torch params and input."""
    module.double()
    xt = torch.tensor(x, requires_grad=x.dtype.kind == "f")
    P = torch_params(module)
    ours = module(minipar.tensor(x, requires_grad=x.dtype.kind == "f")
                  if x.dtype.kind == "f" else x)
    theirs = torch_fn(P, xt)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-10, atol=1e-12)
    proj = RNG.standard_normal(ours.shape)
    ours.backward(proj)
    (theirs * torch.tensor(proj)).sum().backward()
    assert_grads_match(module, P)
    return P, xt


@requires_torch
def test_linear():
    run_both(nn.Linear(5, 3), RNG.standard_normal((2, 4, 5)),
             lambda P, x: TF.linear(x, P["weight"], P["bias"]))


def test_linear_init_bound_matches_torch_default():
    w = nn.Linear(400, 300).weight.numpy()
    assert np.abs(w).max() <= 1 / 20 and np.abs(w).max() > 0.049
    assert abs(w.std() - (1 / 20) / np.sqrt(3)) < 1e-3


@requires_torch
def test_embedding():
    run_both(nn.Embedding(7, 4), RNG.integers(0, 7, (3, 5)),
             lambda P, ids: TF.embedding(ids, P["weight"]))


@requires_torch
def test_layer_norm():
    ln = nn.LayerNorm(6)
    ln.weight.data[...] = RNG.standard_normal(6)
    run_both(ln, RNG.standard_normal((2, 3, 6)),
             lambda P, x: TF.layer_norm(x, (6,), P["weight"], P["bias"]))


@requires_torch
def test_mlp():
    run_both(nn.MLP(8), RNG.standard_normal((2, 3, 8)), lambda P, x: TF.linear(
        TF.gelu(TF.linear(x, P["c_fc.weight"], P["c_fc.bias"]), approximate="tanh"),
        P["c_proj.weight"], P["c_proj.bias"]))


@requires_torch
def test_causal_self_attention():
    def torch_attn(P, x):
        B, T, C = x.shape
        q, k, v = TF.linear(x, P["c_attn.weight"], P["c_attn.bias"]).view(
            B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return TF.linear(y.transpose(1, 2).reshape(B, T, C), P["c_proj.weight"], P["c_proj.bias"])

    run_both(nn.CausalSelfAttention(8, 2), RNG.standard_normal((2, 5, 8)), torch_attn)


@requires_torch
def test_block():
    _, xt = run_both(nn.Block(8, 2), RNG.standard_normal((2, 5, 8)),
                     lambda P, x: torch_block(P, x, 2))
    assert xt.grad is not None


@requires_torch
@pytest.mark.parametrize("tie", [False, True])
def test_gpt_loss_and_grads(tie):
    cfg = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, tie_weights=tie)
    minipar.manual_seed(1)
    model = nn.GPT(cfg).double()
    ids, targets = RNG.integers(0, 11, (3, 6)), RNG.integers(0, 11, (3, 6))
    logits, loss = model(ids, targets)
    loss.backward()
    P = torch_params(model)
    idt = torch.tensor(ids)
    x = TF.embedding(idt, P["embed.wte.weight"]) + P["embed.wpe.weight"][:6]
    for i in range(cfg.n_layer):
        x = torch_block(P, x, cfg.n_head, prefix=f"blocks.{i}.")
    x = TF.layer_norm(x, (8,), P["ln_f.weight"], P["ln_f.bias"])
    head = P["embed.wte.weight"] if tie else P["lm_head.weight"]
    ref = TF.cross_entropy(TF.linear(x, head).reshape(-1, 11), torch.tensor(targets).reshape(-1))
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-12
    assert logits.shape == (3, 6, 11)
    assert_grads_match(model, P)


def test_gpt_initial_loss_is_near_log_vocab():
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=50, n_layer=1, n_embd=32))
    ids = RNG.integers(0, 50, (4, 16))
    _, loss = model(ids, ids)
    assert abs(loss.item() - np.log(50)) < 0.1
    with pytest.raises(ValueError, match="block_size"):
        model(RNG.integers(0, 50, (1, 33)))


def test_dropout_module_modes_and_replay():
    drop = nn.Dropout(0.5)
    x = minipar.ones(1000)
    minipar.manual_seed(3)
    a = drop(x).numpy()
    minipar.manual_seed(3)
    b = drop(x).numpy()
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) == {0.0, 2.0} and 400 < (a == 0).sum() < 600
    drop.eval()
    np.testing.assert_array_equal(drop(x).numpy(), x.numpy())


def test_generate_is_seeded_and_keeps_training_mode():
    model = nn.GPT(nn.GPTConfig(vocab_size=9, block_size=4, n_layer=1, n_embd=8, n_head=2))
    start = np.zeros((2, 1), dtype=np.int64)
    minipar.manual_seed(5)
    a = model.generate(start, 6, top_k=3)
    minipar.manual_seed(5)
    b = nn.generate(model, start, 6, top_k=3)
    assert a.shape == (2, 7) and (a >= 0).all() and (a < 9).all()
    np.testing.assert_array_equal(a, b)
    assert model.training


@pytest.mark.gpu
def test_gpt_on_gpu_matches_cpu():
    cfg = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8)
    ids = RNG.integers(0, 11, (2, 6))

    def train_step():
        minipar.manual_seed(0)
        model = nn.GPT(cfg).double()
        _, loss = model(backend.asarray(ids), backend.asarray(ids))
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        optim.AdamW(model.parameters(), lr=0.1).step()
        return [loss.data] + grads + [p.data for p in model.parameters()]

    for a, b in zip(*cpu_and_gpu(train_step)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def channel_masks(y, x):
    """Each channel's factor y/x, checked constant over the channel's values: (N, C)."""
    factors = (y / x).reshape(y.shape[0], y.shape[1], -1)
    np.testing.assert_allclose(factors, factors[..., :1].repeat(factors.shape[-1], -1))
    return factors[..., 0]


@requires_torch
@pytest.mark.parametrize("shape", [(64, 32, 3, 4), (64, 32, 5)])
def test_dropout2d_zeroes_whole_channels_as_torch_does(shape):
    """Dropout2d (torch's semantics): one draw per channel x[n, c] (a 3-D input is (N, C, L), as
    torch reads it, with its warning), kept channels scaled by 1/(1-p), dropped ones zero; the
    fraction dropped is p (2048 channels: 5 standard deviations is 0.05)."""
    p = 0.3
    x = RNG.uniform(1, 2, shape)
    for name, module, run in (
            ("minipar", nn.Dropout2d(p=p), lambda m: m(minipar.tensor(x)).numpy()),
            ("torch", torch.nn.Dropout2d(p=p) if torch else None,
             lambda m: m(torch.tensor(x)).numpy())):
        told = pytest.warns(UserWarning, match="3D|3-D") if len(shape) == 3 else nullcontext()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no other warning: a 4-D input warns of nothing
            with told:
                masks = channel_masks(run(module), x)
        assert set(np.unique(masks.round(12))) == {0.0, round(1 / (1 - p), 12)}, name
        assert abs((masks == 0).mean() - p) < 0.05, name


def test_dropout2d_gradient_eval_and_replay():
    """The gradient is the output's mask times the incoming gradient; the same seed draws the
    same channels; eval mode (and p = 0) is the identity; torch's bad arguments are refused."""
    drop = nn.Dropout2d(0.5)
    x = minipar.tensor(RNG.uniform(1, 2, (8, 6, 4, 4)), requires_grad=True)
    minipar.manual_seed(5)
    y = drop(x)
    minipar.manual_seed(5)
    np.testing.assert_array_equal(drop(x).numpy(), y.numpy())
    masks = channel_masks(y.numpy(), x.numpy())
    proj = RNG.standard_normal(y.shape)
    y.backward(proj)
    np.testing.assert_allclose(minipar.to_numpy(x.grad), proj * masks[:, :, None, None])
    assert 0 < (masks == 0).sum() < masks.size
    drop.eval()
    assert drop(x) is x
    assert nn.Dropout2d(0.0)(x) is x
    with pytest.raises(ValueError, match="probability"):
        nn.Dropout2d(p=1.5)
    with pytest.raises(ValueError, match="inplace"):
        nn.Dropout2d(inplace=True)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        nn.Dropout2d()(minipar.ones((2, 3)))
    assert repr(nn.Dropout2d(0.25)) == "Dropout2d(p=0.25)"
