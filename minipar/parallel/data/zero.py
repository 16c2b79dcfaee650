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
from ...flat import flatten_grads, flatten_parameters, offsets, padded_numel
from ...nn.module import Parameter
from .allreduce_optimizer import mean_op, optimizer_memory
from .buckets import ReadyQueue, broadcast_parameters, gradient_bytes, make_buckets

# the all-gather that completes each reduce-scatter algorithm (the other half of its all-reduce)
ALL_GATHER_TWIN = {"recursive_halving": "recursive_doubling", "pairwise": "ring"}


def read_param_groups(make_optimizer, module, params, owner):
    """(optimizer, [[parameters of group g, in model order]]): ``make_optimizer(params)`` built
    over the model's own parameters to read its param groups (no state yet). Each array is a view
    meanwhile, so an optimizer that lays its own arrays end to end (Adam's Flat) copies nothing.
    A trainable parameter in no group, or a group holding another tensor, is a ValueError."""
    arrays = [p.data for p in params]
    for p in params:
        p.data = p.data[...]
    try:
        probe = make_optimizer(params)
    finally:
        for p, array in zip(params, arrays):
            p.data = array
    groups = getattr(probe, "param_groups", [{"params": params}])
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    names = {id(p): name for name, p in module.named_parameters()}
    left = [names[id(p)] for p in params if id(p) not in group_of]
    if left:
        raise ValueError(f"{owner}: make_optimizer's param groups leave out {', '.join(left)}: "
                         f"every trainable parameter is sharded and updated; put it in a group "
                         f"or freeze it (requires_grad = False)")
    if len(group_of) != len(params):
        raise ValueError(f"{owner}: make_optimizer's param groups hold tensors that are not the "
                         f"model's trainable parameters; build them from the params it is given")
    return probe, [[p for p in params if group_of[id(p)] == g] for g in range(len(groups))]


def optimizer_over_shards(make_optimizer, probe, shards, owner):
    """The optimizer of the flat shards, ``shards[g]`` those of param group g: for one group
    ``make_optimizer(shards[0])``; for several, the probe's class again, group g with its own
    hyperparameters over its shards (torch's ZeroRedundancyOptimizer builds its own so)."""
    if len(shards) == 1:
        return make_optimizer(shards[0])
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": mine}
              for group, mine in zip(probe.param_groups, shards)]
    try:
        return type(probe)(groups, **probe.defaults)
    except TypeError as err:
        raise TypeError(f"{owner}: {type(probe).__name__}(param_groups, **defaults) failed "
                        f"({err}): with several param groups the optimizer is built again over "
                        f"the flat shards so, from its defaults") from err


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
        # the param groups make_optimizer gives the model's parameters (e.g. no decay on biases)
        probe, groups = read_param_groups(make_optimizer, module, self.params, "ZeRO")
        # each group's parameters in reverse order into buckets (None: one bucket of each group,
        # the textbook picture), so a bucket never mixes groups: its shard takes one group's
        # lr and decay. Buckets go group by group, so with several groups stage 2 starts the
        # next group's reduce-scatters only after the last bucket of the one before.
        # Each bucket is one flat vector, every parameter's .data a view into it.
        by_group = [make_buckets(group, cap) for group in groups]
        self.buckets = [bucket for buckets in by_group for bucket in buckets]
        self.flats = []
        self.shards = []
        N = self.comm.size
        r = self.comm.rank
        for bucket in self.buckets:
            n = offsets(bucket)[1]
            flat = flatten_parameters(bucket, padded_numel(n, N))
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
        shards = iter(self.shards)  # group g's: one per bucket of its own
        grouped = [[next(shards) for _ in buckets] for buckets in by_group]
        self.optimizer = optimizer_over_shards(make_optimizer, probe, grouped, "ZeRO")
        if stage == 2:
            self.queue = ReadyQueue(self.buckets, self._reduce_scatter, lambda: None)

    def _reduce_scatter(self, i):
        """Average bucket i's gradients, keep this rank's chunk, drop the full gradients."""
        grad = flatten_grads(self.buckets[i], backend.get_array_module(self.flats[i]).zeros_like(
            self.flats[i]))
        op = mean_op(grad, self.comm)
        self.shards[i].grad = self.comm.reduce_scatter(grad, op=op, algorithm=self.algorithm)
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
        """Bytes this rank holds now, by kind (their sum is the total): parameters, gradients
        (full ones and owned shards) and optimizer state as master and moments
        (``optimizer_memory``). Call it after backward to
        see stage 2's saving; in mixed precision with Adam: 2 + 2 + 12/N per parameter (stage
        1), 2 + 14/N (stage 2), plus each bucket's padding (docs/zero.md)."""
        return {"parameters": sum(int(f.nbytes) for f in self.flats),
                "gradients": gradient_bytes(self.params) + gradient_bytes(self.shards),
                **optimizer_memory(self.optimizer)}

    # --- checkpoints: serial names, this rank's pieces (distributed/flat_state.py) ---------------
    def state_dict(self):
        """{"model": whole parameters, "optimizer": {"state": {name: {"step", name: sharded}},
        "hyperparameters"}}: serial names, this rank's pieces of the optimizer state."""
        return ZeROState(self).state_dict()

    def load_state_dict(self, state_dict):
        """Load whole arrays in the format of ``state_dict()``; every problem is named before
        anything changes."""
        ZeROState(self).load_state_dict(state_dict)
