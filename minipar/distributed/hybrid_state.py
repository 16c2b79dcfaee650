"""Checkpoint adapters of the 3D and 4D trainers (parallel/hybrid.py, hybrid4d.py).

``state_dict()`` gives this rank's slices of its stages as ``ShardedTensor``s of the serial GPT's
parameters, under the serial names (``AppState``'s format); ``load_state_dict`` takes whole
arrays and keeps this rank's slices, so a checkpoint of one (tp, pp) layout loads into another,
or into the serial GPT.

    Trainer3DState(trainer).state_dict()            # what trainer.state_dict() returns

Who writes what, and how a checkpoint reshards: docs/checkpoints.md.
"""
from .. import backend
from ..parallel.tensor import shard, split_specs
from .sharded import ShardedTensor, box, serial_names, split
from .state import load_after_dry_run


class Trainer3DState:
    """The checkpoint of a ``Trainer3D``: the serial GPT's names and shapes."""

    def __init__(self, trainer):
        self.model, self.groups, self.pipe = trainer.model, trainer.groups, trainer.pipe
        self.optimizer = self.pipe.optimizer.optimizer if self.pipe.optimizer else None

    def held(self):
        """(serial name, Parameter, (axis, stride) or None) of every parameter of this rank's
        stages, in the optimizer's order."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        specs = split_specs(self.model)
        return [(names[id(p)], p, specs.get(names[id(p)])) for p in self.pipe.params]

    def writes(self, p):
        """Whether this rank writes ``p`` among the ranks holding copies of it: rank 0 of the
        data-context group (data rank 0; with cp, its context rank 0: cp ranks hold whole
        parameters too)."""
        return self.groups.data_context.rank == 0

    def sharded(self, local, spec, dp0):
        """``local`` (this rank's slice) as a piece of the serial tensor; ``dp0``: this rank
        writes it among its data-parallel copies."""
        tp = self.groups.tensor
        if spec is None:  # replicated over the tensor group: tensor rank 0 writes it
            return ShardedTensor(local.shape, local.dtype, [(box(local.shape), local)],
                                 write=dp0 and tp.rank == 0)
        axis, stride = spec
        return split(local, axis, stride, tp.rank, tp.size, write=dp0)

    def state_dict(self):
        """{"model": {name: sharded}, "optimizer": {"state": {name: {...}}, "hyperparameters"}}
        with the serial GPT's names: this rank's slices of its stages."""
        held, opt = self.held(), self.optimizer
        state = {}
        for i, (name, p, spec) in enumerate(held):
            if opt is not None and i in opt.state:
                state[name] = {key: self.sharded(value, spec, self.writes(p))
                               if hasattr(value, "shape")
                               else value for key, value in opt.state[i].items()}
        return {"model": {name: self.sharded(p.data, spec, self.writes(p))
                          for name, p, spec in held},
                "optimizer": {"state": state,
                              "hyperparameters": opt.hyperparameters() if opt else {}}}

    def load_state_dict(self, state_dict):
        """Load whole (serial) arrays; every problem is named before anything changes."""
        tp, model, saved = self.groups.tensor, state_dict["model"], state_dict["optimizer"]

        def mine(full, name, p, spec):
            full, shape = backend.to_numpy(full), list(p.shape)
            if spec is not None:
                shape[spec[0]] *= tp.size
            if full.shape != tuple(shape):
                raise ValueError(f"{name} has shape {full.shape} in the checkpoint and "
                                 f"{tuple(shape)} in this model")
            return full if spec is None else shard(full, spec[0], tp.rank, tp.size, spec[1])

        held = self.held()
        lacking = [name for name, _, _ in held if name not in model]
        if lacking:
            raise KeyError(f"the checkpoint has no parameters {lacking}")
        values = [mine(model[name], name, p, spec) for name, p, spec in held]
        named = {"state": {i: {key: mine(v, name, p, spec) if hasattr(v, "shape") else v
                               for key, v in saved["state"][name].items()}
                           for i, (name, p, spec) in enumerate(held) if name in saved["state"]},
                 "hyperparameters": saved["hyperparameters"]}

        def load_model():
            for (_, p, _), value in zip(held, values):
                p.data[...] = backend.get_array_module(p.data).asarray(value, dtype=p.dtype)

        load_after_dry_run(self.optimizer, named, load_model)


class Trainer4DState(Trainer3DState):
    """The checkpoint of a ``Trainer4D``: Trainer3D's, each expert under its serial name (expert
    ``e``, not this rank's local index), so it loads into any layout or into ``moe_gpt``."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.experts = {id(p) for p in self.model.expert_parameters()}

    def held(self):
        names = serial_names(self.model)
        return [(names[name], p, spec) for name, p, spec in super().held()]

    def writes(self, p):
        """An expert is written by expert-data rank 0 of the ranks holding it (one per expert
        rank), the rest by data rank 0."""
        if id(p) in self.experts:
            return self.groups.coords["edp"] == 0
        return super().writes(p)
