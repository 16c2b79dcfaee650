"""Top-k and sign communication hooks (minipar/parallel/data/hooks/topk.py, sign.py) on 2, 3 and
4 ranks, float64, K steps of known gradients g_r^t (every rank can draw every rank's):

    applied^t = the hook's result, the same bits on every rank
    sum_t applied^t + (1/p) sum_r residual_r^K = sum_t (1/p) sum_r g_r^t     (within 1e-10)

since each rank's sent c_r^t = g_r^t + e_r^(t-1) - e_r^t telescopes (error feedback). Also: each
step equals a serial twin of the hook, the bytes each rank sends by the counters equal
(p-1) k (8 + 4) (top-k, int32 indices) and (p-1) (ceil(n/8) + 4) (signs), and a rank with another
k is the same ValueError on every rank, naming the settings. One launch per rank count."""
import math

import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, SIZES = 6, (100, 13)  # two buckets: index 0 of 100 entries, index 1 of 13


class Bucket:
    """A stand-in for DDP's GradBucket: this rank's flat gradient, its index, its communicator."""

    def __init__(self, buffer, index, comm):
        self._buffer, self._index, self.comm = buffer, index, comm

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def parameters(self):
        return []

    def gradients(self):
        return [self._buffer]

    def is_last(self):
        return self._index == len(SIZES) - 1


def gradient(step, rank, index):
    """Rank ``rank``'s gradient of bucket ``index`` at ``step``; a few ties and zeros in it."""
    g = np.random.default_rng([step, rank, index]).standard_normal(SIZES[index])
    g[:4] = [0.5, -0.5, 0.5, 0.0]
    return g


def twin_topk(p_r, k):
    """Serial top-k of one rank: the k largest |p| (ties to the lower index), the residual."""
    chosen = np.argsort(-np.abs(p_r), kind="stable")[:k]
    sent = np.zeros_like(p_r)
    sent[chosen] = p_r[chosen]
    return sent


def twin_sign(p_r):
    scale = np.float64(np.float32(np.abs(p_r).mean()))
    return scale * np.where(p_r >= 0, 1.0, -1.0)


def sparse_body():
    from minipar import comm
    from minipar.parallel.data.hooks.sign import SignState, sign_hook
    from minipar.parallel.data.hooks.topk import TopKState, topk_hook

    world = comm.world()
    p, rank = world.size, world.rank
    failures = []
    cases = {"topk ratio=0.1": (lambda: TopKState(ratio=0.1), topk_hook, twin_topk),
             "topk k=3": (lambda: TopKState(k=3), topk_hook, twin_topk),
             "sign": (lambda: SignState(), sign_hook, twin_sign)}
    for name, (make, hook, twin) in cases.items():
        for feedback in (True, False):
            state = make()
            state.use_error_feedback = feedback
            what = f"rank {rank}: {name} error_feedback={feedback}"
            residuals = {(r, i): np.zeros(n) for r in range(p) for i, n in enumerate(SIZES)}
            applied = [np.zeros(n) for n in SIZES]
            true = [np.zeros(n) for n in SIZES]
            for step in range(STEPS):
                for i, n in enumerate(SIZES):
                    before = world.counters.snapshot()
                    got = hook(state, Bucket(gradient(step, rank, i), i, world))
                    sent = world.counters.bytes_sent - before["bytes_sent"]
                    k = state.k_for(n) if hasattr(state, "k_for") else None
                    want = (p - 1) * (k * (8 + 4) if k else math.ceil(n / 8) + 4)
                    if sent != want or world.counters.bytes_received - before[
                            "bytes_received"] != want:
                        failures.append(f"{what}: bucket {i} sent {sent} bytes, formula {want}")
                    # the twin: each rank's sent vector from its p_r = g_r + e_r
                    expect = np.zeros(n)
                    for r in range(p):
                        p_r = gradient(step, r, i) + residuals[r, i]
                        c_r = twin(p_r, k) if k else twin(p_r)
                        residuals[r, i] = p_r - c_r if feedback else np.zeros(n)
                        expect += c_r
                    if np.abs(got - expect / p).max() > 1e-12:
                        failures.append(f"{what}: bucket {i} step {step} differs from the twin")
                    everyone = world.all_gather_object(got.tobytes())
                    if any(b != everyone[0] for b in everyone):
                        failures.append(f"{what}: bucket {i} step {step} differs across ranks")
                    applied[i] += got
                    true[i] += sum(gradient(step, r, i) for r in range(p)) / p
            for i in range(len(SIZES)):
                mine = state.error_dict.get(i, np.zeros(SIZES[i]))
                mean_residual = sum(world.all_gather_object(mine)) / p
                gap = np.abs(applied[i] + mean_residual - true[i]).max()
                if feedback and gap > 1e-10:
                    failures.append(f"{what}: bucket {i}: the identity is off by {gap:.3g}")
                if not feedback and (state.error_dict or gap < 1e-3):
                    failures.append(f"{what}: bucket {i}: no feedback kept a residual")
    # another k on one rank: the same ValueError on every rank, naming each rank's setting
    try:
        topk_hook(TopKState(ratio=0.2 if rank == 1 else 0.1), Bucket(gradient(0, rank, 0), 0,
                                                                      world))
        failures.append(f"rank {rank}: ranks with different k were not refused")
    except ValueError as error:
        if "TopKState" not in str(error) or "ratio (rank 0: 0.1, rank 1: 0.2" not in str(error):
            failures.append(f"rank {rank}: unclear refusal: {error}")
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_topk_and_sign_feed_back_errors_exactly_and_send_the_formula_bytes(nprocs):
    results = run_on_ranks(sparse_body, nprocs, timeout=300, env={"MINIPAR_TIMEOUT": "10"})
    failures = sum(results, [])
    assert not failures, "\n".join(failures)


def test_the_states_refuse_bad_settings():
    from minipar.parallel.data.hooks.topk import TopKState

    for bad in ({"ratio": 0}, {"ratio": 1.5}, {"k": 0}, {"k": 2.5}):
        with pytest.raises(ValueError, match="TopKState"):
            TopKState(**bad)
    assert TopKState(ratio=0.01).k_for(100) == 1 and TopKState(ratio=0.01).k_for(50) == 1
    assert TopKState(ratio=0.29).k_for(100) == 29 and TopKState(k=7).k_for(5) == 5
