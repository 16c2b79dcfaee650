"""FP8 communication (issue 39, item 4): FP8 arrays on the wire as 1-byte messages and never
reduced; DDP's float8_compress_hook and ZeRO-3's FP8 all-gather each equal a serial twin with
the same rounding points, float64 elsewhere, and the counters show bf16's bytes halved plus
the scales' exactly:

    DDP, a bucket of n (a multiple of p): amax all-reduced under max (a ring of one float32:
    8 (p-1) bytes over all ranks), all-to-all and all-gather of e5m2: 2 (p-1) n over all ranks,
    against bf16_compress_hook's ring all-reduce, 4 (p-1) n.
    ZeRO-3, a forward: each segment of n' elements all-gathered, (p-1) n'/p bytes per rank
    (bf16: twice that), plus one ring all-reduce of K float32 amaxes, 8 (p-1) K over all ranks.

The twins cast with the definition written here (torchao's amax_to_scale), checked against
quantize_tensorwise. One mpiexec launch per rank count runs every case, returning failures."""
import ml_dtypes
import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, GLOBAL_BATCH = 3, 16
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)


def scale_of(amax, d):
    """torchao's amax_to_scale: fmax / max(amax, 1e-12) in float64, rounded to float32."""
    return np.float32(float(ml_dtypes.finfo(d).max) / max(float(amax), 1e-12))


def cast(x, s, d):
    """x (float32) times s, clamped to the format's max, rounded to d; and back, times 1/s."""
    fmax = float(ml_dtypes.finfo(d).max)
    data = np.clip(x.astype(np.float32) * s, -fmax, fmax).astype(d)
    return data.astype(np.float32) * (np.float32(1) / s)


def model_and_data():
    import minipar
    import minipar.nn as nn

    minipar.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)).to("float64")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, 6))
    return model, x, rng.integers(0, 4, len(x))


def loss_of(model, x, y):
    import minipar
    from minipar import functional as F

    return F.cross_entropy(model(minipar.tensor(x)), y)


def local_grads(model, x, y, shares, step):
    """Every rank's gradient of its share, computed here in turn (flat, DDP's bucket order)."""
    out = []
    for share in shares:
        idx = share[step]
        model.zero_grad()
        loss_of(model, x[idx], y[idx]).backward()
        out.append([q.grad.copy() for q in model.parameters()])
    return out


def ddp_twin(p):
    """float8_compress_hook's rounding points: each g_r cast to e5m2 with the scale of the
    largest |g| of any rank, read back, added in rank order in float64, divided by p, cast
    again with that scale and read back."""
    from minipar.amp.float8_recipes import quantize_tensorwise
    from minipar.parallel.data import DistributedSampler

    model, x, y = model_and_data()
    params = list(model.parameters())
    shares = [DistributedSampler(len(x), p, r, seed=5).batches(GLOBAL_BATCH) for r in range(p)]
    for step in range(STEPS):
        grads = [np.concatenate([g.reshape(-1) for g in gs])
                 for gs in local_grads(model, x, y, shares, step)]
        s = scale_of(max(np.abs(g.astype(np.float32)).max() for g in grads), E5M2)
        if np.float32(1) / s != quantize_tensorwise(np.stack(grads), E5M2).scale:
            raise AssertionError("the twin's scale is not quantize_tensorwise's")
        total = np.zeros_like(grads[0])
        for g in grads:
            total += cast(g, s, E5M2).astype(np.float64)
        mean = cast(total / p, s, E5M2).astype(np.float64)
        o = 0
        for q in params:
            q.data = q.data - 0.1 * mean[o:o + q.size].reshape(q.shape)
            o += q.size
    return [q.data for q in params]


def ddp_run(comm, hook):
    from minipar import optim
    from minipar.parallel.data import DistributedDataParallel, DistributedSampler

    model, x, y = model_and_data()
    ddp = DistributedDataParallel(model, comm, algorithm="ring", overlap=False)
    ddp.register_comm_hook(None, hook)
    opt = optim.SGD(model.parameters(), lr=0.1)
    batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    comm.counters.reset()
    for idx in batches[:STEPS]:
        opt.zero_grad()
        loss_of(ddp, x[idx], y[idx]).backward()
        opt.step()
    return [q.data.copy() for q in model.parameters()], comm.counters.snapshot()["bytes_sent"]


def zero3_twin(p):
    """ZeRO-3's FP8 rounding points: before each forward every parameter cast to e4m3 with its
    own tensor-wise scale and read back; the average of the ranks' gradients updates the float64
    masters."""
    from minipar.amp.float8_recipes import dequantize, quantize_tensorwise
    from minipar.parallel.data import DistributedSampler

    model, x, y = model_and_data()
    params = list(model.parameters())
    shares = [DistributedSampler(len(x), p, r, seed=5).batches(GLOBAL_BATCH) for r in range(p)]
    for step in range(STEPS):
        masters = [q.data for q in params]
        for q, w in zip(params, masters):
            s = scale_of(np.abs(w.astype(np.float32)).max(), E4M3)
            mine = cast(w, s, E4M3)
            if not np.array_equal(mine, dequantize(quantize_tensorwise(w, E4M3))):
                raise AssertionError("the twin's cast is not quantize_tensorwise's")
            q.data = mine.astype(np.float64)
        grads = local_grads(model, x, y, shares, step)
        for i, (q, w) in enumerate(zip(params, masters)):
            q.data = w - 0.1 * sum(g[i] for g in grads) / p
    return [q.data for q in params]


def zero3_run(comm, model, x, y, **options):
    from minipar import no_grad, optim
    from minipar.parallel.data import DistributedSampler, ZeRO3

    zero = ZeRO3(model, lambda ps: optim.SGD(ps, lr=0.1), comm, **options)
    batches = DistributedSampler(len(x), comm.size, comm.rank, seed=5).batches(GLOBAL_BATCH)
    for idx in batches[:STEPS]:
        loss_of(model, x[idx], y[idx]).backward()
        zero.step()
        zero.zero_grad()
    comm.counters.reset()
    with no_grad():  # one forward: each unit gathered once
        loss_of(model, x[:4], y[:4])
    sent = comm.counters.snapshot()["bytes_sent"]
    with zero.summon_full_params():
        return [q.data.copy() for q in model.parameters()], sent, zero


def comm_cases(world, failures):
    """FP8 arrays moved bit for bit, counted at 1 byte an element; every reduction refused."""
    from minipar.comm import CommError

    p, r = world.size, world.rank
    rng = np.random.default_rng(3 + r)
    for d in (E4M3, E5M2):
        x = (rng.standard_normal(37) * 8).astype(d)
        world.counters.reset()
        got = world.all_gather(x)
        if got.dtype != d or got[r].tobytes() != x.tobytes():
            failures.append(f"rank {r}: {d.name} all_gather changed the bits")
        if world.counters.snapshot()["bytes_sent"] != (p - 1) * x.size:
            failures.append(f"rank {r}: {d.name} all_gather sent "
                            f"{world.counters.snapshot()['bytes_sent']} bytes")
        rows = world.all_to_all(np.stack([x] * p))
        if any(row.tobytes() != world.all_gather_object(x.tobytes())[j]
               for j, row in enumerate(rows)):
            failures.append(f"rank {r}: {d.name} all_to_all changed the bits")
        for what, call in (("all_reduce", lambda: world.all_reduce(x)),
                           ("all_reduce", lambda: world.all_reduce(x, op="max", algorithm="mpi")),
                           ("reduce_scatter", lambda: world.reduce_scatter(x)),
                           ("iall_reduce", lambda: world.iall_reduce(x, algorithm="mpi"))):
            try:
                call()
                failures.append(f"rank {r}: {what} of {d.name} was not refused")
            except CommError as error:
                if f"cannot reduce {d.name}" not in str(error) or what not in str(error):
                    failures.append(f"rank {r}: {what}: {error}")


def fp8_body():
    import minipar
    import minipar.distributed as dist
    from minipar import comm
    from minipar.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from minipar.parallel.data import DistributedSampler, ZeRO3
    from minipar.parallel.data.hooks import bf16_compress_hook, float8_compress_hook

    world = comm.world()
    p, r = world.size, world.rank
    failures = []
    comm_cases(world, failures)
    totals = {}

    # DDP: the twin bit for bit, the bytes of the formula
    got, totals["ddp fp8"] = ddp_run(world, float8_compress_hook)
    _, totals["ddp bf16"] = ddp_run(world, bf16_compress_hook)
    if any(g.tobytes() != e.tobytes() for g, e in zip(got, ddp_twin(p))):
        failures.append(f"rank {r}: DDP in FP8 differs from its twin")
    n = sum(q.size for q in model_and_data()[0].parameters())

    # ZeRO-3: the twin (float64 sums in another order: to 1e-12), the bytes of the formula
    model, x, y = model_and_data()
    got, totals["zero3 fp8"], zero = zero3_run(world, model, x, y, all_gather_dtype="float8_e4m3fn")
    if any(not np.allclose(g, e, rtol=1e-12, atol=1e-14) for g, e in zip(got, zero3_twin(p))):
        failures.append(f"rank {r}: ZeRO-3 in FP8 differs from its twin")
    numels = [seg.numel for u in zero.units for seg in u.segments]
    model, x, y = model_and_data()
    _, totals["zero3 bf16"], _ = zero3_run(world, model.to("bfloat16"), x.astype(
        ml_dtypes.bfloat16), y)
    if totals["zero3 bf16"] != 2 * (p - 1) * sum(numels) // p:
        failures.append(f"rank {r}: ZeRO-3 bf16 sent {totals['zero3 bf16']} bytes")

    # fully_shard's path: MixedPrecisionPolicy(all_gather_dtype=...) trains as ZeRO3's option
    dist.init_process_group("mpi")
    model, x, y = model_and_data()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(all_gather_dtype="float8_e4m3fn"))
    opt = minipar.optim.SGD(model.parameters(), lr=0.1)
    batches = DistributedSampler(len(x), p, r, seed=5).batches(GLOBAL_BATCH)
    for idx in batches[:STEPS]:
        loss_of(model, x[idx], y[idx]).backward()
        opt.step()
        opt.zero_grad()
    full = [q.full_tensor().data for q in model.parameters()]
    if any(not np.allclose(f, g, rtol=1e-12, atol=1e-14) for f, g in zip(full, got)):
        failures.append(f"rank {r}: fully_shard in FP8 differs from ZeRO3's")

    # bad input: the same error on every rank
    for options, kind, words in ((dict(all_gather_dtype="bfloat16"), ValueError,
                                  "must be float8_e4m3fn or float8_e5m2, got bfloat16"),
                                 (dict(all_gather_dtype="float8_e5m2"), TypeError,
                                  "unit '0' has float8_e4m3fn parameters")):
        model, _, _ = model_and_data()
        if kind is TypeError:  # FP8 masters: nothing wider to cast from
            model.to("float8_e4m3fn")
        try:
            ZeRO3(model, lambda ps: minipar.optim.SGD(ps, lr=0.1), world, **options)
            failures.append(f"rank {r}: ZeRO3({options}) was not refused")
        except kind as error:
            if words not in str(error):
                failures.append(f"rank {r}: ZeRO3({options}): {error}")
    return failures, totals, n, numels


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fp8_communication_equals_its_twins_with_half_the_bytes(nprocs):
    results = run_on_ranks(fp8_body, nprocs, timeout=300)
    failures = sum((f for f, _, _, _ in results), [])
    assert not failures, "\n".join(failures)
    p, (_, _, n, numels) = nprocs, results[0]
    total = {k: sum(t[k] for _, t, _, _ in results) for k in results[0][1]}
    assert n % p == 0 and all(m % p == 0 for m in numels)
    # DDP: one bucket a step; bf16's ring all-reduce 4 (p-1) n over the ranks
    assert total["ddp bf16"] == STEPS * 4 * (p - 1) * n
    assert total["ddp fp8"] == total["ddp bf16"] // 2 + STEPS * 8 * (p - 1)
    # ZeRO-3: a forward's all-gathers, plus one ring all-reduce of 4 amaxes (2 Linears)
    assert total["zero3 bf16"] == p * 2 * (p - 1) * sum(numels) // p
    assert total["zero3 fp8"] == total["zero3 bf16"] // 2 + 8 * (p - 1) * 4
