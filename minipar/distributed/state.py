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


class AppState:
    """``model`` (a Module) and ``optimizer`` (an optimizer of some of its parameters, or None)."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def _names(self):
        return {id(p): name for name, p in self.model.named_parameters()}

    def state_dict(self):
        out = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            names, own = self._names(), self.optimizer.state_dict()
            out["optimizer"] = {
                "state": {names[id(self.optimizer.params[i])]: s
                          for i, s in sorted(own["state"].items())},
                "hyperparameters": own["hyperparameters"]}
        return out

    def load_state_dict(self, state_dict):
        """Every problem is named before anything changes (the optimizer checks its part first,
        the model its own)."""
        named = None
        if self.optimizer is not None:
            names = self._names()
            index = {names[id(p)]: i for i, p in enumerate(self.optimizer.params)}
            saved = state_dict["optimizer"]
            unknown = [n for n in saved["state"] if n not in index]
            if unknown:
                raise KeyError(f"optimizer state for parameters this optimizer does not hold: "
                               f"{', '.join(map(str, unknown))}")
            named = {"state": {index[n]: s for n, s in saved["state"].items()},
                     "hyperparameters": saved["hyperparameters"]}
        load_after_dry_run(self.optimizer, named,
                           lambda: self.model.load_state_dict(state_dict["model"]))


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
