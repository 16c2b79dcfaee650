"""DDP's communication hooks (issue 25): ``register_comm_hook`` and the hooks of
``minipar.parallel.data.hooks``, on real launches:

- every hook (none, allreduce, fp16, bf16, PowerSGD with and without error feedback), with and
  without overlap, on 2, 3 and 4 ranks: every rank holds the same parameters after each step;
  ``allreduce_hook`` equals DDP's own path bit for bit;
- fp16/bf16_compress_hook equal the serial cast, divide, sum, cast back, the sum in the stated
  order (``parallel``: the N 16-bit values added in float32 in rank order, rounded once);
- PowerSGD in float64: rank >= min(n, m) is plain averaging (1e-10); with error feedback the sum
  of the applied gradients plus the final residual (averaged over ranks) is the sum of the true
  averages (1e-10); the bytes by the counters are the formula; and it equals a serial reference
  written from the steps torch's ``powerSGD_hook`` documents, given the same first Q;
- registering twice, or after a backward, is torch's error; ranks whose PowerSGD or top-k
  settings differ (from the start, or changed by one rank between steps), that run different
  hooks, or whose hook all-reduces different sizes, end with a CommError, not a hang.
One launch per rank count runs the cases and returns the failures."""
import textwrap

import numpy as np
import pytest

from minipar.testing import run_job, run_on_ranks
from test_dp_16bit import GLOBAL_BATCH, STEPS, local_loss, model_and_data  # the MLP, its data

CAP_MB = 0.0003  # cuts the MLP in two buckets


def has_bfloat16():
    """bfloat16 arrays on this device (not CuPy's, nor the strict device's: the hook refuses)."""
    from minipar import backend

    try:
        backend.check_dtype("bfloat16")
        return True
    except TypeError:
        return False


def make_hook(name):
    """(state, hook) for a case's name; (None, None): DDP's own all-reduce."""
    from minipar.parallel.data import hooks

    return {"none": (None, None),
            "allreduce": (None, hooks.allreduce_hook),
            "fp16": (None, hooks.fp16_compress_hook),
            "bf16": (None, hooks.bf16_compress_hook),
            "powersgd": (hooks.PowerSGDState(None, 1, start_powerSGD_iter=1), hooks.powerSGD_hook),
            "powersgd-no-ef": (hooks.PowerSGDState(None, 2, start_powerSGD_iter=0,
                                                   use_error_feedback=False, warm_start=False),
                               hooks.powerSGD_hook)}[name]


def train(comm, name, overlap, algorithm="auto"):
    """The parameters after each of STEPS steps of DDP with the named hook (one flat vector a
    step) and the bytes this rank sent averaging them; raises if the ranks ever hold different
    parameters."""
    from minipar import optim, to_numpy
    from minipar.parallel.data import DistributedDataParallel, DistributedSampler

    model, x, y = model_and_data("float32")
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=CAP_MB, algorithm=algorithm,
                                  overlap=overlap)
    assert len(ddp.buckets) == 2, ddp.buckets
    state, hook = make_hook(name)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = optim.SGD(model.parameters(), lr=0.1)
    batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    after, sent = [], 0
    for step, idx in enumerate(batches[:STEPS]):
        opt.zero_grad()
        before = comm.counters.bytes_sent
        local_loss(ddp, x[idx], y[idx]).backward()
        sent += comm.counters.bytes_sent - before
        opt.step()
        flat = np.concatenate([to_numpy(q.data).ravel() for q in model.parameters()])
        everyone = comm.all_gather(flat)
        if not all(np.array_equal(everyone[0], row) for row in everyone):
            raise AssertionError(f"{name}, overlap={overlap}: the ranks' parameters differ "
                                 f"after step {step}")
        after.append(flat)
    return after, sent


def rank_arrays(p, shapes, seed, dtype=np.float64):
    """Every rank's gradients (a list per rank of arrays of ``shapes``), known to every rank."""
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(p)]


class Param:
    """A stand-in parameter for a GradBucket built by hand: its shape."""

    def __init__(self, shape):
        self.shape, self.size = shape, int(np.prod(shape))


def bucket_of(grads, comm, algorithm="parallel", index=0):
    """A GradBucket of ``grads`` laid end to end, on the device."""
    from minipar import backend
    from minipar.parallel.data import GradBucket

    buffer = backend.asarray(np.concatenate([g.ravel() for g in grads]))
    return GradBucket(index, buffer, [Param(g.shape) for g in grads], comm, algorithm, last=True)


def compress_cases(comm):
    """fp16/bf16_compress_hook against the serial cast, divide, sum in float32 in rank order
    rounded once, cast back (``parallel``'s order, docs/comm.md)."""
    import minipar
    from minipar.parallel.data import hooks

    p, r, failures = comm.size, comm.rank, []
    for hook, dtype in ((hooks.fp16_compress_hook, minipar.float16),
                        (hooks.bf16_compress_hook, minipar.bfloat16))[:1 + has_bfloat16()]:
        grads = rank_arrays(p, [(7, 5), (5,)], seed=3, dtype=np.float32)
        out = minipar.to_numpy(hook(None, bucket_of(grads[r], comm)))
        total = np.zeros(40, np.float32)
        for mine in grads:  # rank order
            part = np.concatenate([g.ravel() for g in mine]).astype(dtype)
            np.divide(part, part.dtype.type(p), out=part)  # divided first, in 16 bits
            total += part.astype(np.float32)
        expect = total.astype(dtype).astype(np.float32)
        if out.dtype != np.float32 or not np.array_equal(out, expect):
            failures.append(f"rank {r}: {hook.__name__} differs from the serial cast-divide-sum"
                            f"-cast by {np.abs(out - expect).max():.3g}")
    return failures


def reference_powersgd(first_q, steps_grads):
    """torch's powerSGD_hook, step by step as its documentation gives them, serially over the
    ranks' gradients: per matrix M_r (n x m) with Q given, orthogonalise Q; P = sum_r M_r Q;
    orthogonalise P (Gram-Schmidt); Q = (1/N) sum_r M_rᵀ P; approximation P Qᵀ; residual
    M_r - P Qᵀ added to the next step's M_r. Returns the approximations of every step."""
    def gram_schmidt(a):
        a = a.copy()
        for i in range(a.shape[1]):
            a[:, i] /= np.linalg.norm(a[:, i])
            for j in range(i + 1, a.shape[1]):
                a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
        return a

    p = len(steps_grads[0])
    errors = [np.zeros_like(steps_grads[0][0]) for _ in range(p)]
    q, out = first_q, []
    for grads in steps_grads:
        m_r = [g + e for g, e in zip(grads, errors)]
        q = gram_schmidt(q)
        pp = gram_schmidt(sum(m @ q for m in m_r))
        q = sum(m.T @ pp for m in m_r) / p
        approx = pp @ q.T
        errors = [m - approx for m in m_r]
        out.append(approx)
    return out, errors


def powersgd_cases(comm):
    from minipar import backend, to_numpy
    from minipar.parallel.data import hooks

    p, r, failures = comm.size, comm.rank, []
    # 1. rank >= min(n, m), compression forced: plain averaging within 1e-10
    shapes = [(6, 4), (3, 9), (5,)]
    grads = rank_arrays(p, shapes, seed=4)
    state = hooks.PowerSGDState(None, matrix_approximation_rank=9, start_powerSGD_iter=0,
                                min_compression_rate=0)
    out = to_numpy(hooks.powerSGD_hook(state, bucket_of(grads[r], comm)))
    plain = np.concatenate([sum(g[i] for g in grads).ravel() / p for i in range(len(shapes))])
    if np.abs(out - plain).max() > 1e-10:
        failures.append(f"rank {r}: full-rank PowerSGD is {np.abs(out - plain).max():.3g} from "
                        f"plain averaging")

    # 2. error feedback over K steps, 3. bytes by the counters, 4. the serial reference
    K, shapes = 4, [(8, 6), (6,), (3, 2)]  # (3, 2) would not gain at rank 1: uncompressed
    steps = [rank_arrays(p, shapes, seed=10 + k) for k in range(K)]
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=0)
    first_q = np.random.default_rng(7).standard_normal(6)  # the same first Q everywhere
    state.p_memory_dict[0] = backend.asarray(np.empty(8))
    state.q_memory_dict[0] = backend.asarray(first_q.copy())  # the hook writes Q in place
    applied, true_sum = np.zeros(48 + 6 + 6), np.zeros(48 + 6 + 6)
    for k, grads in enumerate(steps):
        before = comm.counters.bytes_sent
        out = to_numpy(hooks.powerSGD_hook(state, bucket_of(grads[r], comm)))
        sent = comm.counters.bytes_sent - before
        formula = (p - 1) * 8 * ((8 + 6) * 1 + 6 + 6)  # parallel: (p-1) x count x 8 bytes
        if sent != formula:
            failures.append(f"rank {r}: step {k} sent {sent} bytes, formula {formula}")
        applied += out
        true_sum += np.concatenate([sum(g[i] for g in grads).ravel() / p for i in range(3)])
    residual = to_numpy(comm.all_gather(state.error_dict[0]).sum(axis=0)) / p  # averaged
    if np.abs(applied + residual - true_sum).max() > 1e-10:
        failures.append(f"rank {r}: applied + residual misses the true sum by "
                        f"{np.abs(applied + residual - true_sum).max():.3g}")
    approx, errors = reference_powersgd(first_q.reshape(6, 1),
                                        [[g[0] for g in grads] for grads in steps])
    if np.abs(out[:48] - approx[-1].ravel()).max() > 1e-12:
        failures.append(f"rank {r}: PowerSGD differs from the torch reference by "
                        f"{np.abs(out[:48] - approx[-1].ravel()).max():.3g}")
    if np.abs(to_numpy(state.error_dict[0])[:48] - errors[r].ravel()).max() > 1e-12:
        failures.append(f"rank {r}: PowerSGD's residual differs from the reference's")
    return failures


def registration_cases(comm):
    """torch's errors: a second register_comm_hook, or one after a backward."""
    from minipar.parallel.data import DistributedDataParallel, hooks

    failures = []
    model, x, y = model_and_data("float32")
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, hooks.allreduce_hook)
    for state, hook, words in ((None, hooks.fp16_compress_hook, "can only be called once"),
                               (None, "not a hook", "must be callable")):
        try:
            ddp.register_comm_hook(state, hook)
            failures.append(f"rank {comm.rank}: register_comm_hook took {hook!r}")
        except (RuntimeError, TypeError) as error:
            if words not in str(error):
                failures.append(f"rank {comm.rank}: {error}")
    if not has_bfloat16():  # refused when registered, by name, as torch does
        try:
            ddp = DistributedDataParallel(model_and_data("float32")[0], comm)
            ddp.register_comm_hook(None, hooks.bf16_compress_hook)
            failures.append(f"rank {comm.rank}: bf16_compress_hook taken without bfloat16")
        except TypeError as error:
            if "bfloat16" not in str(error):
                failures.append(f"rank {comm.rank}: {error}")
    model, x, y = model_and_data("float32")
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=CAP_MB)
    local_loss(ddp, x[:4], y[:4]).backward()
    try:
        ddp.register_comm_hook(None, hooks.allreduce_hook)
        failures.append(f"rank {comm.rank}: register_comm_hook after a backward was taken")
    except RuntimeError as error:
        if "before the first backward" not in str(error):
            failures.append(f"rank {comm.rank}: {error}")
    return failures


def hooks_body():
    from minipar import comm

    world = comm.world()
    failures = []
    own, _ = train(world, "none", overlap=False)
    for name in ("none", "allreduce", "fp16", "bf16", "powersgd", "powersgd-no-ef"):
        if name == "bf16" and not has_bfloat16():
            continue
        for overlap in (False, True):
            try:
                after, _ = train(world, name, overlap)
            except AssertionError as error:
                failures.append(f"rank {world.rank}: {error}")
                continue
            if name in ("none", "allreduce") and not all(map(np.array_equal, after, own)):
                failures.append(f"rank {world.rank}: {name} overlap={overlap} differs from "
                                f"DDP's own all-reduce")
            if name == "powersgd" and not np.array_equal(after[0], own[0]):
                failures.append(f"rank {world.rank}: PowerSGD's first (plain) step differs")
    full, half = (train(world, name, False, "ring")[1] for name in ("none", "fp16"))
    if 2 * half != full:
        failures.append(f"rank {world.rank}: fp16_compress_hook sent {half} bytes, float32 {full}")
    return failures + compress_cases(world) + powersgd_cases(world) + registration_cases(world)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_every_hook_keeps_the_ranks_equal_and_meets_its_formula(nprocs):
    failures = sum(run_on_ranks(hooks_body, nprocs, timeout=600), [])
    assert not failures, "\n".join(failures)


DISAGREE = {
    "PowerSGD with another rank on the last rank": ("""
from minipar.parallel.data import hooks
state = hooks.PowerSGDState(None, matrix_approximation_rank=1 + (world.rank == world.size - 1),
                            start_powerSGD_iter=0)
ddp.register_comm_hook(state, hooks.powerSGD_hook)
""", ["PowerSGDState: the ranks disagree on matrix_approximation_rank"]),
    "a hook that all-reduces k elements, k differing on the last rank": ("""
def first_k(state, bucket):
    k = 5 if world.rank == world.size - 1 else 3
    buf = bucket.buffer()
    world.all_reduce(buf[:k], algorithm="parallel", out=buf[:k])
    return buf
ddp.register_comm_hook(None, first_k)
""", ["differ across ranks"]),
    "PowerSGD whose last rank changes start_powerSGD_iter after a step": ("""
from minipar.parallel.data import hooks
state = hooks.PowerSGDState(None, 1, start_powerSGD_iter=2)
ddp.register_comm_hook(state, hooks.powerSGD_hook)
def between_steps():  # the last rank would compress at step 1, the others all-reduce
    state.start_powerSGD_iter = 1 if world.rank == world.size - 1 else 2
""", ["PowerSGDState: the ranks disagree on start_powerSGD_iter (rank 0: 2, rank 1: 2, "
      "rank 2: 1)"]),
    "top-k whose last rank changes k after a step": ("""
from minipar.parallel.data import hooks
state = hooks.TopKState(k=3)
ddp.register_comm_hook(state, hooks.topk_hook)
def between_steps():
    state.k = 5 if world.rank == world.size - 1 else 3
""", ["TopKState: the ranks disagree on k (rank 0: 3, rank 1: 3, rank 2: 5)"]),
    "top-k on the last rank, signs on the others": ("""
from minipar.parallel.data import hooks
last = world.rank == world.size - 1
ddp.register_comm_hook(hooks.TopKState(k=3) if last else hooks.SignState(),
                       hooks.topk_hook if last else hooks.sign_hook)
""", ["the ranks disagree on state (rank 0: 'SignState', rank 1: 'SignState', "
      "rank 2: 'TopKState')"]),
}

JOB = """
import sys
import numpy as np
import minipar
from minipar import comm, nn
from minipar import functional as F
from minipar.parallel.data import DistributedDataParallel
world = comm.world()
minipar.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.0003, overlap={overlap})
def between_steps():
    pass
{hook}
x = minipar.tensor(np.ones((4, 6), np.float32))
try:
    for step in range(2):
        F.cross_entropy(ddp(x), np.zeros(4, int)).backward()
        between_steps()
except Exception as error:
    print(f"rank {{world.rank}} raised {{type(error).__name__}}: {{error}}", flush=True)
    sys.exit(1)
print(f"rank {{world.rank}} raised nothing", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.fault
@pytest.mark.parametrize("case", list(DISAGREE))
@pytest.mark.parametrize("overlap", [False, True])
def test_a_hook_whose_ranks_disagree_is_an_error_not_a_hang(case, overlap):
    hook, words = DISAGREE[case]
    status, output, seconds = run_job(JOB.format(overlap=overlap, hook=textwrap.dedent(hook)), 3,
                                      timeout=60, env={"MINIPAR_TIMEOUT": "10"})
    assert status not in (None, 0), f"{case}: the job did not fail (status {status}):\n{output}"
    assert "CommError" in output and all(w in output for w in words), output
    assert "raised nothing" not in output, output
    assert all(f"rank {r} raised CommError" in output for r in range(3)), output
    assert seconds < 30, f"{case}: the job took {seconds:.1f} s to end:\n{output}"
