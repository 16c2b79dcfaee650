"""``memory_bytes()`` of every wrapper and of the optimizer partitions what the rank holds: each
kind once, no total beside its parts, so the values of one dict sum to the rank's bytes. One
launch of 2 ranks, a mixed-precision MLP (float16 parameters, AdamW's float32 masters), each
wrapper measured after backward and after a step."""
from minipar.testing import run_on_ranks

WRAPPERS = ("ZeRO-1", "ZeRO-2", "ZeRO3", "ParameterServer", "ParameterServer sharded",
            "AllReduceOptimizer", "Optimizer")
KINDS = {"Optimizer": ["params", "grads", "master", "moments"],
         "ZeRO3": ["parameters", "gradients", "master", "moments", "gathered"]}


def held_body():
    """{wrapper: (its memory_bytes() after the second backward, the bytes it holds: parameters
    + gradients (+ gathered) as it counts them, and its optimizer's state arrays)}."""
    import numpy as np

    import minipar
    from minipar import comm, nn, optim
    from minipar.parallel.data import AllReduceOptimizer, ParameterServer, ZeRO, ZeRO3

    world = comm.world()
    adamw = lambda params: optim.AdamW(params, lr=1e-3)  # noqa: E731
    x = minipar.Tensor(np.random.default_rng(world.rank).normal(size=(4, 6)).astype("float16"))
    found = {}
    for name in WRAPPERS:
        minipar.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)).astype("float16")
        wrapper = {"ZeRO-1": lambda: ZeRO(model, adamw, world, stage=1),
                   "ZeRO-2": lambda: ZeRO(model, adamw, world, stage=2),
                   "ZeRO3": lambda: ZeRO3(model, adamw, world),
                   "ParameterServer": lambda: ParameterServer(model, adamw, world),
                   "ParameterServer sharded": lambda: ParameterServer(model, adamw, world,
                                                                      sharded=True),
                   "AllReduceOptimizer": lambda: AllReduceOptimizer(model, adamw, world),
                   "Optimizer": lambda: adamw(model.parameters())}[name]()
        for _ in range(2):
            wrapper.zero_grad()
            y = model(x)
            (y * y).sum().backward()
            held = wrapper.memory_bytes()
            wrapper.step()
        inner = wrapper if name == "Optimizer" else wrapper.optimizer
        state = inner.state_bytes() if inner is not None else 0
        own = [k for k in ("parameters", "gradients", "gathered", "params", "grads") if k in held]
        found[name] = (held, sum(held[k] for k in own) + state)
    return found


def test_the_kinds_of_memory_bytes_sum_to_what_the_rank_holds():
    for rank, found in enumerate(run_on_ranks(held_body, 2, timeout=120)):
        for name, (held, total) in found.items():
            kinds = KINDS.get(name, ["parameters", "gradients", "master", "moments"])
            assert list(held) == kinds, (rank, name, held)
            assert sum(held.values()) == total, (rank, name, held, total)
            assert held["master"] > 0 or name == "ParameterServer" and rank == 1, (rank, name)
