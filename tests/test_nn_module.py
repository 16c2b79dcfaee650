"""Module API: parameter discovery and names, modes, state_dict round trips and load errors."""
import numpy as np
import pytest

import minipar
from minipar import to_numpy
import minipar.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.norm = nn.BatchNorm2d(4)
        self.fc2 = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_named_parameters_order_and_names():
    names = [n for n, _ in Net().named_parameters()]
    assert names == ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in Net().parameters())


def test_same_seed_same_parameters():
    minipar.manual_seed(7)
    a = Net().state_dict()
    minipar.manual_seed(7)
    b = Net().state_dict()
    for k in a:
        np.testing.assert_array_equal(to_numpy(a[k]), to_numpy(b[k]))


def test_shared_parameter_listed_once():
    model = nn.GPT(nn.GPTConfig(vocab_size=11, n_layer=1, n_embd=8, n_head=2, tie_weights=True))
    names = [n for n, _ in model.named_parameters()]
    assert "embed.wte.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(id(p) for p in model.parameters()))


def test_children_modules_and_modes():
    net = Net()
    assert [type(m).__name__ for m in net.children()] == ["Linear", "ReLU", "BatchNorm2d", "Linear"]
    assert [n for n, _ in net.named_modules()] == ["", "fc1", "act", "norm", "fc2"]
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())


def test_zero_grad_and_astype():
    net = Net().double()
    net(minipar.tensor(np.ones((2, 3)))).sum().backward()
    assert net.fc1.weight.grad.dtype == np.float64 and net.norm.running_var.dtype == np.float64
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_state_dict_round_trip_with_buffers():
    a, b = Net(), Net()
    a.norm.running_mean[...] = 3.0
    state = {k: v.copy() for k, v in a.state_dict().items()}
    assert list(state)[-2:] == ["norm.running_mean", "norm.running_var"]
    missing, unexpected = b.load_state_dict(state)
    assert missing == [] and unexpected == []
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(to_numpy(v), to_numpy(state[k]))


def test_load_state_dict_names_every_problem():
    net = Net()
    state = {k: v.copy() for k, v in net.state_dict().items()}
    del state["fc1.bias"], state["norm.running_var"]
    state["extra.weight"] = np.zeros(3)
    state["fc2.weight"] = np.zeros((5, 4))
    state["norm.weight"] = np.zeros(7)
    with pytest.raises(KeyError) as err:
        net.load_state_dict(state)
    msg = str(err.value)
    for text in ["missing keys: fc1.bias, norm.running_var", "unexpected keys: extra.weight",
                 "fc2.weight: checkpoint (5, 4) vs model (2, 4)",
                 "norm.weight: checkpoint (7,) vs model (4,)"]:
        assert text in msg
    before = net.fc1.weight.numpy().copy()
    with pytest.raises(KeyError):  # nothing is changed by a failed load
        net.load_state_dict(state)
    np.testing.assert_array_equal(net.fc1.weight.numpy(), before)


def test_load_state_dict_non_strict_reports_but_loads():
    net = Net()
    state = {"fc1.bias": np.full(4, 2.0), "other": np.zeros(1)}
    missing, unexpected = net.load_state_dict(state, strict=False)
    assert unexpected == ["other"] and "fc1.weight" in missing
    np.testing.assert_array_equal(net.fc1.bias.numpy(), np.full(4, 2.0, np.float32))


def test_load_state_dict_mis_shaped_alone_is_an_error():
    net = Net()
    state = dict(net.state_dict(), **{"fc1.bias": np.zeros(5)})
    with pytest.raises(KeyError, match=r"mis-shaped keys: fc1.bias: checkpoint \(5,\)"):
        net.load_state_dict(state)


def test_sequential_index_slice_len_iter():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[1], nn.ReLU) and seq[-1] is list(seq)[2]
    head, tail = seq[:2], seq[2:]
    assert isinstance(head, nn.Sequential) and len(tail) == 1
    x = minipar.tensor(np.arange(4.0).reshape(2, 2))
    np.testing.assert_allclose(seq(x).numpy(), tail(head(x)).numpy())
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_module_list_registers_but_has_no_forward():
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert len(layers.parameters()) == 6 and len(layers[1:]) == 2
    with pytest.raises(TypeError):
        layers(minipar.tensor(np.ones((1, 2))))


def test_missing_super_init_is_explained():
    class Bad(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="super"):
        Bad().parameters()


def test_gpt_to_sequential_gives_the_same_logits():
    minipar.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_embd=16, n_head=2))
    ids = np.random.default_rng(0).integers(0, 13, (2, 8))
    logits, _ = model(ids)
    np.testing.assert_allclose(model.to_sequential()(ids).numpy(), logits.numpy())
    assert len(model.to_sequential()) == 2 + 3
