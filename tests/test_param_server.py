"""Parameter server, measured on 4 ranks: per step the single server's link (rank 0) carries
2(N-1)·n bytes, a worker's 2n, and with the parameters sharded every link carries
4(N-1)·n/N, sent plus received (n = bytes of the parameters)."""
import pytest

from minipar.testing import run_on_ranks


def link_body():
    from minipar import comm
    from minipar.parallel.data import ParameterServer, busiest_link
    from test_dp_helpers import OPTIMIZERS, loss_of, make_data, make_model

    world = comm.world()
    x, y = make_data("mlp", "float32")
    out = {}
    for sharded in (False, True):
        model = make_model("mlp", "float32")
        ps = ParameterServer(model, OPTIMIZERS["adam"], world, sharded=sharded)
        loss_of("mlp", model, x[:3], y[:3]).backward()
        before = world.counters.snapshot()
        ps.step()
        after = world.counters.snapshot()
        mine = sum(after[k] - before[k] for k in ("bytes_sent", "bytes_received"))
        out[str(sharded)] = (mine, busiest_link(world, before), int(ps.flat.nbytes),
                             ps.optimizer.state_bytes() if ps.optimizer else 0)
    return out


def test_busiest_link_bytes():
    results = run_on_ranks(link_body, 4, timeout=120)
    N = 4
    for rank, out in enumerate(results):
        mine, (busiest, where), n, state = out["False"]
        assert (busiest, where) == (2 * (N - 1) * n, 0)
        assert mine == (2 * (N - 1) * n if rank == 0 else 2 * n)
        assert state == (2 * n if rank == 0 else 0)  # Adam's two moments, on the server only
        mine, (busiest, _), n, state = out["True"]
        assert abs(busiest - 4 * (N - 1) * n / N) <= 4 * (N - 1) * 4  # chunks differ by 1 float
        assert abs(state - 2 * n / N) <= 2 * 4


@pytest.mark.parametrize("kind", ["ps", "ps-sharded"])
def test_parameter_server_keeps_param_groups(kind, tmp_path):
    """The servers' optimizer keeps AdamW's two param groups (decay on the matrices, none and
    another lr on biases and norms): each server's slice is cut where a group ends, equal to
    serial AdamW with the same groups; its checkpoint resumes and loads into serial (as
    ZeRO's: tests/test_zero.py)."""
    from test_zero import check_param_groups

    check_param_groups(kind, tmp_path)
