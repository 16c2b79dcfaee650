"""ZeRO stage 3 (Rajbhandari et al. 2020), PyTorch's fully sharded data parallel (Zhao et al.
2023): the parameters are sharded too, so a rank keeps 1/N of parameters, gradients and
optimizer state, and gathers each layer whole only while that layer computes.

    zero = ZeRO3(model, lambda params: optim.AdamW(params, lr=1e-3), comm)
    loss = loss_fn(model(x_local), y_local); loss.backward(); zero.step(); zero.zero_grad()

Units. A unit is one layer: by default each module holding parameters of its own (Linear,
LayerNorm, Embedding); ``units=[...]`` names coarser ones (each GPT Block), each taking every
parameter below it. A unit's parameters lie end to end in one flat vector padded to a multiple
of N; rank r keeps chunk r as a Parameter, the only one the optimizer sees (updates are
elementwise). Between uses a parameter's ``.data`` is a zero-stride placeholder of its shape.

One step, per unit, in the order the model calls them (recorded on the first forward):

    before its forward   wait for its all-gather (started one unit earlier), start the next
                         unit's all-gather (prefetch), point the parameters into the gathered copy
    after its forward    free it: the parameters go back to placeholders
    before its backward  (a hook on its output's gradient) all-gather it again, start the
                         gather of the unit before it
    after its backward   (its parameters' gradients are final) reduce-scatter the flat gradient
                         (average); this rank keeps its chunk as the shard's gradient
    step()               update the shards (their gradients came at the end of backward)

Where "free" is real. A layer's backward closures keep views of the arrays it read, so its
gathered copy cannot be dropped and made anew for backward. The copies live in two slots of
``max unit`` elements, unit i in slot i mod 2, always at the same place: while unit i computes,
unit i+1 is gathered into the other slot, over unit i-1's copy (forward) or unit i+1's
(backward, done). Re-gathering unit i writes into the very memory its closures read (PyTorch
frees and re-allocates the storage under its tensors instead). So a rank holds two units whole
at most, none after backward. This needs the units' backward in the reverse order of their
forward (a stack of layers); a gather over a unit still computing is a RuntimeError.

Traffic per rank and step, Psi elements: all-gather (forward), all-gather (backward) and
reduce-scatter, (N-1)/N Psi each: 3 (N-1)/N Psi, 1.5x plain data parallelism's all-reduce.
All collectives run on the communicator's background thread in the order they are started, the
same on every rank. Each unit's module runs once per forward, its parameters used in that call
only; a forward's backward comes before the next forward; no gradient accumulation or clipping
(both need the whole gradient). Checkpoints: ZeRO's format, the parameters in pieces too.
"""
import contextlib

from ... import backend
from ...autograd import Tensor, is_grad_enabled
from ...comm import chunk_bounds, world
from ...comm.nonblocking import iall_gather, ireduce_scatter
from ...distributed import flat_state  # the module: its import of buckets comes back here
from ...nn.module import Parameter
from .buckets import broadcast_parameters, flatten_grads, flatten_parameters, offsets
from .zero import ALL_GATHER_TWIN

SLOTS = 2  # gathered copies a rank holds at once: the unit computing and the one prefetched


def layer_units(module):
    """The default units: (module, its own trainable parameters) for each module holding some."""
    pairs = [(m, [v for _, v in m._members() if isinstance(v, Parameter) and v.requires_grad])
             for m in module.modules()]
    return [(m, params) for m, params in pairs if params]


def placeholder(p):
    """A read-only array of p's shape and dtype holding one element: p between its uses."""
    xp = backend.get_array_module(p.data)
    return xp.broadcast_to(xp.zeros((), p.dtype), p.shape)


class _Unit:
    """One layer: its parameters, their place in the flat vector, this rank's shard."""

    def __init__(self, name, module, params, comm):
        self.name, self.module, self.params = name, module, params
        self.starts, n = offsets(params)
        self.numel = -(-n // comm.size) * comm.size  # padded to a multiple of N
        flat = flatten_parameters(params, self.numel)
        lo, hi = chunk_bounds(self.numel, comm.size)[comm.rank:comm.rank + 2]
        self.shard = Parameter(flat[lo:hi].copy())
        self.slot = self.work = self.grad_work = None
        self.state, self.missing, self.reduced = "sharded", len(params), False
        self.release()

    def point(self, flat):
        """Every parameter a view of its place in ``flat``, the unit's whole flat vector."""
        for p, o in zip(self.params, self.starts):
            p.data = flat[o:o + p.size].reshape(p.shape)

    def release(self):
        for p in self.params:
            p.data = placeholder(p)


class ZeRO3:
    """Fully sharded data parallel training; ``step()`` after ``backward()`` replaces
    optimizer.step(). ``units``: the modules gathered as one (default ``layer_units``);
    ``prefetch``: start the next unit's gather before it is needed."""

    def __init__(self, module, make_optimizer, comm=None, units=None, algorithm="ring",
                 prefetch=True, on_mismatch="warn"):
        self.module, self.comm = module, comm or world()
        self.algorithm, self.prefetch = algorithm, prefetch  # the reduce-scatter's algorithm
        self.gather_algorithm = ALL_GATHER_TWIN.get(algorithm, algorithm)
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        self.units = self._make_units(module, layer_units(module) if units is None else
                                      [(m, [p for p in m.parameters() if p.requires_grad])
                                       for m in units])
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.optimizer = make_optimizer([u.shard for u in self.units])
        self.order, self.slots, self.holder = [], [None] * SLOTS, [None] * SLOTS
        self.slot_size = max(u.numel for u in self.units)  # a slot holds any unit whole
        self.peak_gathered_bytes, self.expect_backward, self.forwards = 0, False, 0
        module.register_forward_pre_hook(self._start_forward)
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._before_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        module.register_forward_hook(self._end_forward)

    def _make_units(self, module, pairs):
        """One _Unit per (module, parameters); every trainable parameter in exactly one."""
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
        return [_Unit(names[id(m)], m, params, self.comm) for m, params in pairs if params]

    # --- gathering into the slots ----------------------------------------------------------------
    def _gather(self, u):
        """Start the all-gather of unit u into its slot (allocated on first use)."""
        s, holder = u.slot, self.holder[u.slot]
        if self._busy(u):
            raise RuntimeError(f"ZeRO3: unit {u.name!r} needs slot {s}, held by {holder.name!r}, "
                               f"which is still computing: units nest two deep at most, their "
                               f"backward in the reverse order of their forward; choose units=")
        if self.slots[s] is None:
            xp = backend.get_array_module(u.shard.data)
            self.slots[s] = xp.empty(self.slot_size, u.shard.dtype)
            gathered = sum(int(slot.nbytes) for slot in self.slots if slot is not None)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)
        self.holder[s] = u
        full = self.slots[s][:u.numel].reshape(self.comm.size, -1)
        u.work = iall_gather(self.comm, u.shard.data, self.gather_algorithm, out=full)

    def _use(self, u, state):
        """Wait for unit u's gather (starting it if nobody did) and point its parameters in."""
        if u.work is None:
            self._gather(u)
        u.work.wait()
        u.work, u.state = None, state
        u.point(self.slots[u.slot])

    def _neighbour(self, u, step):  # the unit ``step`` places after u in forward order
        i = self.order.index(u) + step
        return self.order[i] if 0 <= i < len(self.order) else None

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
        if is_grad_enabled() and any(u.reduced for u in self.units):
            raise RuntimeError("ZeRO3: a second forward before step(): gradients reduce-scattered "
                               "cannot accumulate; call step() (or zero_grad() to drop them)")
        for u in self.units:
            u.state, u.missing = "sharded", len(u.params)
        self.expect_backward, self.forwards = False, self.forwards + 1
        self._drop_slots()

    def _before_forward(self, u):
        if u.state != "sharded":
            raise RuntimeError(f"ZeRO3: unit {u.name!r} was called twice in one forward; each "
                               f"unit's module must run once per forward")
        if u.slot is None:  # the first forward records the order
            u.slot = len(self.order) % SLOTS
            self.order.append(u)
        self._use(u, "gathered")
        self._prefetch(self._neighbour(u, 1), "sharded")

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

    def _before_backward(self, u, forward):
        if forward != self.forwards:
            raise RuntimeError(f"ZeRO3: backward through forward {forward} after forward "
                               f"{self.forwards} began: backward each forward before the next")
        if u.state != "resharded":
            return  # a second output of the unit, or its backward already under way
        self._use(u, "backward")
        self._prefetch(self._neighbour(u, -1), "resharded")

    def _gradient_ready(self, p):
        u = self.unit_of[id(p)]
        u.missing -= 1
        if u.missing == 0:
            self._reduce_scatter(u)

    def _reduce_scatter(self, u):
        """Average unit u's flat gradient; this rank's chunk comes back to its shard."""
        xp = backend.get_array_module(u.shard.data)
        grad = flatten_grads(u.params, xp.zeros(u.numel, u.shard.dtype))
        for p in u.params:
            p.grad = None
        u.grad_work = ireduce_scatter(self.comm, grad, op="avg", algorithm=self.algorithm)
        u.release()
        u.state, u.reduced = "done", True
        if all(v.state in ("done", "sharded") for v in self.units):
            self._finish()

    def _finish(self):
        """Backward is over: wait for the reduce-scatters, drop the gathered copies."""
        for u in self.units:
            if u.grad_work is not None:
                u.shard.grad, u.grad_work = u.grad_work.wait(), None
        self._drop_slots()

    def _drop_slots(self):  # the slots' memory goes once the graph holding views of it does
        self.slots, self.holder = [None] * SLOTS, [None] * SLOTS

    # --- the step --------------------------------------------------------------------------------
    def step(self):
        """Reduce-scatter what backward did not (units that got no gradient: zeros, in unit order
        on every rank), then update the shards."""
        for u in [u for u in self.units if not u.reduced]:
            self._reduce_scatter(u)
        self._finish()
        self.optimizer.step()
        for u in self.units:
            u.state, u.reduced = "sharded", False

    def zero_grad(self):
        """Drop the gradients (a backward's without step too, so a new forward may come)."""
        for u in self.units:
            if u.grad_work is not None:  # reduce-scatters under way end first, in order
                u.grad_work.wait()
            u.shard.grad, u.grad_work, u.reduced = None, None, False
        self.module.zero_grad()

    def memory_bytes(self):
        """Bytes this rank holds now: parameter shards, gradients (shards and any whole ones),
        optimizer state, and the gathered copies (the slots; none between steps)."""
        grads = [u.shard.grad for u in self.units] + [p.grad for u in self.units for p in u.params]
        kept = [u.shard for u in self.units] + [p for p in self.module.parameters()
                                                 if not p.requires_grad]  # frozen: whole
        return {"parameters": sum(int(p.data.nbytes) for p in kept),
                "gradients": sum(int(g.nbytes) for g in grads if g is not None),
                "optimizer_state": self.optimizer.state_bytes(),
                "gathered": sum(int(s.nbytes) for s in self.slots if s is not None)}

    # --- checkpoints: ZeRO's format, the parameters in pieces too (distributed/flat_state.py) --
    def state_dict(self):
        """{"model": {name: ShardedTensor}, "optimizer": ...}: serial names, this rank's pieces."""
        return flat_state.ZeRO3State(self).state_dict()

    def load_state_dict(self, state_dict):
        """Whole arrays (``dcp.load`` builds them); this rank keeps its chunks."""
        flat_state.ZeRO3State(self).load_state_dict(state_dict)

    @contextlib.contextmanager
    def summon_full_params(self):
        """Inside the block every parameter holds its whole value (torch's name); writes to them
        are not kept. Collective: every rank enters it."""
        for u in self.units:
            u.point(self.comm.all_gather(u.shard.data, self.gather_algorithm).reshape(-1))
        try:
            yield self.module
        finally:
            for u in self.units:
                u.release()
