"""ZeRO memory, measured on 4 ranks split into groups of 1, 2, 3 and 4: per rank, stage 1 and 2
hold ~1/N of plain data parallelism's optimizer state (exactly ceil(n_b / N) elements of each
bucket b: the padding), and stage 2 also ~1/N of its gradients once backward has returned."""
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
