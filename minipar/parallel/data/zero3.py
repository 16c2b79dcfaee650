"""ZeRO stage 3 (Rajbhandari et al. 2020), PyTorch's fully sharded data parallel (Zhao et al.
2023): parameters, gradients and optimizer state all sharded, 1/N per rank; each layer (a unit)
is gathered whole only while it computes.

    zero = ZeRO3(model, lambda params: optim.AdamW(params, lr=1e-3), comm)
    loss = loss_fn(model(x_local), y_local); loss.backward(); zero.step(); zero.zero_grad()

One step, unit by unit, its memory and its traffic (1.5x data parallelism's all-reduce):
docs/zero.md. Checkpoints: ZeRO's format, the parameters in pieces too (distributed/flat_state.py).
"""
import contextlib

from ... import backend
from ...autograd import Tensor, is_grad_enabled
from ...comm import Request, world
from ...comm.nonblocking import iall_gather, ireduce_scatter
from ...distributed.flat_state import ZeRO3State
from ...flat import flatten_grads
from .allreduce_optimizer import mean_op, optimizer_memory
from .buckets import broadcast_parameters
from .zero import ALL_GATHER_TWIN, optimizer_over_shards, read_param_groups
from .zero3_units import Float8Gather, Unit, layer_units

# A layer's backward closures keep views of the arrays it read, so its gathered copy cannot be
# dropped and made anew for backward: unit i is gathered into slot i mod 2, always the same
# memory, and a rank holds two units whole at most (docs/zero.md, "where free is real").
SLOTS = 2  # gathered copies a rank holds at once: the unit computing and the one prefetched


def hook_units(module, units, runner):
    """The hooks that run one step, per unit, in the order the model calls them (docs/zero.md):
    ``runner()`` is the ZeRO3 running them now (fsdp.py's changes when an outer module is
    wrapped); the whole forward's hooks act on the module that state runs from only."""
    def start(m, args):
        return runner()._start_forward(m, args) if runner().module is m else None
    module.register_forward_pre_hook(start)
    for u in units:
        u.module.register_forward_pre_hook(lambda m, args, u=u: runner()._before_forward(u))
        u.module.register_forward_hook(lambda m, args, out, u=u: runner()._after_forward(u, out))
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p: runner()._gradient_ready(p))
    module.register_forward_hook(
        lambda m, args, out: runner()._end_forward(m, args, out) if runner().module is m else None)


class ZeRO3:
    """Fully sharded data parallel training; ``step()`` after ``backward()`` replaces
    optimizer.step(). ``units``: the modules gathered as one (default ``layer_units``);
    ``prefetch``: start the next unit's gather before it is needed. ``all_gather_dtype``
    ("float8_e4m3fn" or "float8_e5m2"): parameters all-gathered in FP8 with a scale each
    (zero3_units.Float8Gather), computed with in their own dtype."""

    def __init__(self, module, make_optimizer, comm=None, units=None, algorithm="ring",
                 prefetch=True, on_mismatch="warn", all_gather_dtype=None):
        self._setup(module, comm, algorithm, prefetch, all_gather_dtype=all_gather_dtype)
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        trainable = [p for p in module.parameters() if p.requires_grad]
        # the param groups make_optimizer gives the model's parameters (e.g. no decay on biases)
        probe, groups = read_param_groups(make_optimizer, module, trainable, "ZeRO3")
        group_of = {id(p): g for g, group in enumerate(groups) for p in group}
        self._adopt(self._make_units(module, layer_units(module) if units is None else
                                     [(m, [p for p in m.parameters() if p.requires_grad])
                                      for m in units], group_of))
        shards = [[s.shard for s in self.segments if s.group == g] for g in range(len(groups))]
        self.optimizer = optimizer_over_shards(make_optimizer, probe, shards, "ZeRO3")
        hook_units(module, self.units, lambda: self)

    def _setup(self, module, comm, algorithm, prefetch, param_dtype=None, reduce_dtype=None,
               all_gather_dtype=None):
        self.module, self.comm = module, comm or world()
        self.algorithm = algorithm  # the reduce-scatter's
        self.gather_algorithm = ALL_GATHER_TWIN.get(algorithm, algorithm)
        self.prefetch = prefetch
        # mixed precision (FSDP's policy): gathered copies in param_dtype, gradients reduced in
        # reduce_dtype, both back in the shards' dtype for the optimizer (None: the shards')
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.float8 = None if all_gather_dtype is None else Float8Gather(all_gather_dtype)

    def _adopt(self, units):
        """Run ``units`` (each unit's gathered copy, its gradients' reduce-scatter) from now on."""
        if self.float8 is not None:
            self.float8.check(units)
        self.units = units
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        # every segment, group by group: the optimizer's parameter i is segments[i]'s shard
        self.segments = sorted((s for u in self.units for s in u.segments), key=lambda s: s.group)
        self.order = []  # the units in forward order, as first seen: the next forward's guess
        self.ran = []  # the units this forward ran, in order: exact for its backward
        self._drop_slots()  # no slot, no holder (the unit whose copy a slot holds)
        self.slot_size = max((u.numel for u in self.units), default=0)  # a slot holds any unit
        self.peak_gathered_bytes = 0
        self.expect_backward = False  # the forward under way recorded a graph
        self.forwards = 0

    def _make_units(self, module, pairs, group_of):
        """One Unit per (module, parameters); every trainable parameter in exactly one."""
        names = {id(m): name or type(m).__name__ for name, m in module.named_modules()}
        owner = {}
        for m, params in pairs:
            if id(m) not in names:
                raise ValueError(f"ZeRO3: unit {type(m).__name__} is not a module of the model")
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"ZeRO3: a parameter of {names[id(m)]!r} also belongs to "
                                     f"{owner[id(p)]!r} (shared or nested units): each parameter "
                                     f"must be in exactly one unit")
                owner[id(p)] = names[id(m)]
        left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
        if left:
            raise ValueError(f"ZeRO3: parameters in no unit: {', '.join(left)}; list their "
                             f"modules in units=")
        return [Unit(names[id(m)], m, ps, self.comm, group_of) for m, ps in pairs if ps]

    # --- gathering into the slots ----------------------------------------------------------------
    def _gather(self, u):
        """Start the all-gather of unit u into its slot (allocated on first use)."""
        s = u.slot
        holder = self.holder[s]
        if self._busy(u):
            raise RuntimeError(f"ZeRO3: unit {u.name!r} needs slot {s}, held by {holder.name!r}, "
                               f"which is still computing: units nest two deep at most, their "
                               f"backward in the reverse order of their forward; choose units=")
        if self.slots[s] is None:
            self.slots[s] = self._empty(u, self.slot_size)
            gathered = sum(int(slot.nbytes) for slot in self.slots if slot is not None)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)
        if holder is not None and holder is not u:
            self._cancel(holder)
        self.holder[s] = u
        self._start_gather(u, self.slots[s])

    def _empty(self, u, numel):  # an uninitialised flat vector for gathered copies of u
        shard = u.segments[0].shard
        return backend.get_array_module(shard.data).empty(numel, self.param_dtype or shard.dtype)

    def _start_gather(self, u, flat):
        """Start the all-gathers of u's segments into ``flat`` (u's place in a slot)."""
        # collectives run on the communicator's thread in the order started, alike on all ranks
        if self.float8 is not None:  # FP8 bytes now, dequantised into flat in _use
            u.work = [self.float8.start(self.comm, seg, self.gather_algorithm)
                      for seg in u.segments]
            return
        u.work = [iall_gather(self.comm, seg.shard.data.astype(flat.dtype, copy=False),
                              self.gather_algorithm,
                              out=flat[seg.start:seg.start + seg.numel].reshape(self.comm.size, -1))
                  for seg in u.segments]

    def _cancel(self, u):
        """Forget u's gather if one is under way: u was prefetched but did not run (a head this
        step leaves out); it gathers anew when it does. Waited for, as every rank started it."""
        if u.work is not None:
            Request.wait_all(u.work)
            u.work = None

    def _use(self, u, state):
        """Wait for unit u's gather (starting it if nobody did) and point its parameters in."""
        if u.work is None:
            self._gather(u)
        gathered, flat = Request.wait_all(u.work), self._buffer(u)
        u.work = None
        u.state = state
        if self.float8 is not None:  # FP8 gathered (none: a kept copy, dequantised in forward)
            for seg, data in zip(u.segments, gathered):
                self.float8.finish(seg, data, flat[seg.start:seg.start + seg.numel])
        u.point(flat)

    def _buffer(self, u):  # the gathered copy u's parameters point into while it computes
        return self.slots[u.slot]

    def _neighbour(self, u, step, order):  # the unit ``step`` places after u in ``order``
        i = order.index(u) + step
        return order[i] if 0 <= i < len(order) else None

    def _busy(self, u):  # is u's slot held by another unit still computing?
        holder = self.holder[u.slot]
        return holder is not None and holder is not u and holder.state in ("gathered", "backward")

    def _prefetch(self, u, state):
        """Start u's gather early (u is in ``state``), unless its slot is busy: then u's own
        hook gathers it."""
        if self.prefetch and u is not None and u.work is None and u.state == state \
                and not self._busy(u):
            self._gather(u)

    # --- the hooks -------------------------------------------------------------------------------
    def _start_forward(self, module, args):
        # no gradient accumulation (nor clipping): both need the whole gradient
        if is_grad_enabled() and any(u.reduced for u in self.units):
            raise RuntimeError("ZeRO3: a second forward before step(): gradients reduce-scattered "
                               "cannot accumulate; call step() (or zero_grad() to drop them)")
        for u in self.units:
            u.state = "sharded"
            u.missing = len(u.params)
        self.expect_backward = False
        self.forwards += 1
        self.ran = []
        self._drop_slots()
        if self.float8 is not None:  # this forward's (and backward's) FP8 shards
            self.float8.cast(self.comm, self.units, "ring")

    # before its forward: wait for its all-gather (started one unit earlier), start the next
    # unit's (prefetch), point the parameters into the gathered copy
    def _before_forward(self, u):
        if u.state != "sharded":  # its parameters are used in one call only
            raise RuntimeError(f"ZeRO3: unit {u.name!r} was called twice in one forward; each "
                               f"unit's module must run once per forward")
        if u.slot is None:  # the first forward that runs u records its place
            u.slot = len(self.order) % SLOTS
            self.order.append(u)
        self.ran.append(u)
        self._use(u, "gathered")
        # a guess: a forward may leave units out or take them in another order (then the
        # prefetched unit's gather is cancelled when its slot is needed, or when forward ends)
        self._prefetch(self._neighbour(u, 1, self.order), "sharded")

    # after its forward: free it; a hook on its output's gradient will start its backward
    def _after_forward(self, u, out):
        u.release()
        u.state = "resharded"
        hooked = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                  if isinstance(t, Tensor) and t.requires_grad]
        for t in hooked:
            t.register_hook(lambda g, u=u, n=self.forwards: self._before_backward(u, n))
        self.expect_backward = self.expect_backward or bool(hooked)

    def _end_forward(self, module, args, out):
        if not self.expect_backward:  # no graph recorded (no_grad): no backward will follow
            self._drop_slots()

    # before its backward: all-gather it again, start the gather of the unit before it
    def _before_backward(self, u, forward):
        if forward != self.forwards:  # a forward's backward comes before the next forward
            raise RuntimeError(f"ZeRO3: backward through forward {forward} after forward "
                               f"{self.forwards} began: backward each forward before the next")
        if u.state != "resharded":
            return  # a second output of the unit, or its backward already under way
        self._use(u, "backward")
        self._prefetch(self._neighbour(u, -1, self.ran), "resharded")

    # after its backward (its parameters' gradients are final): reduce-scatter the flat gradient
    def _gradient_ready(self, p):
        u = self.unit_of[id(p)]
        u.missing -= 1
        if u.missing == 0:
            self._reduce_scatter(u)

    def _reduce_scatter(self, u):
        """Average unit u's flat gradients; this rank's chunks come back to its shards."""
        xp = backend.get_array_module(u.segments[0].shard.data)
        grads = [flatten_grads(seg.params, xp.zeros(seg.numel, self.reduce_dtype or seg.shard.dtype))
                 for seg in u.segments]
        for p in u.params:
            p.grad = None
        u.grad_work = [ireduce_scatter(self.comm, grad, op=mean_op(grad, self.comm),
                                       algorithm=self.algorithm) for grad in grads]
        u.release()
        u.state = "done"
        u.reduced = True
        if all(v.state in ("done", "sharded") for v in self.units):
            self._finish()

    def _finish(self):
        """Backward is over: wait for the reduce-scatters, drop the gathered copies."""
        for u in self.units:
            if u.grad_work is not None:
                for seg, grad in zip(u.segments, Request.wait_all(u.grad_work)):
                    self._store_grad(seg, grad.astype(seg.shard.dtype, copy=False))
                u.grad_work = None
        self._drop_slots()

    def _store_grad(self, seg, grad):  # the averaged gradient of this rank's chunk of seg
        seg.shard.grad = grad

    def _drop_slots(self):  # the slots' memory goes once the graph holding views of it does
        for u in self.units:  # a prefetched unit that did not run
            self._cancel(u)
        self.slots, self.holder = [None] * SLOTS, [None] * SLOTS

    # --- the step --------------------------------------------------------------------------------
    def step(self):
        """Reduce-scatter what backward did not, then update the shards. A unit that got no
        gradient (its forward left out, or outside the loss) keeps grad None: the optimizer
        leaves it alone (no momentum, weight decay or step count), as torch's leave a parameter
        whose grad is None."""
        for u in self.units:
            # a unit whose backward ran but left a parameter without a gradient (in unit order:
            # the same on every rank, as every rank ran the same graph). Its segment's shard is
            # one vector with one step count, so that parameter takes the step with a zero
            # gradient
            if not u.reduced and any(p.grad is not None for p in u.params):
                self._reduce_scatter(u)
        self._finish()
        self.optimizer.step()
        for u in self.units:
            u.state = "sharded"
            u.reduced = False

    def zero_grad(self):
        """Drop the gradients (a backward's without step too, so a new forward may come)."""
        for u in self.units:
            Request.wait_all(u.grad_work or ())  # reduce-scatters under way end first, in order
            u.grad_work = None
            u.reduced = False
        for seg in self.segments:
            seg.shard.grad = None
        self.module.zero_grad()

    def memory_bytes(self, optimizer=None):
        """Bytes this rank holds now, by kind (their sum is the total): parameter shards,
        gradients (shards and any whole ones), optimizer state as master and moments
        (``optimizer_memory``), and the gathered copies (the slots; none between steps). In
        mixed precision with Adam: 16/N per parameter."""
        shards = [seg.shard for seg in self.segments]
        grads = self._shard_grads() + [p.grad for u in self.units for p in u.params]
        kept = shards + [p for p in self.module.parameters() if not p.requires_grad]  # frozen
        return {"parameters": sum(int(p.data.nbytes) for p in kept),
                "gradients": sum(int(g.nbytes) for g in grads if g is not None),
                **optimizer_memory(optimizer or self.optimizer),
                "gathered": sum(int(s.nbytes) for s in self.slots if s is not None)}

    def _shard_grads(self):  # the reduced gradients this rank keeps
        return [seg.shard.grad for seg in self.segments]

    # --- checkpoints: ZeRO's format, the parameters in pieces too (distributed/flat_state.py) --
    def state_dict(self):
        """{"model": {name: ShardedTensor}, "optimizer": ...}: serial names, this rank's pieces."""
        return ZeRO3State(self).state_dict()

    def load_state_dict(self, state_dict):
        """Whole arrays (``dcp.load`` builds them); this rank keeps its chunks."""
        ZeRO3State(self).load_state_dict(state_dict)

    def whole(self, u):
        """Unit u's whole flat vector, all-gathered now (a new array; collective)."""
        return backend.get_array_module(u.segments[0].shard.data).concatenate(
            [self.comm.all_gather(seg.shard.data, self.gather_algorithm).reshape(-1)
             for seg in u.segments])

    @contextlib.contextmanager
    def summon_full_params(self):
        """Inside the block every parameter holds its whole value (torch's name); writes to them
        are not kept. Collective: every rank enters it."""
        for u in self.units:
            u.point(self.whole(u))
        try:
            yield self.module
        finally:
            for u in self.units:
                u.release()
