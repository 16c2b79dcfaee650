"""The serial mixture of experts equals a token-by-token loop, with and without drops.

The oracle routes one token at a time: softmax of the router, the top-k, the gates (raw for
k = 1, renormalised for k >= 2), a running count per expert that drops an assignment once the
expert holds ``capacity`` of them, and each kept expert run on that token alone. Its loss adds
aux_coeff · l_aux explicitly; the MoE's loss does not (the autoscaler feeds the gradient), so
equal gradients prove the autoscaler. Everything in float64 to 1e-10.
"""
import math

import numpy as np
import pytest

import minipar
from minipar import Tensor, to_numpy
from minipar.nn import Block
from minipar.nn.moe import MoE, MoEBlock, capacity

TOL = 1e-10


def _moe(C=8, E=4, k=2, cf=1.25, seed=0, hidden=12, coeff=0.01):
    minipar.manual_seed(seed)
    return MoE(C, E, top_k=k, capacity_factor=cf, hidden=hidden, aux_coeff=coeff).double()


def _oracle(moe, x):
    """(y, l_aux, kept count per expert, dropped), one token at a time."""
    N, E, k = len(x), moe.n_experts, moe.top_k
    cap = N if moe.capacity_factor is None else math.ceil(moe.capacity_factor * N * k / E)
    count, assigned = [0] * E, np.zeros(E)
    probs = F_softmax(moe.router(x))
    rows = []
    for i in range(N):
        p = to_numpy(probs.data[i])
        top = sorted(range(E), key=lambda e: (-p[e], e))[:k]
        gates = [probs[i, e] for e in top]
        total = sum(gates[1:], gates[0])
        out = None
        for e, g in zip(top, gates):
            assigned[e] += 1
            if count[e] >= cap:
                continue  # the expert is full: this assignment contributes nothing
            count[e] += 1
            term = moe.experts[e](x[i:i + 1]) * (g if k == 1 else g / total)
            out = term if out is None else out + term
        rows.append(out if out is not None else Tensor(np.zeros((1, x.shape[1]))))
    y = minipar.concat(rows, axis=0)
    aux = E * (probs.mean(axis=0) * (assigned / (N * k))).sum()
    return y, aux, count, int(assigned.sum() - sum(count))


def F_softmax(z):
    from minipar import functional as F
    return F.softmax(z, axis=-1)


def _grads(module):
    return {n: to_numpy(p.grad) for n, p in module.named_parameters()}


def _err(a, b):
    return float(np.max(np.abs(np.asarray(to_numpy(a)) - np.asarray(to_numpy(b)))))


CASES = [  # (top_k, capacity_factor, expect drops)
    (1, None, False), (2, None, False), (2, 2.0, False), (1, 0.5, True), (2, 0.75, True),
    (3, 1.0, True),
]


@pytest.mark.parametrize("k,cf,drops", CASES)
def test_moe_equals_token_by_token_oracle(k, cf, drops):
    N, C = 24, 8
    x = np.random.default_rng(1).standard_normal((N, C))
    moe, twin = _moe(k=k, cf=cf), _moe(k=k, cf=cf)
    xa, xb = Tensor(x, requires_grad=True), Tensor(x, requires_grad=True)
    w = np.cos(np.arange(N * C)).reshape(N, C)
    y = moe(xa)
    (y * w).sum().backward()
    y_ref, aux_ref, kept, dropped = _oracle(twin, xb)
    ((y_ref * w).sum() + twin.aux_coeff * aux_ref).backward()
    r = moe.last_routing
    assert (r.dropped > 0) == drops and r.dropped == dropped
    assert list(r.kept_per_expert) == kept and r.capacity == capacity(N, 4, k, cf)
    assert _err(y.data, y_ref.data) < TOL
    assert abs(r.aux_loss - aux_ref.item()) < TOL
    assert _err(xa.grad, xb.grad) < TOL
    mine, ref = _grads(moe), _grads(twin)
    assert mine.keys() == ref.keys()
    for name in mine:
        assert _err(mine[name], ref[name]) < TOL, name


def test_capacity_formula_and_token_order():
    assert capacity(10, 4, 2, 1.25) == math.ceil(1.25 * 10 * 2 / 4) == 7
    assert capacity(10, 4, 1, None) == 10
    moe = _moe(C=4, E=2, k=1, cf=0.5)  # capacity ceil(0.5 * 6 / 2) = 2 per expert
    with minipar.no_grad():
        moe.router.weight.data[...] = 0
        moe.router.weight.data[0, 0] = 1.0  # expert 0 when x_0 > 0, else expert 1
        x = np.zeros((6, 4))
        x[:, 0] = [1, 1, -1, 1, -1, -1]  # expert 0 is chosen by tokens 0, 1, 3
        moe(Tensor(x))
    r = moe.last_routing
    assert r.expert[:, 0].tolist() == [0, 0, 1, 0, 1, 1]
    assert r.kept[:, 0].tolist() == [True, True, True, False, True, False]  # token order
    assert r.order.tolist() == [0, 1, 2, 4] and r.dropped == 2
    assert list(r.tokens_per_expert) == [3, 3] and list(r.kept_per_expert) == [2, 2]


def test_balance_loss_is_one_when_uniform_and_grows_with_imbalance():
    moe = _moe(C=4, E=4, k=2)
    x = Tensor(np.abs(np.random.default_rng(2).standard_normal((16, 4))) + 0.5)
    with minipar.no_grad():
        moe.router.weight.data[...] = 0  # p uniform: l_aux = E · Σ f_e / E = 1
        moe(x)
        assert abs(moe.last_routing.aux_loss - 1.0) < TOL
        moe.router.weight.data[0, 0], moe.router.weight.data[1, 0] = 80, 40  # p_0 ≈ 1
        moe(x)
    r = moe.last_routing  # every token picks experts 0 and 1: f = (1/2, 1/2, 0, 0), P_0 ≈ 1
    assert list(r.tokens_per_expert) == [16, 16, 0, 0] and abs(r.aux_loss - 2.0) < 1e-6
    assert r.load() == 2.0  # kept per expert (10, 10, 0, 0): max / mean = 10 / 5


def test_autoscaler_leaves_the_output_and_feeds_aux_gradient():
    """y is unchanged; the router's gradient of y·0 is exactly coeff · d(l_aux)."""
    x = np.random.default_rng(3).standard_normal((12, 8))
    moe, twin = _moe(coeff=0.5), _moe(coeff=0.5)
    moe.aux_scale = 0.25
    y = moe(Tensor(x))
    (y * 0).sum().backward()
    _, aux, _, _ = _oracle(twin, Tensor(x))
    (aux * (0.5 * 0.25)).backward()
    assert _err(moe.router.weight.grad, twin.router.weight.grad) < TOL
    assert np.abs(to_numpy(twin.router.weight.grad)).max() > 1e-6


def test_moe_block_mirrors_block_names():
    minipar.manual_seed(0)
    block, dense = MoEBlock(8, 2, n_experts=3, top_k=1).double(), Block(8, 2).double()
    names = {n for n, _ in block.named_parameters()}
    assert {n for n, _ in dense.named_parameters() if not n.startswith("mlp.")} == \
        {n for n in names if not n.startswith("mlp.")}
    assert "mlp.router.weight" in names and "mlp.experts.2.c_proj.bias" in names
    x = Tensor(np.random.default_rng(4).standard_normal((2, 5, 8)), requires_grad=True)
    y = block(x)
    y.sum().backward()
    assert y.shape == (2, 5, 8) and block.mlp.last_routing.expert.shape == (10, 1)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n_experts=4, top_k=5), "top_k"), (dict(n_experts=0, top_k=1), "n_experts"),
    (dict(n_experts=4, capacity_factor=0), "capacity_factor"),
])
def test_bad_configuration_is_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        MoE(8, **kwargs)


def test_wrong_width_is_named():
    with pytest.raises(ValueError, match="last axis must be 8"):
        _moe()(Tensor(np.zeros((3, 5))))
