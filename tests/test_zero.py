"""ZeRO memory, measured on 4 ranks split into groups of 1, 2, 3 and 4: per rank, stage 1 and 2
hold ~1/N of plain data parallelism's optimizer state (exactly ceil(n_b / N) elements of each
bucket b: the padding), and stage 2 also ~1/N of its gradients once backward has returned."""
import json

import pytest

from minipar.testing import run_on_ranks


def memory_body():
    import numpy as np

    from minipar import comm
    from minipar.parallel.data import DistributedDataParallel, ZeRO
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    world = comm.world()
    x, y = make_data("gpt", "float64")
    rows = []
    for k in (1, 2, 3, 4):
        group = world.split(0 if world.rank < k else 1)
        lo = group.rank * 3
        measured = {}
        for name in ("dp", "zero1", "zero2"):
            model = make_model("gpt", "float64")
            if name == "dp":
                net = DistributedDataParallel(model, group, bucket_cap_mb=0.004)
                optimizer = OPTIMIZERS["adam"](model.parameters())
            else:
                net = ZeRO(model, OPTIMIZERS["adam"], group, stage=int(name[-1]),
                           bucket_cap_mb=0.004)
                optimizer = net.optimizer
            for _ in range(2):
                (net.zero_grad if name != "dp" else optimizer.zero_grad)()
                loss_of("gpt", model, x[lo:lo + 3], y[lo:lo + 3]).backward()
                grads = (net.memory_bytes()["gradients"] if name != "dp"
                         else net.gradient_bytes())
                (optimizer.step if name == "dp" else net.step)()
            buckets = len(net.buckets)
            measured[name] = (optimizer.state_bytes(), grads, buckets)
        rows.append((k, group.size, measured, int(np.dtype("float64").itemsize)))
    return rows


def test_zero_shards_optimizer_state_and_gradients():
    for rank, rows in enumerate(run_on_ranks(memory_body, 4, timeout=120)):
        for k, size, measured, itemsize in rows:
            if rank >= k:
                continue  # this rank was in the other group
            full_state, full_grads, _ = measured["dp"]
            for stage in ("zero1", "zero2"):
                state, grads, buckets = measured[stage]
                slack = 2 * buckets * itemsize  # Adam: 2 arrays, < 1 padding element per bucket
                assert abs(state - full_state / size) <= slack, (rank, k, stage, state, full_state)
                assert state / full_state == pytest.approx(1 / size, rel=0.02)
            # after backward: stage 2 keeps its gradient shards only, stage 1 the full gradients
            assert measured["zero2"][1] == pytest.approx(full_grads / size, rel=0.02)
            assert measured["zero1"][1] == full_grads


def two_groups(params):
    """torch's common AdamW groups: decay on the matrices, none on biases and norms (and a lr
    of their own, so that a group taken for the other shows)."""
    from minipar import optim

    params = list(params)
    return optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0,
                         "lr": 3e-3}], lr=1e-2, weight_decay=0.1)


def grouped_body(kind, folder):
    """Parameters after 3 steps of ``kind`` with two param groups (saved after step 2); and
    after step 3 again, from the checkpoint into a model of another seed."""
    import contextlib

    import minipar
    from minipar import comm
    from minipar.distributed import checkpoint as dcp
    from minipar.parallel.data import ParameterServer, ZeRO, ZeRO3
    from test_dp_helpers import loss_of, make_data, make_model

    world = comm.world()
    x, y = make_data("gpt", "float64")
    build = {"zero1": lambda m: ZeRO(m, two_groups, world, stage=1),
             "zero2": lambda m: ZeRO(m, two_groups, world, stage=2, bucket_cap_mb=0.001),
             "zero3": lambda m: ZeRO3(m, two_groups, world),
             "ps": lambda m: ParameterServer(m, two_groups, world),
             "ps-sharded": lambda m: ParameterServer(m, two_groups, world, sharded=True)}[kind]

    def whole(app, model):
        with app.summon_full_params() if kind == "zero3" else contextlib.nullcontext():
            return [minipar.to_numpy(p.data).tolist() for p in model.parameters()]

    def run(seed, steps, load=False):
        model = make_model("gpt", "float64", seed=seed)
        app = build(model)
        if load:
            dcp.load({"app": app}, checkpoint_id=folder)
        for s in range(3 - steps, 3):
            rows = slice(s * 4 + world.rank * 2, s * 4 + world.rank * 2 + 2)
            app.zero_grad()
            loss_of("gpt", model, x[rows], y[rows]).backward()
            app.step()
            if s == 1 and not load:
                dcp.save({"app": app}, checkpoint_id=folder)
        return whole(app, model), app.optimizer.hyperparameters() if app.optimizer else None

    return {"straight": run(0, 3), "resumed": run(99, 1, load=True)}


def serial_grouped(steps=3, seed=0):
    import minipar
    from test_dp_helpers import loss_of, make_data, make_model

    model = make_model("gpt", "float64", seed=seed)
    x, y = make_data("gpt", "float64")
    opt = two_groups(model.parameters())
    for s in range(steps):
        opt.zero_grad()
        loss_of("gpt", model, x[s * 4:s * 4 + 4], y[s * 4:s * 4 + 4]).backward()
        opt.step()
    return [minipar.to_numpy(p.data) for p in model.parameters()], opt


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3"])
def test_zero_keeps_param_groups(kind, tmp_path):
    """ZeRO-1, 2 (small buckets) and 3 on 2 ranks with AdamW in two param groups (decay on the
    matrices, none and another lr on biases and norms) equal serial AdamW with the same groups
    (float64); a bucket or segment never mixes groups. The checkpoint keeps both groups'
    hyperparameters and resumes bit for bit, and loads into the serial model and optimizer."""
    check_param_groups(kind, tmp_path)


def check_param_groups(kind, tmp_path):
    import numpy as np

    import minipar
    from minipar.distributed import AppState, checkpoint as dcp
    from test_dp_helpers import make_model

    folder = str(tmp_path / kind)
    want, serial_opt = serial_grouped()
    for got in run_on_ranks(grouped_body, 2, args=(kind, folder), timeout=180):
        params, hyper = got["straight"]
        assert max(float(np.max(np.abs(np.array(p) - w))) for p, w in zip(params, want)) < 1e-12
        if hyper is not None:  # not on a rank that serves nothing (one parameter server)
            assert hyper == json.loads(json.dumps(serial_opt.hyperparameters()))  # from JSON
        assert got["resumed"] == got["straight"]
    serial = make_model("gpt", "float64", seed=99)
    app = AppState(serial, two_groups(serial.parameters()))
    dcp.load({"app": app}, checkpoint_id=folder)
    at_two, opt_two = serial_grouped(steps=2)
    for p, w in zip(serial.parameters(), at_two):
        np.testing.assert_allclose(minipar.to_numpy(p.data), w, rtol=0, atol=1e-12)
    assert len(app.optimizer.state) == len(at_two)
    for i, s in opt_two.state.items():
        np.testing.assert_allclose(minipar.to_numpy(app.optimizer.state[i]["exp_avg_sq"]),
                                   minipar.to_numpy(s["exp_avg_sq"]), rtol=1e-10, atol=1e-20)


def refusal_body():
    """The message of each wrapper's refusal of groups that do not cover the model's trainable
    parameters exactly."""
    import minipar
    from minipar import comm, optim
    from minipar.parallel.data import ParameterServer, ZeRO, ZeRO3
    from test_dp_helpers import make_model

    world = comm.world()
    stray = minipar.nn.Parameter(minipar.zeros(3))

    def left_out(params):
        return optim.AdamW([p for p in params if p.ndim >= 2])

    def foreign(params):
        return optim.AdamW([{"params": list(params)}, {"params": [stray]}])

    said = {}
    for name, wrap in (("ZeRO", lambda m, f: ZeRO(m, f, world, stage=2)),
                       ("ZeRO3", lambda m, f: ZeRO3(m, f, world)),
                       ("ParameterServer", lambda m, f: ParameterServer(m, f, world))):
        for case, make in (("left out", left_out), ("foreign", foreign)):
            try:
                wrap(make_model("mlp", "float64"), make)
            except ValueError as err:
                said[f"{name} {case}"] = str(err)
    return said


def test_zero_refuses_groups_that_miss_or_add_parameters():
    for said in run_on_ranks(refusal_body, 2, timeout=120):
        for name in ("ZeRO", "ZeRO3", "ParameterServer"):
            assert said[f"{name} left out"].startswith(
                f"{name}: make_optimizer's param groups leave out 0.bias, 2.bias, 4.bias:")
            assert said[f"{name} foreign"].startswith(
                f"{name}: make_optimizer's param groups hold tensors that are not the model's")
