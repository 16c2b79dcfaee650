"""DDP with float16 and bfloat16 parameters: 16-bit buckets all-reduced as 16-bit messages (half
the float32 run's bytes, by the counters), the same bits on every rank, and the serial twin
with the same rounding points:

    each rank's local gradient g_r (the engine's, for its share of the batch)
    g_r / N rounded to 16 bits (DDP divides first: exact for N a power of two)
    the N of them added in float32 and rounded once (``parallel``, and ``ring`` on 2 ranks)

equal bit for bit. The ring (and shm, ``auto``'s pick) on 3 ranks rounds each partial sum it
passes on (docs/comm.md): within 2 ulps of the largest parameter per step of the twin
(measured after 3 steps: 2^-12 in float16, 2^-10 in bfloat16).
One mpiexec launch per rank count runs every case and returns the failures."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, GLOBAL_BATCH = 3, 12


def model_and_data(dtype):
    import minipar
    import minipar.nn as nn

    minipar.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, 6)).astype(np.float32)
    return model, minipar.tensor(x).to(dtype).data, rng.integers(0, 4, len(x))


def local_loss(model, x, y):
    import minipar
    from minipar import functional as F

    return F.cross_entropy(model(minipar.tensor(x)), y)


def twin(dtype, p):
    """Serial training with DDP's rounding points: every share's g/N rounded to 16 bits, the N
    of them added in float32 in rank order, rounded once."""
    from minipar import backend, optim
    from minipar.parallel.data import DistributedSampler

    model, x, y = model_and_data(dtype)
    opt = optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    shares = [DistributedSampler(len(x), p, r, seed=5).batches(GLOBAL_BATCH) for r in range(p)]
    for step in range(STEPS):
        total = [np.zeros(q.shape, np.float32) for q in params]
        for r in range(p):
            idx = shares[r][step]
            opt.zero_grad()
            local_loss(model, x[idx], y[idx]).backward()
            for t, q in zip(total, params):
                grad = backend.to_numpy(q.grad)  # the twin adds on the host
                part = np.empty(q.shape, grad.dtype)
                np.divide(grad, p, out=part)  # g_r / N in 16 bits, as DDP's bucket holds it
                t += part.astype(np.float32)
        for t, q in zip(total, params):
            q.grad = backend.asarray(t.astype(q.dtype))  # rounded once
        opt.step()
    return [backend.to_numpy(q.data).copy() for q in params]


def ddp_run(dtype, comm, algorithm):
    """(parameters after STEPS steps of DDP, the counters of the gradients' all-reduces)."""
    from minipar import optim, to_numpy
    from minipar.parallel.data import DistributedDataParallel, DistributedSampler

    model, x, y = model_and_data(dtype)
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.0005, algorithm=algorithm,
                                  overlap=False)
    opt = optim.SGD(model.parameters(), lr=0.1)
    batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    comm.counters.reset()  # the wrap's broadcast aside: only the gradients' all-reduces
    for idx in batches[:STEPS]:
        opt.zero_grad()
        local_loss(ddp, x[idx], y[idx]).backward()
        if any(q.grad.dtype != q.dtype for q in model.parameters()):
            raise AssertionError("a gradient left its 16-bit bucket")
        opt.step()
    return [to_numpy(q.data).copy() for q in model.parameters()], comm.counters.snapshot()


def dp16_body():
    import minipar
    from minipar import backend, comm
    from minipar.comm import CommError
    from minipar.parallel.data import DistributedDataParallel, average_grads

    world = comm.world()
    p, r = world.size, world.rank
    failures = []
    _, full = ddp_run("float32", world, "ring")
    on_cpu = backend.device() == "cpu"  # CuPy (and the strict device) has no bfloat16
    for dtype in ("float16", "bfloat16") if on_cpu else ("float16",):
        exact = twin(dtype, p)
        for algorithm in ("ring", "parallel", "auto"):
            got, counted = ddp_run(dtype, world, algorithm)
            bits = [g.view(np.uint16).tobytes() for g in got]
            if any(len(set(b)) != 1 for b in zip(*world.all_gather_object(bits))):
                failures.append(f"rank {r}: {dtype} {algorithm}: ranks differ")
            if algorithm == "ring" and (2 * counted["bytes_sent"] != full["bytes_sent"]
                                        or 2 * counted["bytes_received"] != full["bytes_received"]):
                failures.append(f"rank {r}: {dtype} ring sent {counted['bytes_sent']} bytes, "
                                f"float32 {full['bytes_sent']}")
            if algorithm == "parallel" or p == 2:  # one rounding: the twin bit for bit
                if [g.view(np.uint16).tobytes() for g in exact] != bits:
                    diff = max(float(np.abs(g.astype(np.float64) - e.astype(np.float64)).max())
                               for g, e in zip(got, exact))
                    failures.append(f"rank {r}: {dtype} {algorithm} differs from its twin by "
                                    f"{diff:.3g}")
            else:  # p - 1 roundings of partial sums: 2 ulps of the largest parameter a step
                bits_after = 10 if dtype == "float16" else 7
                for g, e in zip(got, exact):
                    e64 = e.astype(np.float64)
                    ulp = 2.0 ** (np.floor(np.log2(np.abs(e64).max())) - bits_after)
                    if np.abs(g.astype(np.float64) - e64).max() > 2 * STEPS * ulp:
                        failures.append(f"rank {r}: {dtype} {algorithm} is far from its twin")
                        break
    # AllReduceOptimizer's average divides first too: float16 gradients of 40000 on every rank
    # average to about 40000, where their sum (40000 p) is past float16's largest, 65504
    q = minipar.tensor(np.zeros(3, np.float16), requires_grad=True)
    q.grad = backend.asarray(np.full(3, 40000, np.float16))
    average_grads([q], backend.asarray(np.zeros(3, np.float16)), world, "ring")
    got = backend.to_numpy(q.grad)
    if got.dtype != np.float16 or not np.allclose(got.astype(np.float64), 40000, rtol=1e-3):
        failures.append(f"rank {r}: average_grads of float16 40000s gave {got}")
    if not on_cpu:
        return failures
    # MPI's own all-reduce has no bfloat16: refused when DDP is built, on every rank
    model, _, _ = model_and_data("bfloat16")
    try:
        DistributedDataParallel(model, world, algorithm="mpi")
        if p > 1:
            failures.append(f"rank {r}: DDP took algorithm='mpi' for bfloat16")
    except (CommError, ValueError) as error:
        if "bfloat16" not in str(error):
            failures.append(f"rank {r}: {error}")
    return failures


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_ddp_in_16_bits_equals_its_twin_with_half_the_bytes(nprocs):
    failures = sum(run_on_ranks(dp16_body, nprocs, timeout=300), [])
    assert not failures, "\n".join(failures)
