"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), PyTorch's update rules, each
param group's parameters laid end to end (``Flat``) so that a step is one pass per line of the
formula over all of them, as torch's fused AdamW.

    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
"""
from .. import backend
from ..flat import flatten_parameters, views
from .optimizer import GroupValue, Optimizer


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015), weight decay as an L2 term added to the gradient:
    g ← grad + wd·p;  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
    p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)."""

    decoupled = False
    betas = GroupValue()
    eps = GroupValue()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.flats = []  # one Flat per param group (None where it cannot be laid end to end)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def add_param_group(self, group):
        super().add_param_group(group)
        self.flats.append(Flat.of(self.param_groups[-1]["params"]))

    @property
    def flat(self):
        """The Flat of the one param group (``flats``: one per group)."""
        if len(self.flats) != 1:
            raise AttributeError(f"{type(self).__name__} has {len(self.flats)} param groups: "
                                 f"read flats[g]")
        return self.flats[0]

    def step_group(self, g, group):
        # All the group's parameters at once where they can be laid end to end (Flat): each line
        # of the update is then one pass over one vector instead of one small pass per
        # parameter, as torch's fused AdamW does. Where that cannot hold (a parameter without a
        # gradient, parameters at different steps, arrays that are views of someone else's
        # buffer, e.g. ZeRO's shards) the step goes parameter by parameter, same formula.
        if not self._flat_step(g, group):
            super().step_group(g, group)

    def _flat_step(self, g, group):
        """``adam`` on group g's flat vectors, one pass per line over all its parameters; False
        (nothing done) where its parameters cannot take one step together."""
        params, flat = group["params"], self.flats[g]
        if not params or any(p.grad is None for p in params):
            return False
        if flat is None or not flat.holds(params):  # an array was replaced: lay them out anew
            flat = self.flats[g] = Flat.of(params, flat)
            if flat is None:
                return False
        indices = [i for i, _ in self.indexed(g)]
        states = [self.state.get(i) for i in indices]
        if not flat.holds_state(states):  # first step, or a load_state_dict replaced them
            if not flat.adopt(states):
                return False  # parameters at different steps
            self.state.update(zip(indices, flat.states))
        t = states[0]["step"] + 1 if states[0] else 1
        for state in flat.states:
            state["step"] = t
        m, v = (flat.vectors[name] for name in MOMENTS)
        master = flat.vectors.get("master")  # 16-bit parameters: their float32 master copies
        grads = flat.gather_grads(params)  # a copy: unscaled in place
        if self.inv_scale is not None:
            grads *= self.inv_scale
        self.adam(group, flat.data if master is None else master, grads, m, v, t, flat.scratch)
        if master is not None:
            flat.data[...] = master  # rounded once, as Optimizer.step_group does
        return True

    def update(self, i, param, grad, state, group):
        xp = backend.get_array_module(param)
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(param)
            state["exp_avg_sq"] = xp.zeros_like(param)
        state["step"] += 1
        self.adam(group, param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                  xp.empty_like(param))

    def adam(self, group, p, g, m, v, t, tmp):
        """Step t of Adam in place on arrays of one layout (a parameter's, or the flat vectors):
        the parameter p, its gradient g (read only), the moments m and v, a scratch array tmp;
        the hyperparameters of their param ``group``."""
        xp = backend.get_array_module(p)
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        if weight_decay and self.decoupled:
            p *= 1 - lr * weight_decay
        elif weight_decay:
            g = g + xp.multiply(p, weight_decay, out=tmp)
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
        denom += eps * c
        step = xp.divide(m, denom, out=tmp)
        step *= lr * c / (1 - beta1 ** t)
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
    a scratch vector and the moments, and for 16-bit parameters their float32 master copies (all
    of these in float32 then): ``state[i]["exp_avg"]`` is a view of parameter i's stretch, so the
    state_dict format stays the per-parameter one."""

    @classmethod
    def of(cls, params, old=None):
        """A Flat of ``params`` (in a new vector), or None unless they share a dtype and a device
        and each array is its own (not a view of someone else's buffer) or a view of ``old``'s."""
        arrays = [p.data for p in params]
        if not arrays:  # an empty param group
            return None
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
        self.names = (("master",) if backend.is_low_precision(self.data.dtype) else ()) + MOMENTS
        self.dtype = "float32" if self.names[0] == "master" else self.data.dtype  # the state's
        self.grad = xp.empty(self.data.shape, self.dtype)
        # cut once, not at every step: on a small model cutting cost more than the copy
        self.grad_views = views(self.grad, self.views)
        self.scratch = xp.empty(self.data.shape, self.dtype)
        self.vectors, self.states, self.state_views = {}, [], []  # see adopt

    def holds(self, params):
        return all(p.data is view for p, view in zip(params, self.views))

    def gather_grads(self, params):
        """The gradients laid end to end (a copy: the parameters' own ``.grad`` stay as they are)."""
        for p, view in zip(params, self.grad_views):
            view[...] = p.grad
        return self.grad

    def holds_state(self, states):
        """Whether ``states`` (parameter i's state dict, or None) are this layout's own, all at
        one step (a step that skipped a parameter without a gradient leaves them apart)."""
        if len(states) != len(self.states) or states[0] is None:
            return False
        step = states[0]["step"]
        for s, mine, views in zip(states, self.states, self.state_views):
            if s is not mine or s["step"] != step:
                return False
            for name, view in views.items():
                if s[name] is not view:
                    return False
        return True

    def adopt(self, states):
        """Lay the state arrays ``self.names`` end to end (where a parameter has none yet: zeros,
        and its master copy its value) and make ``self.states`` the per-parameter dicts of their
        views; False (nothing changed) unless every parameter is at the same step."""
        if len({0 if s is None else s["step"] for s in states}) != 1:
            return False
        names = self.names
        self.vectors = {name: self.xp.zeros(self.data.shape, self.dtype) for name in names}
        if "master" in names:
            self.vectors["master"][...] = self.data
        cut = {name: views(vector, self.views) for name, vector in self.vectors.items()}
        self.state_views = [{name: cut[name][i] for name in names} for i in range(len(states))]
        self.states = []
        for s, mine in zip(states, self.state_views):
            for name, view in mine.items():
                if s is not None and name in s:
                    view[...] = s[name]  # the state so far, now a stretch of the vector
            self.states.append({"step": 0 if s is None else s["step"], **mine})
        return True
