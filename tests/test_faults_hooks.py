"""The stateful communication hooks (hooks/state.py) when something goes wrong, on 2 ranks:

- an inf or NaN on one rank under GradScaler: the step is skipped on every rank and the hook's
  state (error feedback, residuals, P and Q memories, the step count) is the one from before
  that step, so only that step is skipped: skipped = [False, True, False, False];
- the per-step agreement is outside the counters: every step's bytes, the first too, are the
  formula's (PowerSGD, top-k, signs).
"""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, BAD_STEP = 4, 1


def hooks_cases():
    from minipar.parallel.data import hooks
    memories = ("error_dict", "p_memory_dict", "q_memory_dict", "iter", "rng")
    return {"sign": (hooks.SignState, hooks.sign_hook, float("inf"), ("error_dict",)),
            "top-k": (lambda: hooks.TopKState(k=3), hooks.topk_hook, float("nan"),
                      ("error_dict",)),
            "PowerSGD": (lambda: hooks.PowerSGDState(None, 1, start_powerSGD_iter=0),
                         hooks.powerSGD_hook, float("inf"), memories)}


def kept(state, names):
    """A copy of what the hook carries to the next step, arrays as NumPy."""
    from minipar import backend
    out = {}
    for name in names:
        value = getattr(state, name)
        if isinstance(value, dict):
            out[name] = {i: backend.to_numpy(a).copy() for i, a in value.items()}
        elif name == "rng":
            out[name] = value.get_state()[1].copy()
        else:
            out[name] = value
    return out


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b


def skipped_step_body():
    import minipar
    from minipar import comm, nn, optim
    from minipar import functional as F
    from minipar.amp import GradScaler
    from minipar.parallel.data import DistributedDataParallel

    world, failures = comm.world(), []
    for name, (make, hook, bad, names) in hooks_cases().items():
        for overlap in (False, True):
            what = f"rank {world.rank}: {name} overlap={overlap}"
            minipar.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
            ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.0003, overlap=overlap)
            state = make()
            ddp.register_comm_hook(state, hook)
            opt, scaler = optim.SGD(ddp.parameters(), lr=0.1), GradScaler()
            skipped, states = [], []
            for step in range(STEPS):
                x = np.random.default_rng([step, world.rank]).standard_normal((4, 6))
                if step == BAD_STEP and world.rank == 1:
                    x[0, 0] = bad
                opt.zero_grad()
                loss = F.cross_entropy(ddp(minipar.tensor(x.astype(np.float32))),
                                       np.zeros(4, int))
                scaler.scale(loss).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped.append(scaler.get_scale() < before)
                states.append(kept(state, names))
            if skipped != [step == BAD_STEP for step in range(STEPS)]:
                failures.append(f"{what}: skipped {skipped}")
            if not same(states[BAD_STEP], states[BAD_STEP - 1]):
                failures.append(f"{what}: the skipped step changed the hook's state")
            left = sum(int(np.sum(~np.isfinite(a))) for a in state.error_dict.values())
            if left:
                failures.append(f"{what}: {left} non-finite entries left in error_dict")
    return failures


@pytest.mark.mpi
@pytest.mark.fault
def test_a_skipped_step_leaves_every_hooks_state_as_it_was():
    failures = sum(run_on_ranks(skipped_step_body, 2, timeout=300,
                                env={"MINIPAR_TIMEOUT": "10"}), [])
    assert not failures, "\n".join(failures)


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
