"""FSDP2's API over ZeRO-3 (minipar.distributed.fsdp):

- fully_shard per GPT block then on the root, the optimizer built after over
  model.parameters(), trains to the serial model's parameters and to ZeRO-3's (units = the
  blocks and the remaining layers) within 1e-12 in float64 on 2 and 4 ranks: SGD with momentum
  and AdamW, an MLP sharded layer by layer, reshard_after_forward=False, gradient accumulation
  over two backward passes;
- a rank holds what ZeRO-3 holds (parameters, gradients, optimizer state, gathered copies),
  less the padding ZeRO-3 keeps in its flat shards; a unit not resharded keeps its copy;
- MixedPrecisionPolicy: float32 copies and reduction of a float64 model;
- bad input is the same clear error on every rank.
"""
import numpy as np
import pytest

from minipar.testing import run_on_ranks

TOL = 1e-12
CASES = [("gpt", "adamw", {}), ("gpt", "sgd", {}), ("mlp", "adamw", {}),
         ("gpt", "adamw", dict(reshard_after_forward=False)), ("gpt", "adamw", dict(accumulate=2))]


def shard(kind, model, mesh, **options):
    """torch's recipe: each block (an MLP's each layer), then the root."""
    from minipar.distributed.fsdp import fully_shard
    for layer in (model.blocks if kind == "gpt" else model):
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def train_fsdp(kind, opt, steps, accumulate=1, **options):
    """Whole parameters (host arrays) after ``steps`` FSDP2 steps on this rank's share."""
    import minipar
    from minipar.distributed.device_mesh import init_device_mesh
    from minipar.parallel.data import DistributedSampler
    from test_dp_helpers import GLOBAL_BATCH, OPTIMIZERS, loss_of, make_data, make_model

    model = make_model(kind, "float64")
    x, y = make_data(kind, "float64")
    mesh = init_device_mesh("cpu", (minipar.distributed.get_world_size(),),
                            mesh_dim_names=("dp",))
    shard(kind, model, mesh, **options)
    optimizer = OPTIMIZERS[opt](model.parameters())
    batches = DistributedSampler(len(x), mesh.size(), mesh.get_local_rank(), seed=5).batches(
        GLOBAL_BATCH)
    for idx in batches[:steps]:
        for part in np.array_split(idx, accumulate):
            (loss_of(kind, model, x[part], y[part]) * (len(part) / len(idx))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [minipar.to_numpy(p.full_tensor().data) for p in model.parameters()]


def equivalence_body():
    import minipar.distributed as dist
    from minipar import comm
    from test_dp_helpers import STEPS, max_difference, train
    from test_zero3 import train_zero3

    dist.init_process_group("mpi")
    report, serial = [], {}
    for kind, opt, options in CASES:
        if (kind, opt) not in serial:
            serial[kind, opt] = train(kind, "float64", opt)
        got = train_fsdp(kind, opt, STEPS, **options)
        report.append((f"{kind} {opt} {options} vs serial", max_difference(serial[kind, opt], got)))
        if not options:
            zero = train_zero3(kind, opt, comm.world(), STEPS,
                               **(dict(units="blocks") if kind == "gpt" else {}))
            report.append((f"{kind} {opt} vs ZeRO3", max_difference(zero, got)))
    return report


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fsdp2_trains_as_serial_and_as_zero3(nprocs):
    per_rank = run_on_ranks(equivalence_body, nprocs, timeout=300)
    failures = [f"rank {r}: {name}: max |difference| {diff:.3g} > {TOL:g}"
                for r, report in enumerate(per_rank) for name, diff in report if diff > TOL]
    assert not failures, "\n".join(failures)
    print({name: f"{diff:.2g}" for name, diff in per_rank[0]})


def memory_body():
    """After one backward: FSDP's bytes against ZeRO-3's (same units), and kept copies."""
    import minipar.distributed as dist
    from minipar import comm
    from minipar.parallel.data import ZeRO3
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    dist.init_process_group("mpi")
    world = comm.world()
    x, y = make_data("gpt", "float64")
    mine = slice(world.rank * 2, world.rank * 2 + 2)
    held = {}
    for way in ("zero3", "fsdp", "kept"):
        model = make_model("gpt", "float64")
        if way == "zero3":
            units = list(model.blocks) + [model.embed.wte, model.embed.wpe, model.ln_f,
                                          model.lm_head]
            runner = ZeRO3(model, OPTIMIZERS["adam"], world, units=units)
            optimizer = runner.optimizer
        else:
            shard("gpt", model, None, reshard_after_forward=way == "fsdp")
            runner = model._get_fsdp_state()
            optimizer = OPTIMIZERS["adam"](model.parameters())
        loss = loss_of("gpt", model, x[mine], y[mine])
        after_forward = runner.memory_bytes(optimizer)["gathered"]
        loss.backward()
        (runner.step if way == "zero3" else optimizer.step)()
        # the padding at the end of each unit's vector: in ZeRO-3's shards only
        padding = sum(max(0, min(seg.lo + seg.shard.size, seg.numel)
                          - max(seg.lo, seg.offsets[-1] + seg.params[-1].size))
                      for u in runner.units for seg in u.segments)
        held[way] = dict(runner.memory_bytes(optimizer), after_forward=after_forward,
                         peak=runner.peak_gathered_bytes, padding=8 * padding,
                         largest=8 * max(u.numel for u in runner.units),
                         total=8 * sum(u.numel for u in runner.units))
    return held


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fsdp2_holds_what_zero3_holds(nprocs):
    for r, held in enumerate(run_on_ranks(memory_body, nprocs, timeout=120)):
        zero, fsdp, kept = held["zero3"], held["fsdp"], held["kept"]
        assert fsdp["padding"] == zero["padding"]
        assert fsdp["parameters"] == zero["parameters"] > 0, (r, held)
        assert fsdp["gathered"] == zero["gathered"] == 0 and fsdp["peak"] == zero["peak"]
        # gradients and Adam's two moments: ZeRO-3's shards hold the padding, FSDP's pieces not
        assert fsdp["gradients"] == zero["gradients"] - zero["padding"], (r, held)
        assert fsdp["moments"] == zero["moments"] - 2 * zero["padding"], (r, held)
        # resharded: two slots, each the largest unit's size; else every unit's own copy
        assert zero["after_forward"] == fsdp["after_forward"] == 2 * zero["largest"]
        assert kept["after_forward"] == kept["total"], held
        assert kept["gathered"] == 0, held


def mixed_precision_body():
    """A float64 GPT, gathered and reduced in float32: shards and optimizer stay float64, the
    loss is float32's, and training stays within float32's rounding of the float64 run."""
    import minipar
    import minipar.distributed as dist
    from minipar.distributed.fsdp import MixedPrecisionPolicy
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    dist.init_process_group("mpi")
    x, y = make_data("gpt", "float64")
    mine = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    out = {}
    for name, policy in (("64", None), ("32", MixedPrecisionPolicy(minipar.float32, "float32"))):
        model = make_model("gpt", "float64")
        shard("gpt", model, None, mp_policy=policy)
        optimizer = OPTIMIZERS["adamw"](model.parameters())
        losses = []
        for _ in range(3):
            loss = loss_of("gpt", model, x[mine], y[mine])
            losses.append(float(loss.item()))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        out[name] = dict(losses=losses, loss_dtype=str(loss.dtype),
                         shards=sorted({str(p.dtype) for p in model.parameters()}),
                         peak=model._get_fsdp_state().peak_gathered_bytes)
    return out


@pytest.mark.mpi
def test_fsdp2_mixed_precision_policy():
    for got in run_on_ranks(mixed_precision_body, 2, timeout=120):
        assert got["32"]["loss_dtype"] == "float32" and got["64"]["loss_dtype"] == "float64"
        assert got["32"]["shards"] == got["64"]["shards"] == ["float64"]
        assert got["32"]["peak"] * 2 == got["64"]["peak"]
        difference = np.abs(np.subtract(got["32"]["losses"], got["64"]["losses"])).max()
        assert 0 < difference < 1e-5, got


def bad_input_body():
    """Each refusal's type and message, on this rank."""
    import minipar.distributed as dist
    import minipar.nn as nn
    from minipar.distributed.device_mesh import init_device_mesh
    from minipar.distributed.fsdp import fully_shard

    dist.init_process_group("mpi")
    n = dist.get_world_size()
    twice = fully_shard(nn.Linear(2, 2))
    nested = nn.Sequential(nn.Linear(2, 2))
    fully_shard(nested[0], mesh=init_device_mesh("cpu", (n,)))
    mine = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(mine[1])
    mine.own = nn.Parameter(np.ones(2))  # the root's own parameter beside a sharded child
    calls = {"non-module": lambda: fully_shard([nn.Linear(2, 2)]),
             "twice": lambda: fully_shard(twice),
             "mesh size": lambda: init_device_mesh("cpu", (n + 1,)),
             "mesh names": lambda: init_device_mesh("cpu", (n,), mesh_dim_names=("a", "b")),
             "2-D mesh": lambda: fully_shard(nn.Linear(2, 2),
                                             mesh=init_device_mesh("cpu", (1, n))),
             "not a mesh": lambda: fully_shard(nn.Linear(2, 2), mesh=[0, 1]),
             "policy": lambda: fully_shard(nn.Linear(2, 2), mp_policy="bf16"),
             "reshard": lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward=2),
             "offload": lambda: fully_shard(nn.Linear(2, 2), offload_policy=object()),
             "other policy": lambda: fully_shard(nested, mp_policy=dist.MixedPrecisionPolicy(
                 param_dtype="float32")),
             "own parameters": lambda: fully_shard(mine)}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as err:  # noqa: BLE001  (the error is what is tested)
            out[name] = f"{type(err).__name__}: {err}"
    return out


EXPECTED = {"non-module": "TypeError: fully_shard: expected an nn.Module, got list",
            "twice": "ValueError: fully_shard: FSDPLinear is already sharded",
            "mesh size": "ValueError: init_device_mesh: mesh_shape",
            "mesh names": "ValueError: mesh_dim_names ('a', 'b') must be 1 distinct strings",
            "2-D mesh": "ValueError: fully_shard: mesh has 2 dimensions",
            "not a mesh": "TypeError: fully_shard: mesh must be a DeviceMesh",
            "policy": "TypeError: fully_shard: mp_policy must be a MixedPrecisionPolicy, got str",
            "reshard": "TypeError: fully_shard: reshard_after_forward must be True or False",
            "offload": "TypeError: fully_shard: offload_policy not supported here",
            "other policy": "ValueError: fully_shard(Sequential): its sharded submodules use "
                            "another mesh or mp_policy",
            "own parameters": "ValueError: fully_shard(Sequential): Sequential holds parameters "
                              "of its own and sharded submodules"}


@pytest.mark.mpi
def test_fsdp2_bad_input_is_the_same_clear_error_on_every_rank():
    per_rank = run_on_ranks(bad_input_body, 2, timeout=60)
    assert per_rank[0] == per_rank[1], per_rank
    for name, start in EXPECTED.items():
        assert per_rank[0][name] is not None and per_rank[0][name].startswith(start), \
            (name, per_rank[0][name])
