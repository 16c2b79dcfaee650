"""torch.distributed's collectives and point-to-point calls, used directly, as a PyTorch user
writes them: torchrun --nproc_per_node 2 collectives_torch.py, or mpiexec -n 2 python
collectives_minipar.py, the same file with its imports changed. Each rank prints what it got."""
import json

import numpy as np
import minipar as torch
import minipar.distributed as dist


def main(n=6):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor(np.random.default_rng(rank).standard_normal(n))  # each rank its own
    got = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
                     ("product", dist.ReduceOp.PRODUCT)):
        t = x.clone()
        dist.all_reduce(t, op=op)
        got["all_reduce " + name] = t.tolist()
    t = x.clone()
    dist.broadcast(t, src=world - 1)
    got["broadcast"] = t.tolist()
    parts = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, x)
    got["all_gather"] = [p.tolist() for p in parts]
    flat = torch.zeros(world * n, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, x)
    got["all_gather_into_tensor"] = flat.tolist()
    chunk = torch.zeros(n // world, dtype=torch.float64)
    dist.reduce_scatter_tensor(chunk, x, op=dist.ReduceOp.SUM)
    got["reduce_scatter_tensor"] = chunk.tolist()
    chunk = torch.zeros(n // world, dtype=torch.float64)
    dist.reduce_scatter(chunk, [x[i * n // world:(i + 1) * n // world] for i in range(world)])
    got["reduce_scatter"] = chunk.tolist()
    t = torch.zeros(n, dtype=torch.float64)
    if rank == 0:  # a ring of two: 0 sends first, 1 receives first
        dist.send(x * 2, dst=1)
        dist.recv(t, src=1)
    else:
        dist.recv(t, src=0)
        dist.send(x * 2, dst=0)
    got["send/recv"] = t.tolist()
    print("RESULT " + json.dumps({"rank": rank, "got": got}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
