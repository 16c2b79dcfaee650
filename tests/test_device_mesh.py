"""init_device_mesh and DeviceMesh (minipar.distributed.device_mesh): on 4 ranks a (dp, tp) mesh
numbers ranks as torch's (the last dimension fastest), its groups are RankGrid's tp-dp ones and
carry collectives; a 1-D mesh of the world; bad input is the same clear error on every rank."""
import pytest

from minipar.testing import run_on_ranks


def mesh_body():
    import numpy as np

    import minipar.distributed as dist
    from minipar.distributed.device_mesh import init_device_mesh
    from minipar.parallel.groups import RankGrid

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # starts the group too
    rank, grid = dist.get_rank(), RankGrid(4, tp=2)
    out = {"mesh": mesh.mesh.tolist(), "size": mesh.size(), "coordinate": mesh.get_coordinate(),
           "repr": repr(mesh["tp"])}
    for name in ("dp", "tp"):
        sub = mesh[name]
        group = sub.get_group()
        summed = np.array([float(rank)])
        dist.all_reduce(summed, group=group)
        out[name] = dict(ranks=dist.get_process_group_ranks(group),
                         grid=grid.group_of(rank, name), size=sub.size(),
                         local=mesh.get_local_rank(name), coord=grid.coords(rank)[name],
                         same=dist.get_process_group_ranks(mesh.get_group(name)),
                         summed=float(summed[0]))
    errors = {}
    for what, call in {"no dim": lambda: mesh.get_group(), "name": lambda: mesh["pp"],
                       "shape": lambda: init_device_mesh("cpu", (3,)),
                       "names": lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("dp", "x")),
                       "zero": lambda: init_device_mesh("cpu", (0, 4))}.items():
        try:
            call()
        except (ValueError, KeyError) as err:
            errors[what] = f"{type(err).__name__}: {err}"
    world = init_device_mesh("cpu", (4,))
    out["world"] = (world.ndim, world.size(), world.get_local_rank(),
                    dist.get_process_group_ranks(world.get_group()))
    return out, errors


@pytest.mark.mpi
def test_device_mesh_groups_are_the_rank_grids_in_torchs_order():
    per_rank = run_on_ranks(mesh_body, 4, timeout=60)
    for rank, (out, errors) in enumerate(per_rank):
        assert out["mesh"] == [[0, 1], [2, 3]] and out["size"] == 4
        assert out["coordinate"] == [rank // 2, rank % 2]
        for name in ("dp", "tp"):
            got = out[name]
            assert got["ranks"] == got["grid"] == got["same"], (rank, name, got)
            assert got["size"] == 2 and got["local"] == got["coord"]
            assert got["summed"] == sum(got["ranks"])
        assert out["repr"] == f"DeviceMesh('cpu', {out['tp']['ranks']}, mesh_dim_names=('tp',))"
        assert out["world"] == [1, 4, rank, [0, 1, 2, 3]]
        assert errors == per_rank[0][1]
    errors = per_rank[0][1]
    assert errors["no dim"].startswith("ValueError: this DeviceMesh has 2 dimensions")
    assert errors["name"].startswith("KeyError: \"mesh dimension 'pp' is not one of")
    assert errors["shape"] == ("ValueError: init_device_mesh: mesh_shape (3,) holds 3 ranks but "
                               "the job has 4 (mpiexec -n 3)")
    assert errors["names"].startswith("ValueError: mesh_dim_names ('dp', 'x') must be 1 distinct")
    assert errors["zero"].startswith("ValueError: init_device_mesh: mesh_shape (0, 4) must be")
