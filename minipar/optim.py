"""Optimizers: SGD (momentum, Nesterov), Adam and AdamW, with PyTorch's exact update rules.

An optimizer holds a list of parameters and, for parameter number ``i``, a dict ``state[i]`` of
arrays of that parameter's shape (the momentum buffer; Adam's first and second moments) plus an
integer step count. Keying by index, not by object, is what lets ZeRO give each rank a slice of
the parameters and so of the state; ``state_bytes()`` counts what that slicing saves.

``step()`` works on the backend arrays directly and in place (``p.data -= ...``), so it builds no
graph and keeps each parameter's array (a view into a flat buffer stays one). Gradients are never
changed in place: the engine may hand two leaves the very same gradient array.
"""
import numbers

from . import backend


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
        self.state = {}  # parameter index -> {"step": int, name: array of the parameter's shape}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
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

    def update(self, i, param, grad, state):
        xp = backend.get_array_module(param)
        beta1, beta2 = self.betas
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(param)
            state["exp_avg_sq"] = xp.zeros_like(param)
        state["step"] += 1
        t = state["step"]
        if self.weight_decay and self.decoupled:
            param *= 1 - self.lr * self.weight_decay
        elif self.weight_decay:
            grad = grad + self.weight_decay * param
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= beta1
        m += (1 - beta1) * grad
        v *= beta2
        v += (1 - beta2) * (grad * grad)
        denom = xp.sqrt(v)
        denom /= (1 - beta2 ** t) ** 0.5
        denom += self.eps
        param -= (self.lr / (1 - beta1 ** t)) * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019): first p ← p·(1 − lr·wd),
    then the Adam step on the plain gradient."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr, betas, eps, weight_decay)


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
