"""``AppState``: a model and its optimizer as one Stateful object, in the layout-free format that
every minipar trainer saves and loads (torch's ``get_state_dict``/``set_state_dict`` in one):

    {"model": {parameter name: array},
     "optimizer": {"state": {parameter name: {"step": int, "exp_avg": array, ...}},
                   "hyperparameters": {"lr": ..., ...}}}

An optimizer numbers its parameters (``state[i]``); here each is named by the model's name for it,
the serial model's name, so that a checkpoint of ZeRO's flat shards or of the 3D trainer's slices
loads into a serial model and its optimizer, and back.

    dcp.save({"app": AppState(model, optimizer), "step": step}, checkpoint_id="ckpt/step-3")
"""
import copy

from .sharded import held_elsewhere, local, placements


class AppState:
    """``model`` (a Module) and ``optimizer`` (an optimizer of some of its parameters, or None).
    A tensor- or expert-parallel model's optimizer state is cut as its parameters are
    (``sharded.placements``), so it reshards too."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def _places(self):
        """{id(parameter): (serial name, parameter, place)}"""
        return {id(p): (name, p, place) for name, p, place in placements(self.model)}

    def state_dict(self):
        out = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            places, own = self._places(), self.optimizer.state_dict()
            state = {}
            for i, entry in sorted(own["state"].items()):
                name, p, place = places[id(self.optimizer.params[i])]
                state[name] = {key: place(v) if _shape(v) == p.shape else v
                               for key, v in entry.items()}
            out["optimizer"] = {"state": state, "hyperparameters": own["hyperparameters"]}
        return out

    def load_state_dict(self, state_dict):
        """Every problem is named before anything changes (the optimizer checks its part first,
        the model its own)."""
        named = None
        if self.optimizer is not None:
            places = self._places()
            index = {places[id(p)][0]: i for i, p in enumerate(self.optimizer.params)}
            saved, others = state_dict["optimizer"], held_elsewhere(self.model)
            saved_state = {n: s for n, s in saved["state"].items() if not others(n)}
            unknown = [n for n in saved_state if n not in index]
            if unknown:
                raise KeyError(f"optimizer state for parameters this optimizer does not hold: "
                               f"{', '.join(map(str, unknown))}")
            named = {"state": {}, "hyperparameters": saved["hyperparameters"]}
            for n, entry in saved_state.items():
                _, p, place = places[id(self.optimizer.params[index[n]])]
                whole = tuple(place(p.data).shape)  # the serial parameter's shape
                named["state"][index[n]] = {
                    key: local(p, place, v) if whole != p.shape and _shape(v) == whole else v
                    for key, v in entry.items()}
        load_after_dry_run(self.optimizer, named,
                           lambda: self.model.load_state_dict(state_dict["model"]))


def _shape(value):
    return tuple(value.shape) if hasattr(value, "shape") else None


def load_after_dry_run(optimizer, named, load_model):
    """Load ``named`` (an optimizer's ``state_dict()``) into ``optimizer`` (or None) and the model
    (``load_model()``) so that every problem is named before anything changes: the optimizer's
    part is tried on a copy first, then the model checks its own, then the optimizer loads. Every
    trainer's checkpoint adapter loads through here."""
    if optimizer is not None:
        copy.copy(optimizer).load_state_dict(named)  # a dry run: raises, changes nothing
    load_model()
    if optimizer is not None:
        optimizer.load_state_dict(named)
