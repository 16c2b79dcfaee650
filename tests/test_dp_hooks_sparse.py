"""Top-k and sign communication hooks (minipar/parallel/data/hooks/topk.py, sign.py) on 2, 3 and
4 ranks, float64, K steps of known gradients g_r^t (every rank can draw every rank's):

    applied^t = the hook's result, the same bits on every rank
    sum_t applied^t + (1/p) sum_r residual_r^K = sum_t (1/p) sum_r g_r^t     (within 1e-10)

since each rank's sent c_r^t = g_r^t + e_r^(t-1) - e_r^t telescopes (error feedback). Also: each
step equals a serial twin of the hook, the bytes each rank sends by the counters equal
(p-1) k (8 + 4) (top-k, int32 indices) and (p-1) (ceil(n/8) + 4) (signs), and a rank with another
k is the same CommError on every rank, naming the settings. Inside DDP (overlapped and not):
every rank holds the same parameters after each step, and another ratio on one rank is refused
by every rank's backward, the communicator left clean. One launch per test and rank count."""
import math

import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, SIZES = 6, (100, 13)  # two buckets: index 0 of 100 entries, index 1 of 13
REFUSAL = "TopKState: the ranks disagree on ratio (rank 0: 0.1, rank 1: 0.2"  # and the others'


def assert_no_failures(body, nprocs):
    """Run ``body`` on nprocs ranks, a hang ended by the watchdog in 10 s; no failures."""
    failures = sum(run_on_ranks(body, nprocs, timeout=300, env={"MINIPAR_TIMEOUT": "10"}), [])
    assert not failures, "\n".join(failures)


def refused(call, where):
    """[] if ``call()`` raised the refusal of rank 1's other ratio, else what went wrong."""
    try:
        call()
    except ValueError as error:  # CommError is one
        return [] if REFUSAL in str(error) else [f"{where}: unclear refusal: {error}"]
    return [f"{where}: another ratio on rank 1 was not refused"]


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
    from minipar.parallel.data import GradBucket
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
                    got = hook(state, GradBucket(i, gradient(step, rank, i), [], world))
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
    # another k on one rank: the same CommError on every rank, naming each rank's setting
    bucket = GradBucket(0, gradient(0, rank, 0), [], world)
    return failures + refused(
        lambda: topk_hook(TopKState(ratio=0.2 if rank == 1 else 0.1), bucket), f"rank {rank}")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_topk_and_sign_feed_back_errors_exactly_and_send_the_formula_bytes(nprocs):
    assert_no_failures(sparse_body, nprocs)


def test_the_states_refuse_bad_settings():
    from minipar.parallel.data.hooks.topk import TopKState

    for bad in ({"ratio": 0}, {"ratio": 1.5}, {"k": 0}, {"k": 2.5}):
        with pytest.raises(ValueError, match="TopKState"):
            TopKState(**bad)
    assert TopKState(ratio=0.01).k_for(100) == 1 and TopKState(ratio=0.01).k_for(50) == 1
    assert TopKState(ratio=0.29).k_for(100) == 29 and TopKState(k=7).k_for(5) == 5


def ddp_body():
    """DDP with each hook: the same parameters on every rank after every step; and a rank with
    another ratio the same CommError on every rank (raised by backward), not a hang."""
    import minipar
    from minipar import comm, optim
    from minipar.parallel.data import DistributedDataParallel, DistributedSampler
    from minipar.parallel.data.hooks.sign import SignState, sign_hook
    from minipar.parallel.data.hooks.topk import TopKState, topk_hook
    from test_dp_helpers import GLOBAL_BATCH, STEPS, loss_of, make_data, make_model

    world = comm.world()
    rank, failures = world.rank, []
    x, y = make_data("mlp", "float64")
    batches = DistributedSampler(len(x), world.size, rank, seed=5).batches(GLOBAL_BATCH)
    cases = {"topk ratio=0.05": (lambda: TopKState(ratio=0.05), topk_hook),
             "topk k=2 without feedback": (lambda: TopKState(k=2, use_error_feedback=False),
                                           topk_hook),
             "sign": (lambda: SignState(), sign_hook)}
    for name, (make, hook) in cases.items():
        for overlap in (True, False):
            what = f"rank {rank}: {name} overlap={overlap}"
            model = make_model("mlp", "float64")
            ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.0005, overlap=overlap)
            state = make()
            ddp.register_comm_hook(state, hook)
            optimizer = optim.SGD(model.parameters(), lr=0.1)
            start = [minipar.to_numpy(q.data).copy() for q in model.parameters()]
            for step, idx in enumerate(batches[:STEPS]):
                optimizer.zero_grad()
                loss_of("mlp", ddp, x[idx], y[idx]).backward()
                optimizer.step()
                mine = b"".join(minipar.to_numpy(q.data).tobytes() for q in model.parameters())
                if len(set(world.all_gather_object(mine))) != 1:
                    failures.append(f"{what}: parameters differ across ranks after step {step}")
            moved = [np.abs(minipar.to_numpy(q.data) - s).max() for q, s in
                     zip(model.parameters(), start)]
            # with 2 entries a bucket and no feedback some tensors never move: the point of it
            if (min if state.use_error_feedback else max)(moved) == 0:
                failures.append(f"{what}: a parameter never moved")
            kept = len(state.error_dict)
            if kept != (len(ddp.buckets) if state.use_error_feedback else 0):
                failures.append(f"{what}: {kept} residuals for {len(ddp.buckets)} buckets")
    for overlap in (True, False):  # another ratio on rank 1: refused by every rank
        model = make_model("mlp", "float64")
        ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.0005, overlap=overlap)
        ddp.register_comm_hook(TopKState(ratio=0.2 if rank == 1 else 0.1), topk_hook)
        failures += refused(lambda: loss_of("mlp", ddp, x[batches[0]], y[batches[0]]).backward(),
                            f"rank {rank}: overlap={overlap}")
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_ddp_with_topk_or_sign_keeps_every_rank_identical(nprocs):
    assert_no_failures(ddp_body, nprocs)
