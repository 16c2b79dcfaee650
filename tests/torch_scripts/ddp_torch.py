"""A data-parallel training script as a PyTorch user writes it: torchrun --nproc_per_node 2
ddp_torch.py, or mpiexec -n 2 python ddp_minipar.py, the same file with its imports changed."""
import json

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main(epochs=3):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(0)  # data and init from NumPy: the same in both runs
    X = torch.tensor(rng.standard_normal((96, 8)))
    y = (X @ torch.tensor(rng.standard_normal((8, 1))) > 0).long().squeeze(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.tensor(rng.standard_normal(p.shape) * 0.5))
    ddp = DDP(model)
    dataset = TensorDataset(X, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            losses.append(mean.item() / world)
    params = [p.detach().numpy().ravel().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"rank": rank, "losses": losses, "params": params}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
