"""An FSDP2 training script as a PyTorch user writes it (fully_shard per block, then the root;
the optimizer after): torchrun --nproc_per_node 2 fsdp2_torch.py, or mpiexec -n 2 python
fsdp2_minipar.py, the same file with its imports changed. A 2-block causal transformer."""
import json

import numpy as np
import minipar as torch
import minipar.distributed as dist
import minipar.nn as nn
import minipar.nn.functional as F
import minipar.optim as optim
from minipar.distributed.device_mesh import init_device_mesh
from minipar.distributed.fsdp import MixedPrecisionPolicy, fully_shard

VOCAB, WIDTH, HEADS, LENGTH, LAYERS = 16, 16, 2, 8, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln_1(x)).reshape(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, positions):
        return self.head(self.ln_f(self.blocks(self.wte(ids) + self.wpe(positions))))


def main(steps=4, batch=8):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(0)  # data and init from NumPy: the same in both runs
    model = Transformer().double()
    model.load_state_dict({name: torch.tensor(rng.standard_normal(tuple(p.shape)) * 0.2)
                           for name, p in model.named_parameters()})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    positions = torch.tensor(np.arange(LENGTH))
    mine = slice(rank * batch // world, (rank + 1) * batch // world)
    losses = []
    for step in range(steps):
        tokens = rng.integers(0, VOCAB, (batch, LENGTH + 1))
        ids, targets = torch.tensor(tokens[mine, :-1]), torch.tensor(tokens[mine, 1:])
        logits = model(ids, positions)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        losses.append(mean.item() / world)
    params = [p.full_tensor().detach().numpy().ravel().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"rank": rank, "losses": losses, "params": params}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
