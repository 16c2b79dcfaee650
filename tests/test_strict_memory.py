"""ActivationMemory counts the same bytes on the strict device as on NumPy: a buffer counts once
by its owner, and a strict view holds its owner (as a CuPy view holds its ``.base``), so the
owner is one object for as long as a view of it lives."""
import gc
import weakref

import numpy as np

import minipar
from minipar import backend, nn
from minipar.backend import strict as xp
from minipar.memory import ActivationMemory


def test_a_view_keeps_one_owner_after_the_owner_is_dropped():
    a = xp.asarray(np.arange(6.0).reshape(2, 3))
    view = a[0]
    del a
    owner = weakref.ref(view.base)
    gc.collect()
    assert owner() is view.base and view.reshape(3).base is view.base
    assert xp.ascontiguousarray(view.base) is view.base  # NumPy returns the same array: one


def gpt_peak(device):
    backend.set_device(device)
    minipar.manual_seed(0)
    config = nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = nn.GPT(config)
    x = np.random.default_rng(0).integers(0, 16, (3, 9))
    ids, targets = (backend.asarray(np.ascontiguousarray(a)) for a in (x[:, :-1], x[:, 1:]))
    with ActivationMemory() as mem:
        model(ids, targets)[1].backward()
    return mem.peak_bytes


def test_activation_memory_of_a_gpt_is_the_same_on_strict_as_on_numpy():
    assert gpt_peak("strict") == gpt_peak("cpu") == 38012
