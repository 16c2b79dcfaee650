"""Mixed precision in the parallel layouts equals the serial mixed-precision twin.

Each layout trains the tiny GPT with 16-bit parameters (fp32 masters), forward under autocast,
bf16 as is and fp16 with a GradScaler, against a serial twin rounding at the same points
(products rounded to 16 bits, LayerNorm, softmax and the loss in float32, the master update
rounded to 16 bits), except where the layout must round once more:
    TP  a row-parallel product is rounded on each rank before g sums the partials (in float32,
        rounded once), and so is f's backward dX      PP  each micro-batch's weight gradient
Stated for TP (sequence parallel too), PP and 3D (tp 2, pp 2): the first loss within 1/128 ulp
of the 16-bit dtype at the loss (measured 1/500 in bf16, 1/400 in fp16; a loss computed in 16
bits is off by up to 1/2), the loss after 3 steps within 1/16 (measured 1/46). DDP (autocast)
and ZeRO-3 (16 bits) on 2 ranks: bit for bit their twin (each half's g/2 rounded to 16 bits,
the two added in float32, rounded once). 16-bit messages: half the float32 bytes, by the
counters. One launch of 4 ranks.
"""
import contextlib

import numpy as np
import pytest

from minipar.testing import run_on_ranks

STEPS, B, T, C, H, V = 3, 4, 8, 16, 4, 32
DTYPES = ("bfloat16", "float16")
MANTISSA = {"float16": 10, "bfloat16": 7}


def ulp_at_loss(dtype):
    """The 16-bit dtype's spacing at the loss, in [2, 4) here: 2^(1 - mantissa bits)."""
    return 2.0 ** (1 - MANTISSA[dtype])


def _config():
    from minipar import nn

    return nn.GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=H, n_embd=C)


def _batch():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, (B, T))
    return ids, np.roll(ids, -1, axis=1)


def _optimizer(params):
    from minipar import optim

    # plain SGD: a rounding difference in the gradient moves the weights in proportion (Adam's
    # g/sqrt(v) would blow a tiny gradient's rounding up to a step of lr)
    return optim.SGD(params, lr=0.5)


def _scaler(dtype, group=None, scaled=True):
    """fp16 trains with dynamic loss scaling, bf16 without (a disabled scaler passes through)."""
    from minipar.amp import GradScaler

    return GradScaler(init_scale=2.0**10, enabled=scaled and dtype == "float16", group=group)


def _train(forward, opt, scaler, dtype, finish=None):
    """STEPS steps: ``forward()`` under autocast gives the loss, ``finish()`` (if given) runs
    after backward; the losses as floats."""
    from minipar import amp

    losses = []
    for _ in range(STEPS):
        with amp.autocast(dtype=dtype):
            loss = forward()
        scaler.scale(loss).backward()
        if finish is not None:
            finish()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _serial(dtype, scaled=True):
    """The twin: the serial GPT in 16 bits, forward under autocast, SGD on fp32 masters."""
    import minipar
    from minipar import nn

    minipar.manual_seed(7)
    model = nn.GPT(_config()).to(dtype)
    ids, targets = _batch()
    return _train(lambda: model(ids, targets)[1], _optimizer(model.parameters()),
                  _scaler(dtype, scaled=scaled), dtype)


def _bits(model):
    """The parameters' 16 bits, as JSON can carry them."""
    return [q.data.view(np.uint16).tobytes().hex() for q in model.parameters()]


def _halves_twin(dtype, autocast):
    """Data parallelism's twin on 2 ranks, with its rounding points: each half's gradient g
    (scaled), g/2 rounded to 16 bits, the two added in float32 and rounded once; the mean
    losses and the weights after STEPS steps."""
    import minipar
    from minipar import amp, nn

    minipar.manual_seed(7)
    model = nn.GPT(_config()).to(dtype)
    params = list(model.parameters())
    opt, scaler = _optimizer(params), _scaler(dtype)
    ids, targets = _batch()
    losses = []
    for _ in range(STEPS):
        total = [np.zeros(q.shape, np.float32) for q in params]
        for h in (slice(0, B // 2), slice(B // 2, B)):
            with amp.autocast(dtype=dtype, enabled=autocast):
                loss = model(ids[h], targets[h])[1]
            scaler.scale(loss).backward()
            for t, q in zip(total, params):
                t += (q.grad / np.array(2, q.dtype)).astype(np.float32)
            opt.zero_grad()
            losses.append(loss.item())
        for t, q in zip(total, params):
            q.grad = t.astype(q.dtype)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    means = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
    return means, _bits(model)


def _data_parallel(pair, dtype, kind, autocast=None):
    """DDP (under autocast) or ZeRO-3 (16 bits without autocast) over the pair, each rank its
    half of the batch: the pair's mean losses, the weights after STEPS steps."""
    import minipar
    from minipar import amp, nn
    from minipar.parallel.data import DistributedDataParallel, ZeRO3

    minipar.manual_seed(7)
    model = nn.GPT(_config()).to(dtype)
    if kind == "ddp":
        net = DistributedDataParallel(model, pair, algorithm="ring")
        opt = _optimizer(model.parameters())
    else:
        net, opt = model, ZeRO3(model, _optimizer, pair)
    scaler = _scaler(dtype, pair)
    ids, targets = _batch()
    mine = slice(pair.rank * B // 2, (pair.rank + 1) * B // 2)
    losses = []
    for _ in range(STEPS):
        with amp.autocast(dtype=dtype, enabled=kind == "ddp" if autocast is None else autocast):
            loss = net(ids[mine], targets[mine])[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(pair.all_reduce(np.array([loss.item()]), op="avg")[0]))
    with opt.summon_full_params() if kind == "zero3" else contextlib.nullcontext():
        return losses, _bits(model)


def _tensor_parallel(pair, dtype, seq=False):
    """TensorParallelGPT (tp = 2; ``seq``: sequence parallel): the losses, and the bytes each
    step's collectives sent."""
    import minipar
    from minipar import nn
    from minipar.parallel.tensor import CollectiveLog, shard_from_serial

    minipar.manual_seed(7)
    model = shard_from_serial(nn.GPT(_config()), pair, sequence_parallel=seq)
    ids, targets = _batch()
    if dtype == "float32":  # the bytes of one step in float32, for the count
        with CollectiveLog() as log:
            model(ids, targets)[1].backward()
            model.finalize_grads()
        return None, _sent(log.events, 1)
    model.to(dtype)
    with CollectiveLog() as log:
        losses = _train(lambda: model(ids, targets)[1], _optimizer(model.parameters()),
                        _scaler(dtype, pair), dtype, finish=model.finalize_grads)
    return losses, _sent(log.events, STEPS)


def _sent(events, steps):
    """Bytes this rank sent per step: the loss's three per-token all-reduces, and the rest."""
    loss = sum(e["sent"] for e in events if e["where"] == "loss") // steps
    return {"loss": loss, "activations": sum(e["sent"] for e in events) // steps - loss}


def _pipeline(pair, dtype, m=2):
    """The GPT cut into 2 stages, 1F1B with m micro-batches, the GradScaler in the pipeline. The
    last stage's losses (None elsewhere), and the bytes of the first step's messages."""
    import minipar
    from minipar import amp, nn
    from minipar import functional as F
    from minipar.parallel.pipeline import Pipeline, build

    minipar.manual_seed(7)
    model = nn.GPT(_config()).to_sequential()
    low = dtype != "float32"
    if low:
        model.to(dtype)
    pipe = Pipeline(model, build("1f1b", 2, m), pair, F.cross_entropy, optimizer=_optimizer,
                    scaler=_scaler(dtype, pair, scaled=low))
    ids, targets = _batch()
    losses, sent = [], []
    for _ in range(STEPS):
        before = pair.counters.bytes_sent
        with amp.autocast(dtype=dtype if low else "float16", enabled=low):
            loss = pipe.step(ids, targets)
        sent.append(pair.counters.bytes_sent - before)
        if loss is not None:
            losses.append(float(loss))
    return losses or None, sent[0]


def _pipeline_overflow(pair):
    """An inf in one stage-1 gradient: the scaler over the pipeline group skips the step on
    both stages and halves the scale on both."""
    import minipar
    from minipar import amp, nn
    from minipar import functional as F
    from minipar.parallel.pipeline import Pipeline, build

    minipar.manual_seed(7)
    scaler = _scaler("float16", pair)
    pipe = Pipeline(nn.GPT(_config()).to_sequential().half(), build("1f1b", 2, 2), pair,
                    F.cross_entropy, optimizer=_optimizer, scaler=scaler)
    before = [q.data.copy() for q in pipe.parameters()]
    if pair.rank == 1:  # lm_head's gradient, once complete, overflows: on stage 1 only
        pipe.parameters()[-1].register_post_accumulate_grad_hook(
            lambda q: q.grad.__setitem__(Ellipsis, np.inf))
    with amp.autocast(dtype="float16"):
        pipe.step(*_batch())
    kept = all(np.array_equal(a, q.data) for a, q in zip(before, pipe.parameters()))
    return {"weights kept": kept, "scale": scaler.get_scale()}


def _trainer3d(world, dtype):
    """Trainer3D (tp 2, pp 2) with 16-bit parameters (dtype=), its step under autocast; fp16
    with a GradScaler whose found-inf flag goes over the whole world (every group of the grid)."""
    from minipar import amp
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D

    groups = ParallelGroups(world, tp=2, pp=2)
    scaler = _scaler(dtype, world)
    trainer = Trainer3D(_config(), groups, "1f1b", microbatches=2, seed=7, dtype=dtype,
                        make_optimizer=_optimizer, scaler=scaler)
    ids, targets = _batch()
    losses = []
    for _ in range(STEPS):
        with amp.autocast(dtype=dtype):
            losses.append(float(trainer.step(ids, targets)))
    # the scaler saw every step: its growth tracker counts the clean ones (0 when disabled)
    return losses, scaler.state_dict().get("_growth_tracker", 0)


def amp_parallel_body():
    from minipar import comm

    world = comm.world()
    pair = world.split(color=world.rank // 2, key=world.rank)
    out = {"tp": {"float32": _tensor_parallel(pair, "float32")},
           "sp": {"float32": _tensor_parallel(pair, "float32", seq=True)},
           "pp": {"float32": _pipeline(pair, "float32")}}
    for name in ("serial", "unscaled", "halves", "halves 16", "ddp", "zero3", "3d"):
        out[name] = {}
    for dtype in DTYPES:
        out["serial"][dtype] = _serial(dtype)
        out["unscaled"][dtype] = _serial(dtype, scaled=False)
        out["halves"][dtype] = _halves_twin(dtype, autocast=True)
        out["halves 16"][dtype] = _halves_twin(dtype, autocast=False)
        out["tp"][dtype] = _tensor_parallel(pair, dtype)
        out["sp"][dtype] = _tensor_parallel(pair, dtype, seq=True)
        out["pp"][dtype] = _pipeline(pair, dtype)
        out["ddp"][dtype] = _data_parallel(pair, dtype, "ddp")
        out["zero3"][dtype] = _data_parallel(pair, dtype, "zero3")
        out["3d"][dtype] = _trainer3d(world, dtype)
    out["overflow"] = _pipeline_overflow(pair)
    out["stage"] = pair.rank
    try:  # last: a failed ZeRO-3 leaves gathers in flight on the pair
        out["zero3 autocast"] = _data_parallel(pair, "bfloat16", "zero3", autocast=True)
    except RuntimeError as error:
        out["zero3 autocast"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(amp_parallel_body, 4, timeout=400)


def _close(got, want, dtype):
    """The first step's loss within 1/128 ulp of the 16-bit dtype, the others within 1/16."""
    assert len(got) == len(want) == STEPS, (got, want)
    errors = [abs(a - b) / ulp_at_loss(dtype) for a, b in zip(got, want)]
    assert errors[0] <= 1 / 128 and max(errors) <= 1 / 16, (got, want, errors)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_tensor_parallel_equals_serial_twin(ranks, dtype, layout):
    for out in ranks:
        _close(out[layout][dtype][0], out["serial"][dtype], dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_tensor_parallel_messages_are_16_bit(ranks, dtype, layout):
    # every activation and activation gradient (and sequence parallelism's replicated
    # gradients): half the float32 bytes; the loss's three per-token numbers stay float32
    # (cross-entropy is on autocast's float32 list)
    for out in ranks:
        sent, full = out[layout][dtype][1], out[layout]["float32"][1]
        assert 2 * sent["activations"] == full["activations"] > 0, (sent, full)
        assert sent["loss"] == full["loss"] == 3 * B * T * 4, (sent, full)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_equals_serial_twin(ranks, dtype):
    last = [out for out in ranks if out["stage"] == 1]
    for out in last:
        _close(out["pp"][dtype][0], out["serial"][dtype], dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_messages_are_16_bit(ranks, dtype):
    headers = 2 * 8 * 8  # stage 0 sends a header of 8 int64 words before each activation
    flag = 4 if dtype == "float16" else 0  # the GradScaler's found-inf flag, one float32
    for out in ranks:
        sent, full = out["pp"][dtype][1] - flag, out["pp"]["float32"][1]
        if out["stage"] == 0:
            sent, full = sent - headers, full - headers
        assert 2 * sent == full == B * T * C * 4, (out["stage"], sent, full)


@pytest.mark.mpi
def test_grad_scaler_over_the_pipeline_group_skips_every_stage(ranks):
    for out in ranks:
        assert out["overflow"] == {"weights kept": True, "scale": 2.0**9}, out["overflow"]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, twin", [("ddp", "halves"), ("zero3", "halves 16")])
def test_ddp_and_zero3_equal_their_twin_bit_for_bit(ranks, dtype, kind, twin):
    # DDP under autocast; ZeRO-3 with 16-bit parameters, products in 16 bits, no autocast
    for out in ranks:
        assert out[kind][dtype] == out[twin][dtype]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_trainer3d_equals_serial_twin(ranks, dtype):
    for out in ranks:
        losses, clean_steps = out["3d"][dtype]
        _close(losses, out["serial"][dtype], dtype)
        assert clean_steps == (STEPS if dtype == "float16" else 0), clean_steps


@pytest.mark.mpi
def test_zero3_under_autocast_equals_its_twin(ranks):
    for out in ranks:
        assert out["zero3 autocast"] == out["halves"]["bfloat16"], out["zero3 autocast"]


def test_pipedream_refuses_a_grad_scaler():
    from minipar import nn
    from minipar import functional as F
    from minipar.amp import GradScaler
    from minipar.parallel.pipeline import Pipeline, build

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="PipeDream takes no GradScaler"):
        Pipeline(model, build("pipedream", 2, 2), None, F.cross_entropy, scaler=GradScaler())
