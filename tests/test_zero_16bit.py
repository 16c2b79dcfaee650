"""ZeRO-1, 2 and 3 in mixed precision (a 16-bit model, AdamW with float32 master weights), on 2
and 3 ranks: the bytes a rank holds are the paper's (2+2+12)Ψ, (2+2+12/N)Ψ, (2+14/N)Ψ and 16Ψ/N
exactly, padding counted; the messages are 16-bit (half float32's bytes); the training equals a
serial twin with the same rounding points; a 16-bit checkpoint resumes bit for bit.

The twin's rounding points, those of ZeRO: each rank's 16-bit gradient g_r divided by N and
rounded to 16 bits; their sum added in float32, rounded to 16 bits once (the ring rounds once
per hop: once on 2 ranks, so bit for bit; twice on 3, within Higham's bound; the pairwise
reduce-scatter once on any N, bit for bit); AdamW updates the float32 master and rounds it
once into the 16-bit parameter; GradScaler (float16) unscales the reduced gradient in float32."""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

DTYPES = ("float16", "bfloat16")
STEPS, BATCH = 3, 6  # the global batch divides among 2 and 3 ranks
KINDS = ("zero1", "zero2", "zero3")


def build(dtype, seed=0):
    import minipar
    import minipar.nn as nn

    minipar.manual_seed(seed)
    return nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2,
                               n_embd=8)).to(getattr(minipar, dtype))


def adamw(params):
    from minipar import optim

    return optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def loss_of(model, s, lo, hi):
    """The loss of rows [lo, hi) of step s's global batch (the model computes in its dtype)."""
    ids = np.random.default_rng(s).integers(0, 11, (BATCH, 7))[lo:hi]
    return model(ids[:, :-1], ids[:, 1:])[1]


def make_scaler(dtype):
    from minipar import amp

    # float16 only; a small growth interval so that the scale grows within the run
    return amp.GradScaler(init_scale=2.0**10, growth_interval=2) if dtype == "float16" else None


def wrap(kind, model, comm, optimizer=adamw):
    from minipar.parallel.data import ZeRO, ZeRO3

    if kind == "zero3":
        return ZeRO3(model, optimizer, comm)
    # small buckets (several per group), of one element count in every dtype: one padding
    itemsize = model.parameters()[0].data.itemsize
    return ZeRO(model, optimizer, comm, stage=int(kind[-1]), bucket_cap_mb=0.0005 * itemsize)


def whole(app, kind):
    import contextlib

    import minipar

    with app.summon_full_params() if kind == "zero3" else contextlib.nullcontext():
        return [minipar.to_numpy(p.data).astype("float32").tolist()
                for p in app.module.parameters()]


def train(kind, dtype, comm, steps=STEPS, app=None, start=0, save=None, scaler=None):
    """Parameters after ``steps`` mixed-precision steps on ``comm``'s ranks (GradScaler for
    float16); ``save(app, scaler)`` after step 1."""
    app = app or wrap(kind, build(dtype), comm)
    scaler = scaler or make_scaler(dtype)
    n = BATCH // comm.size
    for s in range(start, start + steps):
        app.zero_grad()
        loss = loss_of(app.module, s, comm.rank * n, comm.rank * n + n)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(app)
            scaler.update()
        else:
            app.step()
        if save and s == 1:
            save(app, scaler)
    return whole(app, kind)


def memory(kind, dtype, comm):
    """(bytes held by kind after the second backward, bytes sent in the second step, the
    expected bytes by kind: the paper's formula with the padding each wrapper adds)."""
    from minipar.parallel.data import DistributedDataParallel

    model = build(dtype)
    psi = sum(p.size for p in model.parameters())  # Ψ
    if kind == "dp":
        net = DistributedDataParallel(model, comm, algorithm="ring")
        opt = adamw(model.parameters())
        step, zero_grad = opt.step, opt.zero_grad
    else:
        app = wrap(kind, model, comm)
        step, zero_grad = app.step, app.zero_grad
    n, N = BATCH // comm.size, comm.size
    for s in range(2):
        zero_grad()
        before = comm.counters.bytes_sent
        loss_of(model, s, comm.rank * n, comm.rank * n + n).backward()
        if kind == "dp":
            held = opt.memory_bytes()
            held = {"parameters": held["params"], "gradients": net.gradient_bytes(),
                    "master": held["master"], "moments": held["moments"]}
        else:
            held = app.memory_bytes()
        step()
        sent = comm.counters.bytes_sent - before
    # ZeRO pads each bucket (ZeRO-1/2) or segment (ZeRO-3) to a multiple of N, at most N - 1
    # elements each: ``padded`` is Ψ plus that padding, held in pieces of padded / N (and ZeRO-1/2
    # hold the padded flat vectors of the parameters whole)
    a = 2 if dtype != "float32" else 4  # bytes of a parameter and of its gradient
    master = 4 if dtype != "float32" else 0  # the float32 copy of a 16-bit parameter
    cut = {"zero1": "flats", "zero2": "flats", "zero3": "segments"}.get(kind)
    pieces = [] if cut is None else getattr(app, cut)
    padded = sum(int(x.size) if cut == "flats" else x.numel for x in pieces) or psi
    assert padded - psi <= (N - 1) * max(1, len(pieces))
    if cut is not None:  # 16 bits stay 16 bits: flat parameters and shards, their gradients
        shards = app.shards if cut == "flats" else [s.shard for s in pieces]
        arrays = [s.data for s in shards] + [s.grad for s in shards if s.grad is not None]
        assert {str(x.dtype) for x in arrays} == {dtype}, kind
        # the float32 copies are the optimizer's state, one per shard, and nowhere else
        assert [str(st["master"].dtype) for st in app.optimizer.state.values()
                if "master" in st] == ["float32"] * (len(shards) if master else 0), kind
    shard = padded // N
    # the paper's table: what each stage divides by N (parameters, gradients, optimizer state)
    sharded = {"dp": (0, 0, 0), "zero1": (0, 0, 1), "zero2": (0, 1, 1), "zero3": (1, 1, 1)}[kind]
    want = {"parameters": a * (shard if sharded[0] else padded),
            "gradients": a * (shard if sharded[1] else psi),
            "master": master * (shard if sharded[2] else padded),
            "moments": 8 * (shard if sharded[2] else padded)}
    return held, sent, want, psi


def reduced_gradient(dtype, comm, algorithm="ring"):
    """ZeRO-2's averaged gradient of step 0, gathered whole, per parameter (host float32)."""
    import minipar
    from minipar.flat import views
    from minipar.parallel.data import ZeRO

    model = build(dtype)
    app = ZeRO(model, adamw, comm, stage=2, bucket_cap_mb=0.001, algorithm=algorithm)
    n = BATCH // comm.size
    loss_of(model, 0, comm.rank * n, comm.rank * n + n).backward()
    whole = {}
    for bucket, shard in zip(app.buckets, app.shards):
        for p, g in zip(bucket, views(comm.all_gather(shard.grad).reshape(-1), bucket)):
            whole[id(p)] = minipar.to_numpy(g).astype("float32").tolist()
    return [whole[id(p)] for p in model.parameters()]


def resume(kind, dtype, comm, path):
    """Step 2 of a run resumed from its checkpoint of step 1 (the scaler's state kept beside),
    and the dtypes of the optimizer state loaded."""
    from minipar.distributed import checkpoint as dcp

    scales = {}

    def save(app, scaler):
        dcp.save({"app": app}, checkpoint_id=path)
        scales.update(scaler.state_dict() if scaler else {})

    train(kind, dtype, comm, save=save)
    app = wrap(kind, build(dtype, seed=9), comm)
    dcp.load({"app": app}, checkpoint_id=path)
    scaler = make_scaler(dtype)
    if scaler:
        scaler.load_state_dict(scales)
    dtypes = {str(v.dtype) for s in app.optimizer.state.values() for v in s.values()
              if hasattr(v, "dtype")}
    return train(kind, dtype, comm, steps=1, app=app, start=2, scaler=scaler), sorted(dtypes)


def near_the_top(comm):
    """The distinct values of ZeRO's averaged gradient shards (padding: 0) where every rank's
    float16 gradient is 40000 (float16 ends at 65504): divided first, the sum cannot overflow
    where the mean does not."""
    import minipar

    model = build("float16")
    app = wrap("zero1", model, comm)
    for p in model.parameters():
        p.grad = np.full(p.shape, 40000, "float16")
    app.step()  # stage 1 reduce-scatters in step()
    return sorted({float(v) for s in app.shards for v in np.unique(minipar.to_numpy(s.grad))})


def ranks_body(folder):
    from minipar import comm

    world = comm.world()
    out = {"memory": {}, "train": {}}
    for dtype in DTYPES + ("float32",):
        for kind in ("dp",) + KINDS:
            out["memory"][f"{kind} {dtype}"] = memory(kind, dtype, world)
    out["near the top"] = near_the_top(world)
    for dtype in DTYPES:
        out[f"gradient {dtype}"] = reduced_gradient(dtype, world)
        out[f"pairwise {dtype}"] = reduced_gradient(dtype, world, "pairwise")
        for kind in KINDS:
            out["train"][f"{kind} {dtype}"] = train(kind, dtype, world)
    if world.size == 2:  # a 16-bit checkpoint, saved after step 1, resumes bit for bit
        for dtype in DTYPES:
            for kind in ("zero2", "zero3"):
                path = f"{folder}/{kind}-{dtype}"
                out[f"resumed {kind} {dtype}"] = resume(kind, dtype, world, path)
    return out


def serial_twin(dtype, N, steps=STEPS, scale=True):
    """A serial 16-bit model and AdamW with ZeRO's rounding points on N ranks (module
    docstring): the parameters after ``steps`` steps (steps=0: step 0's averaged gradient)."""
    model = build(dtype)
    opt = adamw(model.parameters())
    scaler = make_scaler(dtype) if scale else None
    params = model.parameters()
    n = BATCH // N
    for s in range(max(steps, 1)):
        total = [np.zeros(p.shape, "float32") for p in params]
        size = [np.zeros(p.shape, "float32") for p in params]  # sum of |g_r / N|
        for r in range(N):
            model.zero_grad()
            loss = loss_of(model, s, r * n, r * n + n)
            (scaler.scale(loss) if scaler else loss).backward()
            for t, a, p in zip(total, size, params):
                d = (p.grad / N).astype(p.dtype).astype("float32")  # divided first, as ZeRO
                t += d
                a += np.abs(d)
        for t, p in zip(total, params):
            p.grad = t.astype(p.dtype)
        if steps == 0:
            return [p.grad.astype("float32") for p in params], size
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return [np.asarray(p.data).astype("float32") for p in params]


@pytest.mark.parametrize("N", [2, 3])
def test_zero_mixed_precision(N, tmp_path):
    import ml_dtypes

    results = run_on_ranks(ranks_body, N, args=(str(tmp_path),), timeout=400)
    for rank, got in enumerate(results):
        for key, (held, sent, want, psi) in got["memory"].items():
            kind, dtype = key.split()
            # by kind, to the byte: the paper's formula with this wrapper's padding
            assert {k: held[k] for k in want} == want, (rank, key, held, want)
            if dtype != "float32":  # 16-bit messages: half float32's bytes, by the counters
                assert 2 * sent == got["memory"][f"{kind} float32"][1], (rank, key)
    for got in results:
        assert got["near the top"][-1] == 40000.0, got["near the top"]  # not inf (0: padding)
    for dtype in DTYPES:
        eps = float(ml_dtypes.finfo(getattr(ml_dtypes, dtype, np.float16)).eps)
        # the averaged gradient: bit for bit on 2 ranks (one rounding, as the twin's); on 3 the
        # ring rounds once more, on a partial sum: each rounding errs by at most eps/2 times
        # the sum of the |g_r / N| (Higham's bound), so twice that at most
        twin, size = serial_twin(dtype, N, steps=0, scale=False)
        tiny = float(ml_dtypes.finfo(getattr(ml_dtypes, dtype, np.float16)).smallest_subnormal)
        for rank, got in enumerate(results):
            for g, w, a in zip(got[f"gradient {dtype}"], twin, size):
                bound = 0 if N == 2 else eps * a + tiny
                assert np.all(np.abs(np.array(g, "float32") - w) <= bound), (rank, dtype)
            # the pairwise reduce-scatter folds its N - 1 chunks in float32, rounds once: exact
            for g, w in zip(got[f"pairwise {dtype}"], twin):
                np.testing.assert_array_equal(np.array(g, "float32"), w, err_msg=dtype)
        twin = serial_twin(dtype, N)
        for kind in KINDS:
            for rank, got in enumerate(results):
                params = [np.array(p, "float32") for p in got["train"][f"{kind} {dtype}"]]
                for p, w in zip(params, twin):
                    if N == 2:  # one rounding in the reduction, as the twin's: bit for bit
                        np.testing.assert_array_equal(p, w, err_msg=f"{kind} {dtype}")
                    else:  # a gradient one unit apart moves Adam's update of an element whose
                        # gradient is near zero (m/√v) by up to lr: within lr a step
                        np.testing.assert_allclose(p, w, rtol=0, atol=STEPS * 1e-2,
                                                   err_msg=f"{kind} {dtype}")
    if N == 2:
        for got in results:
            for kind in ("zero2", "zero3"):
                for dtype in DTYPES:
                    resumed, state_dtypes = got[f"resumed {kind} {dtype}"]
                    assert resumed == got["train"][f"{kind} {dtype}"], (kind, dtype)
                    assert state_dtypes == ["float32"], kind  # masters and moments: float32
