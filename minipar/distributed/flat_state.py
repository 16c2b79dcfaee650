"""Checkpoint adapters of the flat-shard trainers: ZeRO (stages 1-2), ZeRO-3, the parameter server.

Each of them keeps its optimizer state as flat chunks of parameters laid end to end. Its adapter
names that state by the serial model's parameter names (``AppState``'s format) and back, so a
checkpoint of N ranks loads on M, or into a serial model and its optimizer.

    ZeROState(zero).state_dict()            # what zero.state_dict() returns
    ZeROState(zero).load_state_dict(whole)  # whole arrays, as distributed.checkpoint.load builds

The format and how it reshards: docs/checkpoints.md.
"""
from .. import backend
from ..comm import chunk_bounds
from ..flat import offsets
from .sharded import flat_chunk, flat_pieces
from .state import load_after_dry_run


class ZeROState:
    """ZeRO's checkpoint: the parameters whole (every rank holds them), the optimizer state of
    flat group i (its index in the optimizer) cut into ``ShardedTensor`` pieces."""

    shards = None  # the flat chunks of the parameters themselves: ZeRO-3 only

    def __init__(self, zero):
        self.module, self.optimizer, self.comm = zero.module, zero.optimizer, zero.comm
        # [(parameters, padded size)]: each bucket's flat vector
        self.groups = [(bucket, flat.size) for bucket, flat in zip(zero.buckets, zero.flats)]

    def owned_chunks(self):
        """(i, lo, hi, [(name, parameter, offset)]): this rank's chunk [lo, hi) of each flat
        group, its members named as in the serial model."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        for i, (params, size) in enumerate(self.groups):
            lo, hi = chunk_bounds(size, self.comm.size)[self.comm.rank:self.comm.rank + 2]
            yield i, lo, hi, [(names[id(p)], p, o) for p, o in zip(params, offsets(params)[0])]

    def state_dict(self):
        """{"model": whole parameters (ZeRO-3: pieces), "optimizer": {"state": {name: {"step",
        name: sharded}}, "hyperparameters"}}: serial names, this rank's pieces."""
        model, state = self.module.state_dict(), {}
        for i, lo, hi, members in self.owned_chunks():
            state.update(flat_pieces(members, lo, hi, self.optimizer.state.get(i, {})))
            if self.shards is not None:
                pieces = flat_pieces(members, lo, hi, {"value": self.shards[i]})
                model.update((name, piece["value"]) for name, piece in pieces.items())
        order = [name for name, _ in self.module.named_parameters() if state.get(name)]
        return {"model": model,
                "optimizer": {"state": {name: state[name] for name in order},
                              "hyperparameters": self.optimizer.hyperparameters()}}

    def load_state_dict(self, state_dict):
        """From whole arrays in the format of ``state_dict()``: this rank keeps its chunks. Every
        problem is named before anything changes."""
        saved, model = state_dict["optimizer"]["state"], state_dict["model"]
        chunks, values, own = {}, {}, self.module.state_dict()
        missing = [k for k in own if k not in model]
        unexpected = [k for k in model if k not in own]
        if self.shards is not None and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for i, lo, hi, members in self.owned_chunks():
            dtype = members[0][1].dtype
            chunk = flat_chunk(members, lo, hi, saved, dtype)
            if chunk is not None:
                chunks[i] = chunk
            if self.shards is not None:
                whole = {name: {"value": model[name]} for name, _, _ in members if name in model}
                values[i] = flat_chunk(members, lo, hi, whole, dtype)
        named = {"state": chunks, "hyperparameters": state_dict["optimizer"]["hyperparameters"]}
        load_after_dry_run(self.optimizer, named, lambda: self._load_model(model, values))

    def _load_model(self, model, values):
        if self.shards is None:
            self.module.load_state_dict(model)
            return
        sharded = {name for _, _, _, members in self.owned_chunks() for name, _, _ in members}
        self.module.load_state_dict({k: v for k, v in model.items() if k not in sharded},
                                    strict=False)
        for i, value in values.items():
            self.shards[i][...] = backend.asarray(value["value"], dtype=self.shards[i].dtype)


class ZeRO3State(ZeROState):
    """ZeRO-3's checkpoint: ZeRO's format, the parameters in pieces too (each segment's flat chunk
    cut at the parameters' edges, as the optimizer state)."""

    def __init__(self, zero3):
        self.module, self.optimizer, self.comm = zero3.module, zero3.optimizer, zero3.comm
        # each unit's segments (one per param group), in the optimizer's order
        self.groups = [(seg.params, seg.numel) for seg in zero3.segments]
        self.shards = [seg.shard.data for seg in zero3.segments]


class ParameterServerState:
    """The parameter server's checkpoint, as ZeRO's: the parameters whole, the servers' optimizer
    state as pieces of each parameter, so it loads on another number of ranks, sharded or not."""

    def __init__(self, server):
        self.module, self.optimizer, self.comm = server.module, server.optimizer, server.comm
        self.params, self.served, self.dtype = server.params, server.served, server.flat.dtype

    def members(self):
        """(i, lo, hi, [(name, parameter, offset)]) for each piece [lo, hi) of the flat vector
        this rank serves (the optimizer's parameter i: its slice, cut at the param groups'
        edges), the members of that piece's group."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        starts = dict(zip(map(id, self.params), offsets(self.params)[0]))
        for i, (lo, hi, group) in enumerate(self.served):
            yield i, lo, hi, [(names[id(p)], p, starts[id(p)]) for p in group]

    def state_dict(self):
        """{"model": whole parameters, "optimizer": {"state": {name: {...}},
        "hyperparameters"}}: serial names, the servers' pieces of the optimizer state."""
        state = {}
        for i, lo, hi, members in self.members():
            state.update(flat_pieces(members, lo, hi, self.optimizer.state.get(i, {})))
        return {"model": self.module.state_dict(),
                "optimizer": {"state": {name: s for name, s in state.items() if s},
                              "hyperparameters":
                              self.optimizer.hyperparameters() if self.optimizer else {}}}

    def load_state_dict(self, state_dict):
        """Whole arrays in the format of ``state_dict()``; every problem is named before anything
        changes."""
        named = None
        if self.optimizer is not None:  # a server: its slice's optimizer state
            chunks = {}
            for i, lo, hi, members in self.members():
                chunk = flat_chunk(members, lo, hi, state_dict["optimizer"]["state"], self.dtype)
                if chunk is not None:
                    chunks[i] = chunk
            named = {"state": chunks,
                     "hyperparameters": state_dict["optimizer"]["hyperparameters"]}
        load_after_dry_run(self.optimizer, named,
                           lambda: self.module.load_state_dict(state_dict["model"]))
