"""FSDP2's API (torch.distributed.fsdp; Zhao et al. 2023) over minipar's ZeRO-3 (zero3.py).

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)           # one unit: gathered whole while it computes
    fully_shard(model, mesh=mesh)               # the rest; model is now also an FSDPModule
    optimizer = optim.AdamW(model.parameters(), lr=1e-3)    # this rank's pieces
    loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

Each call shards at once the parameters no inner call took (ZeRO-3's units, zero3_units.py);
the outermost call's ``FSDPState``, a ZeRO3, runs every unit below it. What maps to ZeRO-3 and
what differs from torch: docs/fsdp2.md.
"""
import dataclasses

from .. import backend
from ..autograd import Tensor, is_grad_enabled
from ..nn.module import Module, Parameter
from ..parallel.data.zero3 import ZeRO3, hook_units
from ..parallel.data.zero3_units import Unit, layer_units
from .collectives import Work
from .device_mesh import DeviceMesh, init_device_mesh
from .process_group import get_world_size


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's: gathered parameters (and so the computation, and the floating inputs of the
    root's forward) in ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``; the
    shards and the optimizer keep the model's dtype. None: the model's. minipar's own
    ``all_gather_dtype`` ("float8_e4m3fn"): the all-gather in FP8 with a scale a parameter, as
    torchao's enable_fsdp_float8_all_gather (ZeRO3's option; docs/float8.md)."""
    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None
    cast_forward_inputs: bool = True
    all_gather_dtype: object = None

    def dtypes(self):
        if self.output_dtype is not None:
            raise ValueError("MixedPrecisionPolicy: output_dtype is not supported here; cast "
                             "the output yourself")
        return tuple(None if d is None else backend.check_dtype(str(d).replace("torch.", ""))
                     for d in (self.param_dtype, self.reduce_dtype, self.all_gather_dtype))


class ShardedParameter(Parameter):
    """What ``module.parameters()`` gives after fully_shard: this rank's piece of one parameter.

    torch's are DTensors of the parameter's full shape, each sharded on dim 0. Here the piece is
    the stretch of the parameter that falls in this rank's 1/N of its unit's flat vector (ZeRO-3's
    layout, one all-gather per unit): 1-D, possibly empty, and a view of the unit's shard, so the
    optimizer's in-place step is what the next all-gather sends, and the optimizer, built after
    fully_shard as torch users do, holds 1/N of the state. ``full_tensor()`` (collective, as
    torch's) gives the whole parameter; ``to_local()`` the piece."""

    __slots__ = ("_state", "_unit", "_param")

    def full_tensor(self):
        o, p = self._unit.starts[id(self._param)], self._param
        return Tensor(self._state().whole(self._unit)[o:o + p.size].reshape(p.shape))

    def to_local(self):
        return self


def pieces(unit):
    """{id(parameter): ShardedParameter viewing its stretch of this rank's chunk} for a unit."""
    out = {}
    for seg in unit.segments:
        for p, o in zip(seg.params, seg.offsets):
            a, b = seg.stretch(o, p.size)
            piece = ShardedParameter(seg.shard.data[:0])
            piece.data = seg.shard.data[a:b]  # a view: Parameter() would copy
            piece._unit, piece._param = unit, p
            out[id(p)] = piece
    return out


class FSDPModule:
    """What fully_shard makes a module also be (torch's class swap: ``FSDPBlock(FSDPModule,
    Block)``): its parameters are ShardedParameters; ``unshard()``/``reshard()`` gather its
    own unit's parameters whole and free them again, as torch's."""

    def named_parameters(self, prefix=""):
        shards = {k: v for m in self.modules() if isinstance(m, FSDPModule)
                  for k, v in m._fsdp_pieces.items()}
        for name, p in super().named_parameters(prefix):
            yield name, shards.get(id(p), p)

    def _get_fsdp_state(self):
        return self._fsdp_state

    def unshard(self, async_op=False):
        for u in self._fsdp_units:
            u.point(self._fsdp_state.whole(u))
        return Work() if async_op else None

    def reshard(self):
        for u in self._fsdp_units:
            u.release()


class FSDPState(ZeRO3):
    """ZeRO3's step without its optimizer: the reduced gradients go to the ShardedParameters
    (added to those there: gradient accumulation), for the optimizer built over them;
    ``reshard_after_forward=False`` units keep their gathered copy from forward to backward."""

    def __init__(self, module, units, mesh, mp_policy, kept):
        self._setup(module, mesh.get_group().comm, "ring", True, *mp_policy.dtypes())
        self.mesh, self.policy = mesh, mp_policy  # one of each for a model
        self.cast_inputs = mp_policy.cast_forward_inputs
        self.kept, self.own = kept, {}  # ids of the units not resharded; their copies
        for u in units:
            u.slot = None  # a slot from the first forward this state runs
        self._adopt(units)
        self.optimizer = None
        self.pieces = {k: piece for m in module.modules() if isinstance(m, FSDPModule)
                       for k, piece in m._fsdp_pieces.items()}  # id(parameter) -> its piece
        for piece in self.pieces.values():
            piece._state = lambda: self

    def _start_forward(self, module, args):
        if is_grad_enabled():  # the last backward's gradients are all in the pieces by now
            left = [u.name for u in self.units if u.state not in ("done", "sharded")]
            if any(u.state == "done" for u in self.units) and left:
                raise RuntimeError(f"fully_shard: units {left} ran in the last forward but "
                                   f"backward did not give every one of their parameters a "
                                   f"gradient; minipar's FSDP reduces a unit's gradient once all "
                                   f"its parameters have one (torch's runs a callback at the end "
                                   f"of backward): use every parameter in the loss")
            for u in self.units:
                u.reduced = False
        super()._start_forward(module, args)
        if self.param_dtype is None or not self.cast_inputs:
            return None
        return tuple(a.astype(self.param_dtype) if isinstance(a, Tensor)
                     and backend.is_floating(a.dtype) else a for a in args)

    def _store_grad(self, seg, grad):
        for p, o in zip(seg.params, seg.offsets):
            piece = self.pieces[id(p)]
            a = min(max(o, seg.lo), seg.lo + grad.size) - seg.lo
            g = grad[a:a + piece.size]
            piece.grad = g if piece.grad is None else piece.grad + g

    def _shard_grads(self):
        return [piece.grad for piece in self.pieces.values()]

    # --- reshard_after_forward=False: the unit's own copy, kept from forward to backward --------
    def _gather(self, u):
        if id(u) not in self.kept:
            return super()._gather(u)
        if id(u) in self.own:  # its backward: gathered in forward still
            u.work = []
            return None
        self.own[id(u)] = self._empty(u, u.numel)
        return self._start_gather(u, self.own[id(u)])

    def _buffer(self, u):
        return self.own[id(u)] if id(u) in self.kept else super()._buffer(u)

    def _after_forward(self, u, out):
        super()._after_forward(u, out)
        if id(u) in self.own:
            u.point(self.own[id(u)])

    def _reduce_scatter(self, u):
        super()._reduce_scatter(u)
        self.own.pop(id(u), None)

    def _drop_slots(self):
        super()._drop_slots()
        self.own = {}

    def memory_bytes(self, optimizer=None):
        """ZeRO3's count, the optimizer built over the pieces passed in; kept copies gathered."""
        held = super().memory_bytes(optimizer)
        held["gathered"] += sum(int(a.nbytes) for a in self.own.values())
        return held


def _checked_mesh(module, mesh):
    """The 1-D mesh to shard over (default: the world), refusing what torch's FSDP2 refuses."""
    if not isinstance(module, Module):
        raise TypeError(f"fully_shard: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: {type(module).__name__} is already sharded (fully_shard "
                         f"was called on it before); call it once per module")
    if mesh is None:
        mesh = init_device_mesh("cpu", (get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh (init_device_mesh), got "
                        f"{type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard: mesh has {mesh.ndim} dimensions {mesh.mesh_dim_names}; "
                         f"pass its data-parallel one, e.g. mesh['dp'] (HSDP's 2-D mesh is not "
                         f"supported here)")
    return mesh


def fully_shard(module, *, mesh=None, reshard_after_forward=True, mp_policy=None, **others):
    """Shard ``module``'s parameters not sharded yet over ``mesh`` (1-D; default: every rank)
    and make it an FSDPModule; every rank calls it, on the same modules in the same order.
    ``others``: torch's shard_placement_fn, offload_policy, ignored_params, only as None."""
    mesh = _checked_mesh(module, mesh)
    given = sorted(name for name, value in others.items() if value is not None)
    if given:
        raise TypeError(f"fully_shard: {', '.join(given)} not supported here")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"fully_shard: reshard_after_forward must be True or False, got "
                        f"{reshard_after_forward!r}")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    inner = [m for m in module.modules() if isinstance(m, FSDPModule)]
    states = list({id(m._fsdp_state): m._fsdp_state for m in inner}.values())
    if any(s.mesh.mesh.tolist() != mesh.mesh.tolist() or s.policy != mp_policy for s in states):
        raise ValueError(f"fully_shard({type(module).__name__}): its sharded submodules use "
                         f"another mesh or mp_policy; use one mesh and one policy for a model")
    taken = {id(p) for s in states for u in s.units for p in u.params}
    pairs = [(m, [p for p in ps if id(p) not in taken]) for m, ps in layer_units(module)]
    pairs = [(m, ps) for m, ps in pairs if ps]
    if not inner:  # one unit: the module, gathered whole for its forward and backward
        pairs = [(module, [p for _, ps in pairs for p in ps])] if pairs else []
    for m, _ in pairs:  # else one unit per layer holding the rest (the embeddings, the head)
        if inner and any(isinstance(d, FSDPModule) for d in m.modules()):
            raise ValueError(f"fully_shard({type(module).__name__}): {type(m).__name__} holds "
                             f"parameters of its own and sharded submodules; move its own into "
                             f"a submodule of theirs")
    names = {id(m): name or type(m).__name__ for name, m in module.named_modules()}
    units = [Unit(names[id(m)], m, ps, mesh.get_group().comm, {id(p): 0 for p in ps})
             for m, ps in pairs]
    module.__dict__["_fsdp_pieces"] = {k: v for u in units for k, v in pieces(u).items()}
    module.__dict__["_fsdp_units"] = units
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    kept = set().union(*(s.kept for s in states)) | (
        set() if reshard_after_forward else {id(u) for u in units})
    state = FSDPState(module, units + [u for s in states for u in s.units], mesh, mp_policy, kept)
    for m in [module, *inner]:
        m.__dict__["_fsdp_state"] = state
    hook_units(module, units, lambda: module._fsdp_state)
    return module
