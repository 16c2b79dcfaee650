"""The stateful communication hooks (hooks/state.py) when something goes wrong, on 2 ranks:

- the per-step agreement is outside the counters: every step's bytes, the first too, are the
  formula's (PowerSGD, top-k, signs).
"""
import numpy as np
import pytest

from minipar.testing import run_on_ranks


def bytes_body():
    """Bytes each step by the counters against the formula, the first step too (it used to
    carry the agreement): the ring all-reduce of n elements sends n s on 2 ranks."""
    import minipar
    from minipar import comm, nn
    from minipar import functional as F
    from minipar.parallel.data import DistributedDataParallel, hooks
    from minipar.parallel.data.hooks.powersgd import should_compress

    world, failures = comm.world(), []
    cases = {"PowerSGD": (hooks.PowerSGDState(None, 1, start_powerSGD_iter=0),
                          hooks.powerSGD_hook),
             "top-k": (hooks.TopKState(k=3), hooks.topk_hook),
             "sign": (hooks.SignState(), hooks.sign_hook)}
    for name, (state, hook) in cases.items():
        minipar.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        ddp = DistributedDataParallel(model, world, algorithm="ring")
        ddp.register_comm_hook(state, hook)
        n = sum(buf.size for buf in ddp.grad_buffers)
        if name == "PowerSGD":  # P, Q and the uncompressed entries, 4 bytes each
            shapes = [(p.shape[0], p.size // p.shape[0]) for p in model.parameters()]
            want = 4 * sum(c if ok else numel for ok, numel, c in
                           (should_compress(a, b, 1, 2) for a, b in shapes))
        else:  # (p - 1) k (4 + 4) and (p - 1) (ceil(n/8) + 4) for the one bucket
            want = 3 * 8 if name == "top-k" else -(-n // 8) + 4
        sent = []
        for step in range(3):
            world.counters.reset()
            x = np.random.default_rng([step, world.rank]).standard_normal((4, 6))
            F.cross_entropy(ddp(minipar.tensor(x.astype(np.float32))),
                            np.zeros(4, int)).backward()
            sent.append(world.counters.bytes_sent)
        if sent != [want] * 3:
            failures.append(f"rank {world.rank}: {name} sent {sent} bytes a step, formula {want}")
    return failures


@pytest.mark.mpi
def test_the_agreement_is_not_in_the_counters():
    failures = sum(run_on_ranks(bytes_body, 2, timeout=120), [])
    assert not failures, "\n".join(failures)
