"""Parameter-server training (Li et al. 2014, "Scaling Distributed Machine Learning with the
Parameter Server"), synchronous: the data-parallel design before all-reduce.

Every rank is a worker computing the gradient of its local batch; servers own the parameters and
the optimizer. One step: push (every worker sends server j the slice it owns), update (each
server averages the N gradients of its slice and steps its optimizer), pull (every worker
receives the new parameters).

    ps = ParameterServer(model, lambda params: optim.SGD(params, lr=0.1), comm, sharded=True)
    loss.backward(); ps.step(); ps.zero_grad()

Cost per step (one server is the bottleneck; sharded, the bytes of a ring all-reduce):
docs/zero.md. Checkpoints: as ZeRO's (distributed/flat_state.py).
"""
import itertools

from ... import backend
from ...comm import Request, chunk_bounds, world
from ...distributed.flat_state import ParameterServerState
from ...nn.module import Parameter
from ...flat import flatten_grads, flatten_parameters, offsets
from .allreduce_optimizer import optimizer_memory
from .buckets import broadcast_parameters, gradient_bytes
from .zero import optimizer_over_shards, read_param_groups

PUSH, PULL = 11, 12  # message tags


class ParameterServer:
    """Synchronous parameter-server training of ``module``; ``step()`` after ``backward()``
    replaces ``optimizer.step()``. ``make_optimizer(params)`` builds the servers' optimizer."""

    def __init__(self, module, make_optimizer, comm=None, sharded=False, on_mismatch="warn"):
        self.comm, self.module = comm or world(), module
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        trainable = [p for p in module.parameters() if p.requires_grad]
        # the param groups make_optimizer gives the model's parameters (e.g. no decay on biases)
        probe, groups = read_param_groups(make_optimizer, module, trainable, "ParameterServer")
        # the parameters end to end in one flat vector, group by group (each p.data becomes a
        # view of it)
        self.params = [p for group in groups for p in group]
        self.flat = flatten_parameters(self.params)
        n = self.flat.size
        N = self.comm.size
        r = self.comm.rank
        # server j owns [b_j, b_j+1): sharded, every rank is a server of chunk j, 1/N of it;
        # else rank 0 (also a worker) owns the whole vector
        self.bounds = chunk_bounds(n, N) if sharded else [0] + [n] * N
        self.grad = backend.get_array_module(self.flat).empty_like(self.flat)
        lo, hi = self.bounds[r], self.bounds[r + 1]
        self.shard = Parameter(self.flat[lo:hi]) if hi > lo else None
        # the slice cut where one group ends and the next begins: (lo, hi, the group's
        # parameters) for each group it meets, the optimizer's parameters in order, each
        # Parameter a view of the slice in its group (one group: the slice itself)
        ends = list(itertools.accumulate(offsets(group)[1] for group in groups))
        self.served = [(max(lo, end - offsets(group)[1]), min(hi, end), group)
                       for group, end in zip(groups, ends)]
        pieces = [[Parameter(self.flat[a:b])] if b > a else [] for a, b, _ in self.served]
        self.served = [(a, b, group) for a, b, group in self.served if b > a]
        if len(groups) == 1 and self.shard is not None:
            pieces = [[self.shard]]
        self.pieces = [piece for group in pieces for piece in group]
        self.optimizer = (optimizer_over_shards(make_optimizer, probe, pieces, "ParameterServer")
                          if self.shard is not None else None)

    def _owned(self, j, vector):
        return vector[self.bounds[j]:self.bounds[j + 1]]

    def servers(self):
        return [j for j in range(self.comm.size) if self.bounds[j + 1] > self.bounds[j]]

    def step(self):
        c, r = self.comm, self.comm.rank
        lo = self.bounds[r]
        flatten_grads(self.params, self.grad)
        # push: my gradient's slice j to server j
        sends = [c.isend(self._owned(j, self.grad), j, PUSH) for j in self.servers() if j != r]
        if self.shard is not None:  # update: sum the N gradients in rank order, average, step
            # (the only optimizer state in the job lives on the servers)
            mine = self._owned(r, self.grad)
            got = backend.get_array_module(self.grad).empty(self.shard.size, self.grad.dtype)
            total = mine.copy() if r == 0 else c.recv(got, 0, PUSH).copy()
            for j in range(1, c.size):
                total += mine if j == r else c.recv(got, j, PUSH)
            total /= c.size
            for (a, _, _), piece in zip(self.served, self.pieces):
                piece.grad = total[a - lo:a - lo + piece.size]
            self.optimizer.step()
        Request.wait_all(sends)
        # pull: every server sends its slice of the parameters to every other rank
        recvs = [c.irecv(self._owned(j, self.flat), j, PULL) for j in self.servers() if j != r]
        sends = ([c.isend(self.shard.data, j, PULL) for j in range(c.size) if j != r]
                 if self.shard is not None else [])
        Request.wait_all(recvs + sends)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def memory_bytes(self):
        """Bytes this rank holds now, by kind as ZeRO's ``memory_bytes``: parameters, gradients
        (backward's, the push buffer, a server's averaged slice) and optimizer state (master,
        moments), which only the servers hold: all of it on rank 0 with one server, 1/N of it
        per rank sharded."""
        return {"parameters": int(self.flat.nbytes),
                "gradients": gradient_bytes(self.params + self.pieces, [self.grad]),
                **optimizer_memory(self.optimizer)}

    # --- checkpoints: serial names, the servers' pieces (distributed/flat_state.py) -----------
    def state_dict(self):
        """{"model": whole parameters, "optimizer": {"state": {name: {...}},
        "hyperparameters"}}: serial names, the servers' pieces of the optimizer state."""
        return ParameterServerState(self).state_dict()

    def load_state_dict(self, state_dict):
        """Load whole arrays in the format of ``state_dict()``; every problem is named before
        anything changes."""
        ParameterServerState(self).load_state_dict(state_dict)


def busiest_link(comm, before):
    """(bytes, rank): the most bytes one rank sent plus received since the counters read
    ``before`` (a ``comm.counters.snapshot()``). Gathered with a small MPI call that the
    counters do not see."""
    now = comm.counters.snapshot()
    mine = sum(now[key] - before[key] for key in ("bytes_sent", "bytes_received"))
    everyone = comm.all_gather_object(mine)
    rank = max(range(comm.size), key=everyone.__getitem__)
    return everyone[rank], rank
