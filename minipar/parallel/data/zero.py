"""ZeRO (Rajbhandari et al. 2020): data parallelism without N copies of the optimizer state.

Stage 1 reduce-scatters the gradients, so that rank r averages only its 1/N shard and updates it
with its shard of the optimizer state, then all-gathers the parameters; stage 2 reduce-scatters
each bucket as soon as its gradients are ready during backward and frees the full gradients.
Both move the bytes of one ring all-reduce. Stage 3 (parameters sharded too) is zero3.py.

    zero = ZeRO(model, lambda params: optim.AdamW(params, lr=1e-3), comm, stage=2)
    loss.backward(); zero.step(); zero.zero_grad()

Memory and traffic per stage: docs/zero.md. Checkpoints: serial names, this rank's pieces of the
optimizer state (distributed/flat_state.py; docs/checkpoints.md).
"""
from ... import backend
from ...comm import chunk_bounds, world
from ...distributed.flat_state import ZeROState
from ...flat import flatten_grads, flatten_parameters, offsets
from ...nn.module import Parameter
from .buckets import ReadyQueue, broadcast_parameters, gradient_bytes, make_buckets

# the all-gather that completes each reduce-scatter algorithm (the other half of its all-reduce)
ALL_GATHER_TWIN = {"recursive_halving": "recursive_doubling", "pairwise": "ring"}


class ZeRO:
    """Sharded data-parallel training; ``step()`` after ``backward()`` replaces optimizer.step()."""

    def __init__(self, module, make_optimizer, comm=None, stage=1, bucket_cap_mb=None,
                 algorithm="ring", on_mismatch="warn"):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage {stage} is not here: choose 1 or 2 (stage 3, parameters "
                             f"sharded too, is minipar.parallel.data.ZeRO3)")
        self.module, self.comm = module, comm or world()
        self.stage = stage
        self.algorithm = algorithm
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        self.params = [p for p in module.parameters() if p.requires_grad]
        cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2**20
        # parameters grouped in reverse order into buckets (None: one bucket of everything, the
        # textbook picture); each bucket one flat vector, every parameter's .data a view into it
        self.buckets = make_buckets(self.params, cap)
        self.flats = []
        self.shards = []
        N = self.comm.size
        r = self.comm.rank
        for bucket in self.buckets:
            n = offsets(bucket)[1]
            flat = flatten_parameters(bucket, -(-n // N) * N)  # padded to a multiple of N
            # rank r owns chunk r of every bucket: a bucket's reduce-scatter lands on the owners
            # and its all-gather writes straight into the parameters
            lo, hi = chunk_bounds(flat.size, N)[r:r + 2]
            self.flats.append(flat)
            self.shards.append(Parameter(flat[lo:hi]))  # a view: updates land in the model
        # The optimizer sees one Parameter per bucket, the owned chunk, so it keeps state for
        # about n/N elements (plus at most N-1 padding elements per bucket). Its updates are
        # elementwise, so updating a flat shard gives the bits a per-parameter update gives;
        # global-norm clipping would need one more all-reduce and is not supported, nor is
        # gradient accumulation (no_sync).
        self.optimizer = make_optimizer(self.shards)
        if stage == 2:
            self.queue = ReadyQueue(self.buckets, self._reduce_scatter, lambda: None)

    def _reduce_scatter(self, i):
        """Average bucket i's gradients, keep this rank's chunk, drop the full gradients."""
        grad = flatten_grads(self.buckets[i], backend.get_array_module(self.flats[i]).zeros_like(
            self.flats[i]))
        self.shards[i].grad = self.comm.reduce_scatter(grad, op="avg", algorithm=self.algorithm)
        for p in self.buckets[i]:
            p.grad = None  # stage 2 frees the full gradient as soon as its bucket is reduced

    def step(self):
        """Reduce-scatter gradients (stage 1; stage 2 did it during backward), update the owned
        shard, all-gather the parameters."""
        if self.stage == 1:
            for i in range(len(self.buckets)):
                self._reduce_scatter(i)
        else:
            self.queue.flush()  # buckets whose parameters got no gradient
        ### BEGIN SOLUTION zero-sharded-step
        self.optimizer.step()
        gather = ALL_GATHER_TWIN.get(self.algorithm, self.algorithm)
        for flat, shard in zip(self.flats, self.shards):
            self.comm.all_gather(shard.data.copy(), algorithm=gather,
                                 out=flat.reshape(self.comm.size, -1))
        ### END SOLUTION

    def zero_grad(self):
        for p in self.params + self.shards:
            p.grad = None

    def memory_bytes(self):
        """Bytes this rank holds now: parameters, gradients (full ones and owned shards) and
        optimizer state. Call it after backward to see stage 2's saving."""
        return {"parameters": sum(int(f.nbytes) for f in self.flats),
                "gradients": gradient_bytes(self.params) + gradient_bytes(self.shards),
                "optimizer_state": self.optimizer.state_bytes()}

    # --- checkpoints: serial names, this rank's pieces (distributed/flat_state.py) ---------------
    def state_dict(self):
        """{"model": whole parameters, "optimizer": {"state": {name: {"step", name: sharded}},
        "hyperparameters"}}: serial names, this rank's pieces of the optimizer state."""
        return ZeROState(self).state_dict()

    def load_state_dict(self, state_dict):
        """Load whole arrays in the format of ``state_dict()``; every problem is named before
        anything changes."""
        ZeROState(self).load_state_dict(state_dict)
