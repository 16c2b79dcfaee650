"""Shared by the data-parallel tests and lessons: tiny models, data, and k training steps run
serially or under one of the data-parallel strategies (DDP, parameter server, ZeRO).

Every rank builds the same model from ``manual_seed(0)``; the serial twin trains on the global
batch (consecutive entries of the sampler's permutation), each rank on its local share.
"""
import numpy as np

import minipar
import minipar.nn as nn
from minipar import functional as F
from minipar import optim
from minipar.parallel.data import DistributedDataParallel, DistributedSampler, ParameterServer, ZeRO

STEPS, GLOBAL_BATCH = 3, 12
OPTIMIZERS = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def make_model(kind, dtype, seed=0):
    minipar.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                              nn.Linear(16, 4))
    else:
        model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8))
    return model.astype(dtype)


def make_data(kind, dtype, n=STEPS * GLOBAL_BATCH):
    rng = np.random.default_rng(1)
    if kind == "mlp":
        return rng.standard_normal((n, 6)).astype(dtype), rng.integers(0, 4, n)
    ids = rng.integers(0, 11, (n, 7))
    return ids[:, :-1], ids[:, 1:]


def loss_of(kind, model, x, y):
    if kind == "mlp":
        return F.cross_entropy(model(minipar.tensor(x)), y)
    return model(x, y)[1]


def train(kind, dtype, opt, strategy="serial", comm=None, steps=STEPS, **options):
    """Parameters (host arrays) after ``steps`` steps of ``strategy``."""
    model = make_model(kind, dtype)
    x, y = make_data(kind, dtype)
    make_opt = OPTIMIZERS[opt]
    if strategy == "serial":
        order = DistributedSampler(len(x), 1, 0, seed=5).permutation()
        batches = [order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH] for s in range(steps)]
    else:
        batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    accumulate = options.pop("accumulate", 1)
    if strategy in ("serial", "ddp"):
        net = DistributedDataParallel(model, comm, **options) if strategy == "ddp" else model
        optimizer = make_opt(model.parameters())
        update, clear = optimizer.step, optimizer.zero_grad
    else:
        runner = (ParameterServer(model, make_opt, comm, **options) if strategy == "ps"
                  else ZeRO(model, make_opt, comm, **options))
        net, update, clear = model, runner.step, runner.zero_grad
    for idx in batches[:steps]:
        clear()
        parts = np.array_split(idx, accumulate)
        for m, part in enumerate(parts):  # gradient accumulation: no_sync for all but the last
            scale = len(part) / len(idx)
            if m < len(parts) - 1:
                with net.no_sync():
                    (loss_of(kind, net, x[part], y[part]) * scale).backward()
            else:
                (loss_of(kind, net, x[part], y[part]) * scale).backward()
        update()
    return [minipar.to_numpy(p.data).copy() for p in model.parameters()]


def max_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))
