"""The optimizer base (param groups, state, state_dict) and SGD, with PyTorch's update rules.

An optimizer holds its parameters in ``param_groups`` (a list of dicts: the parameters and their
hyperparameters, as torch's), and, for parameter number ``i`` (counted over the groups in order),
a dict ``state[i]`` of arrays of that parameter's shape plus an integer step count. ``step()``
works on the backend arrays in place and builds no graph.

    decay = [p for p in model.parameters() if p.ndim >= 2]    # no decay on biases and norms
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()
"""
import contextlib
import numbers

from .. import backend
from ..autograd import Tensor

# the hyperparameters check_hyperparameters knows, read from each group
CHECKED = ("lr", "momentum", "betas", "eps", "weight_decay")


def check_hyperparameters(owner, lr=None, momentum=None, betas=None, eps=None,
                          weight_decay=None):
    """Refuse what torch.optim refuses (lr < 0, momentum < 0, a beta outside [0, 1),
    weight_decay < 0) and eps <= 0 (a zero eps divides by zero where v is zero), NaN and
    non-numbers too: a ValueError naming the argument and its value. ``None`` is not checked."""
    rules = [("lr", lr, "the learning rate must be >= 0", lambda v: v >= 0),
             ("momentum", momentum, "must be >= 0", lambda v: v >= 0),
             ("eps", eps, "must be > 0", lambda v: v > 0),
             ("weight_decay", weight_decay, "must be >= 0", lambda v: v >= 0)]
    if betas is not None:
        if len(tuple(betas)) != 2:
            raise ValueError(f"{owner}: invalid betas={betas!r}: give two numbers (beta1, beta2)")
        rules += [(f"betas[{i}]", b, "must be in [0, 1)", lambda v: 0 <= v < 1)
                  for i, b in enumerate(betas)]
    for name, value, rule, ok in rules:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
            raise ValueError(f"{owner}: invalid {name}={value!r}: {rule}")


class GroupValue:
    """A hyperparameter read and set on the optimizer itself (``opt.lr``, minipar's habit before
    param groups): it reads the value every group shares, and setting it sets every group's."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        values = [group[self.name] for group in opt.param_groups]
        if any(v != values[0] for v in values):
            raise AttributeError(f"{type(opt).__name__}.{self.name}: the param groups differ "
                                 f"({values}); read param_groups[i][{self.name!r}]")
        return values[0]

    def __set__(self, opt, value):
        for group in opt.param_groups:
            group[self.name] = value


class Optimizer:
    """Base: ``params`` (an iterable of Parameters, or of dicts, each a param group: {"params":
    ..., and any hyperparameter that differs from ``defaults``}) and ``defaults`` (the
    hyperparameters a group does not name)."""

    lr = GroupValue()
    weight_decay = GroupValue()

    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        self.check(self.defaults)
        groups = list(params)
        if not groups:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = []
        self.params = []  # every group's parameters in order: parameter i is params[i]
        # parameter index -> {"step": int, name: array of the parameter's shape}. Keyed by index,
        # not by object: that lets ZeRO give each rank a slice of the parameters and so of the
        # state; state_bytes() counts what that slicing saves.
        self.state = {}
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group):
        """Add ``group`` ({"params": a Parameter or an iterable of them, and any hyperparameter};
        the others from ``defaults``), as torch's add_param_group does."""
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{type(self).__name__}: a param group is a dict with a 'params' "
                            f"key, got {group!r}")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        group = {**self.defaults, **group, "params": params}
        self.check(group)
        ids = [id(p) for p in self.params + params]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in the list "
                             f"(in one param group or in two)")
        self.params.extend(params)
        self.param_groups.append(group)

    def check(self, group):
        """Refuse bad hyperparameters in ``group`` (``check_hyperparameters``)."""
        check_hyperparameters(type(self).__name__, **{k: group[k] for k in CHECKED if k in group})

    def indexed(self, g):
        """[(i, parameter)] of param group g: i is the parameter's index, the key of its state."""
        start = sum(len(group["params"]) for group in self.param_groups[:g])
        return list(enumerate(self.param_groups[g]["params"], start))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        if self.found_inf:  # GradScaler found an inf or NaN gradient (see unscaling)
            return
        for g, group in enumerate(self.param_groups):
            self.step_group(g, group)

    inv_scale, found_inf = None, False  # set only inside unscaling()

    @contextlib.contextmanager
    def unscaling(self, inv_scale, found_inf):
        """Inside it ``step()`` multiplies each gradient by ``inv_scale`` as it reads it (after
        the upcast of a 16-bit one), or changes nothing if ``found_inf``: GradScaler's way into
        a wrapper whose ``step()`` reduces the gradients first (ZeRO, AllReduceOptimizer), as
        torch's fused optimizers take ``grad_scale`` and ``found_inf``."""
        self.inv_scale, self.found_inf = inv_scale, found_inf
        try:
            yield
        finally:
            self.inv_scale, self.found_inf = None, False

    def unscaled(self, grad):
        """``grad`` as the update reads it: times ``inv_scale`` inside ``unscaling()``."""
        return grad if self.inv_scale is None else grad * self.inv_scale

    def step_group(self, g, group):
        # In place (p.data -= ...): no graph, and each parameter keeps its array (a view into a
        # flat buffer stays one). Gradients are never changed in place: the engine may hand two
        # leaves the very same gradient array. A parameter without a gradient is left alone,
        # its state (momentum, step count) too, as torch does.
        for i, p in self.indexed(g):
            if p.grad is None:
                continue
            state = self.state.setdefault(i, {"step": 0})
            if not backend.is_low_precision(p.data.dtype):
                self.update(i, p.data, self.unscaled(p.grad), state, group)
                continue
            # A 16-bit parameter is updated through a float32 master copy kept in its state
            # (Megatron's Float16OptimizerWithFloat16Params): an update smaller than half a
            # 16-bit step would round away if added to the 16-bit weight itself, but it
            # accumulates in the master; the moments, made like the array updated, are float32
            # too. The parameter gets the master rounded once, after the step.
            if "master" not in state:
                state["master"] = p.data.astype("float32")
            self.update(i, state["master"], self.unscaled(p.grad.astype("float32")), state, group)
            p.data[...] = state["master"]

    def update(self, i, param, grad, state, group):
        """Change the array ``param`` in place from its gradient ``grad``, its ``state`` and its
        param ``group``'s hyperparameters."""
        raise NotImplementedError

    def hyperparameters(self):
        """What a checkpoint keeps of the groups: {name: value} for one group (the format every
        trainer's checkpoint has), {"param_groups": [{name: value}, ...]} for several."""
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in self.param_groups]
        return groups[0] if len(groups) == 1 else {"param_groups": groups}

    def state_bytes(self):
        """Bytes held in optimizer state arrays (what ZeRO stage 1 divides among ranks)."""
        return sum(int(v.nbytes) for s in self.state.values() for v in s.values()
                   if hasattr(v, "nbytes"))

    def memory_bytes(self):
        """Bytes by kind, each array in one (the values sum to the total): the parameters, their
        gradients, the float32 master copies of 16-bit parameters, and the other state arrays
        (moments, momentum buffers): with Adam in mixed precision 2 + 2 + 4 + 8 bytes per
        parameter, ZeRO's 16Ψ. A wrapper takes only master and moments (``optimizer_memory``)."""
        state = [(name, v) for s in self.state.values() for name, v in s.items()
                 if hasattr(v, "nbytes")]
        return {"params": sum(int(p.data.nbytes) for p in self.params),
                "grads": sum(int(p.grad.nbytes) for p in self.params if p.grad is not None),
                "master": sum(int(v.nbytes) for name, v in state if name == "master"),
                "moments": sum(int(v.nbytes) for name, v in state if name != "master")}

    def state_dict(self):
        """torch's {"state": {index: {name: array or step}}, "param_groups": [{..., "params":
        [index, ...]}]} and "hyperparameters" (``hyperparameters()``); live arrays."""
        groups = [{**group, "params": [i for i, _ in self.indexed(g)]}
                  for g, group in enumerate(self.param_groups)]
        return {"state": {i: dict(s) for i, s in self.state.items()},
                "param_groups": groups, "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state_dict):
        """Restore state saved by ``state_dict`` (or a dict of "state" and "hyperparameters", as
        the trainers' checkpoints give); every mismatch is named before anything changes."""
        state, problems = dict(state_dict["state"]), []
        if "param_groups" in state_dict:
            saved = state_dict["param_groups"]
            ids = [i for group in saved for i in group["params"]]
            if [len(group["params"]) for group in saved] != [len(group["params"]) for group
                                                              in self.param_groups]:
                problems.append(f"the saved param groups hold {[len(s['params']) for s in saved]}"
                                f" parameters, this optimizer's "
                                f"{[len(group['params']) for group in self.param_groups]}")
            else:  # torch's way: the saved indices name this optimizer's parameters in order
                state = {ids.index(i) if i in ids else i: s for i, s in state.items()}
            hypers = [{k: v for k, v in group.items() if k != "params"} for group in saved]
        else:
            hyper = state_dict["hyperparameters"]
            hypers = hyper["param_groups"] if "param_groups" in hyper else [hyper]
            if len(hypers) != len(self.param_groups):
                problems.append(f"the checkpoint has {len(hypers)} param groups, this optimizer "
                                f"{len(self.param_groups)}")
        for hyper in hypers:
            if not set(self.defaults) <= set(hyper):
                problems.append(f"hyperparameters {sorted(hyper)} do not match "
                                f"{type(self).__name__}'s {sorted(self.defaults)}")
        for i, s in state.items():
            if not 0 <= int(i) < len(self.params):
                problems.append(f"state for parameter {i}, but the optimizer has "
                                f"{len(self.params)} parameters")
                continue
            shape = self.params[int(i)].shape
            for name, value in s.items():
                if hasattr(value, "shape") and tuple(value.shape) != shape:
                    problems.append(f"state[{i}][{name!r}] has shape {tuple(value.shape)}, "
                                    f"parameter {i} has shape {shape}")
        if problems:
            raise ValueError(f"{type(self).__name__}.load_state_dict: " + "; ".join(problems))
        # new dicts, not the old ones changed: a shallow copy's dry run (load_after_dry_run)
        # leaves the original as it was
        self.param_groups = [{**group, **hyper, "params": group["params"]}
                             for group, hyper in zip(self.param_groups, hypers)]
        self.state = {}
        for i, s in state.items():
            self.state[int(i)] = {name: _copy_like(value, self.params[int(i)].data)
                                  if hasattr(value, "shape") else value
                                  for name, value in s.items()}


def _copy_like(value, param):
    """A copy of ``value`` on ``param``'s device (NumPy or CuPy), in the dtype of ``param``'s
    state: its own, float32 for a 16-bit parameter (master copy and moments)."""
    if backend.is_gpu_array(value) and not backend.is_gpu_array(param):
        value = backend.to_numpy(value)
    dtype = "float32" if backend.is_low_precision(param.dtype) else param.dtype
    return backend.get_array_module(param).array(value, dtype=dtype)


class SGD(Optimizer):
    """g ← grad + wd·p;  b ← μ·b + g (b = g at the first step);
    g ← g + μ·b (Nesterov) or b;  p ← p − lr·g."""

    momentum = GroupValue()
    nesterov = GroupValue()

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov))

    def check(self, group):
        super().check(group)
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("SGD: Nesterov momentum needs momentum > 0")

    def update(self, i, param, grad, state, group):
        state["step"] += 1
        if group["weight_decay"]:
            grad = grad + group["weight_decay"] * param
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= group["momentum"]
                buf += grad
            grad = grad + group["momentum"] * buf if group["nesterov"] else buf
        param -= group["lr"] * grad


def clip_grad_norm_(params, max_norm, eps=1e-6):
    """Scale all gradients by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the 2-norm of all of them
    together; returns ‖g‖ (before clipping) as a 0-d float64 array on the gradients' device
    (``float(total)`` reads it; on NumPy it already is a float). All of it runs on the device,
    with no host read: the factor is a device scalar, 1 when no clipping is needed (torch's
    way). Gradients are replaced, not changed in place. A negative or NaN ``max_norm`` is a
    ValueError."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: invalid max_norm={max_norm!r}: must be >= 0")
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    xp = backend.get_array_module(params[0].grad)
    total = xp.sqrt(sum((p.grad.astype("float64") ** 2).sum() for p in params))
    coef = xp.minimum(max_norm / (total + eps), 1.0)
    for p in params:
        p.grad = p.grad * coef.astype(p.grad.dtype)
    return total


clip_grad_norm = clip_grad_norm_
