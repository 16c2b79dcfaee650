"""Optimizers: SGD (momentum, Nesterov), Adam and AdamW, with PyTorch's exact update rules.

An optimizer holds a list of parameters and, for parameter number ``i``, a dict ``state[i]`` of
arrays of that parameter's shape (the momentum buffer; Adam's first and second moments) plus an
integer step count. ``step()`` works on the backend arrays in place and builds no graph.

    opt = AdamW(model.parameters(), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()
"""
import numbers

from . import backend
from .flat import flatten_grads, flatten_parameters, views


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


class Optimizer:
    """Base: ``params`` (an iterable of Parameters) and ``defaults`` (the hyperparameters, set as
    attributes, e.g. ``opt.lr``, so a schedule can change them between steps)."""

    def __init__(self, params, defaults):
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in the list")
        self.defaults = dict(defaults)
        for name, value in self.defaults.items():
            setattr(self, name, value)
        # parameter index -> {"step": int, name: array of the parameter's shape}. Keyed by index,
        # not by object: that lets ZeRO give each rank a slice of the parameters and so of the
        # state; state_bytes() counts what that slicing saves.
        self.state = {}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        # In place (p.data -= ...): no graph, and each parameter keeps its array (a view into a
        # flat buffer stays one). Gradients are never changed in place: the engine may hand two
        # leaves the very same gradient array.
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.update(i, p.data, p.grad, self.state.setdefault(i, {"step": 0}))

    def update(self, i, param, grad, state):
        """Change the array ``param`` in place from its gradient ``grad`` and its ``state``."""
        raise NotImplementedError

    def hyperparameters(self):
        return {name: getattr(self, name) for name in self.defaults}

    def state_bytes(self):
        """Bytes held in optimizer state arrays (what ZeRO stage 1 divides among ranks)."""
        return sum(int(v.nbytes) for s in self.state.values() for v in s.values()
                   if hasattr(v, "nbytes"))

    def state_dict(self):
        """{"state": {index: {name: array or step}}, "hyperparameters": {...}}; live arrays."""
        return {"state": {i: dict(s) for i, s in self.state.items()},
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state_dict):
        """Restore state saved by ``state_dict``; every mismatch is named before anything
        changes."""
        hyper, state = state_dict["hyperparameters"], state_dict["state"]
        problems = []
        if set(hyper) != set(self.defaults):
            problems.append(f"hyperparameters {sorted(hyper)} do not match {type(self).__name__}'s "
                            f"{sorted(self.defaults)}")
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
        for name, value in hyper.items():
            setattr(self, name, value)
        self.state = {}
        for i, s in state.items():
            self.state[int(i)] = {name: _copy_like(value, self.params[int(i)].data)
                                  if hasattr(value, "shape") else value
                                  for name, value in s.items()}


def _copy_like(value, param):
    """A copy of ``value`` on ``param``'s device (NumPy or CuPy)."""
    if backend.is_gpu_array(value) and not backend.is_gpu_array(param):
        value = backend.to_numpy(value)
    return backend.get_array_module(param).array(value, dtype=param.dtype)


class SGD(Optimizer):
    """g ← grad + wd·p;  b ← μ·b + g (b = g at the first step);
    g ← g + μ·b (Nesterov) or b;  p ← p − lr·g."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        check_hyperparameters("SGD", lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and momentum <= 0:
            raise ValueError("SGD: Nesterov momentum needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov))

    def update(self, i, param, grad, state):
        state["step"] += 1
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= self.momentum
                buf += grad
            grad = grad + self.momentum * buf if self.nesterov else buf
        param -= self.lr * grad


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015), weight decay as an L2 term added to the gradient:
    g ← grad + wd·p;  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
    p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        check_hyperparameters(type(self).__name__, lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.flat = Flat.of(self.params)  # None where the parameters cannot be laid end to end

    def step(self):
        # All the parameters at once where they can be laid end to end (Flat): each line of the
        # update is then one pass over one vector instead of one small pass per parameter, as
        # torch's fused AdamW does. Where that cannot hold (a parameter without a gradient,
        # parameters at different steps, arrays that are views of someone else's buffer, e.g.
        # ZeRO's shards) the step goes parameter by parameter, with the same formula.
        if not self._flat_step():
            super().step()

    def _flat_step(self):
        """``adam`` on the flat vectors, one pass per line over all the parameters; False
        (nothing done) where the parameters cannot take one step together."""
        params, flat = self.params, self.flat
        if any(p.grad is None for p in params):
            return False
        if flat is None or not flat.holds(params):  # an array was replaced: lay them out anew
            flat = self.flat = Flat.of(params, flat)
            if flat is None:
                return False
        states = [self.state.get(i) for i in range(len(params))]
        if not flat.holds_state(states):  # first step, or a load_state_dict replaced them
            if not flat.adopt(states, MOMENTS):
                return False  # parameters at different steps
            self.state.update(enumerate(flat.states))
        t = states[0]["step"] + 1 if states[0] else 1
        for state in flat.states:
            state["step"] = t
        m, v = (flat.vectors[name] for name in MOMENTS)
        self.adam(flat.data, flat.gather_grads(params), m, v, t, flat.scratch)
        return True

    def update(self, i, param, grad, state):
        xp = backend.get_array_module(param)
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(param)
            state["exp_avg_sq"] = xp.zeros_like(param)
        state["step"] += 1
        self.adam(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                  xp.empty_like(param))

    def adam(self, p, g, m, v, t, tmp):
        """Step t of Adam in place on arrays of one layout (a parameter's, or the flat vectors):
        the parameter p, its gradient g (read only), the moments m and v, a scratch array tmp."""
        xp = backend.get_array_module(p)
        beta1, beta2 = self.betas
        if self.weight_decay and self.decoupled:
            p *= 1 - self.lr * self.weight_decay
        elif self.weight_decay:
            g = g + xp.multiply(p, self.weight_decay, out=tmp)
        m *= beta1  # m ← β₁m + (1−β₁)g
        m += xp.multiply(g, 1 - beta1, out=tmp)
        v *= beta2  # v ← β₂v + (1−β₂)g²
        tmp = xp.multiply(g, g, out=tmp)
        tmp *= 1 - beta2
        v += tmp
        # p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε), written with c = √(1−β₂ᵗ) as
        # p − (lr·c/(1−β₁ᵗ)) · m / (√v + ε·c): the same number, one pass fewer
        c = (1 - beta2 ** t) ** 0.5
        denom = xp.sqrt(v, out=tmp)
        denom += self.eps * c
        step = xp.divide(m, denom, out=tmp)
        step *= self.lr * c / (1 - beta1 ** t)
        p -= step


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019): first p ← p·(1 − lr·wd),
    then the Adam step on the plain gradient."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr, betas, eps, weight_decay)


MOMENTS = ("exp_avg", "exp_avg_sq")


class Flat:
    """Adam's parameters in the flat layout (``minipar.flat``): one vector ``data``, each
    ``p.data`` a view of it. Vectors of the same layout hold the gradients (copied in each step),
    a scratch vector and the moments: ``state[i]["exp_avg"]`` is a view of parameter i's stretch,
    so the state_dict format stays the per-parameter one."""

    @classmethod
    def of(cls, params, old=None):
        """A Flat of ``params`` (in a new vector), or None unless they share a dtype and a device
        and each array is its own (not a view of someone else's buffer) or a view of ``old``'s."""
        arrays = [p.data for p in params]
        xp = backend.get_array_module(*arrays)
        if len({a.dtype for a in arrays}) != 1 or any(backend.get_array_module(a) is not xp
                                                      for a in arrays):
            return None
        if any(a.base is not None and (old is None or a is not view)
               for a, view in zip(arrays, old.views if old else arrays)):
            return None
        return cls(params, xp)

    def __init__(self, params, xp):
        self.xp = xp
        self.data = flatten_parameters(params)
        self.views = [p.data for p in params]
        self.grad, self.scratch = xp.empty_like(self.data), xp.empty_like(self.data)
        self.vectors, self.states, self.state_views = {}, [], []  # see adopt

    def holds(self, params):
        return all(p.data is view for p, view in zip(params, self.views))

    def gather_grads(self, params):
        """The gradients laid end to end (a copy: the parameters' own ``.grad`` stay as they are)."""
        return flatten_grads(params, self.grad)

    def holds_state(self, states):
        """Whether ``states`` (parameter i's state dict, or None) are this layout's own, all at
        one step (a step that skipped a parameter without a gradient leaves them apart)."""
        return len(states) == len(self.states) and all(
            s is mine and s["step"] == states[0]["step"]
            and all(s[name] is view for name, view in views.items())
            for s, mine, views in zip(states, self.states, self.state_views))

    def adopt(self, states, names):
        """Lay the state arrays ``names`` end to end (zeros where a parameter has none yet) and
        make ``self.states`` the per-parameter dicts of their views; False (nothing changed)
        unless every parameter is at the same step."""
        if len({0 if s is None else s["step"] for s in states}) != 1:
            return False
        self.vectors = {name: self.xp.zeros_like(self.data) for name in names}  # no state: zeros
        cut = {name: views(vector, self.views) for name, vector in self.vectors.items()}
        self.state_views = [{name: cut[name][i] for name in names} for i in range(len(states))]
        self.states = []
        for s, mine in zip(states, self.state_views):
            for name, view in mine.items():
                if s is not None:
                    view[...] = s[name]  # the state so far, now a stretch of the vector
            self.states.append({"step": 0 if s is None else s["step"], **mine})
        return True


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
