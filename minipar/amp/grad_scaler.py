"""Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training"): multiply the loss
by a large scale so that float16 gradients do not flush to zero, divide it out before the step,
and skip the step when a gradient overflowed; torch.amp.GradScaler's names and rules.

    scaler = GradScaler()                       # init_scale=2**16, growth_interval=2000
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # optional: clip the true gradients
    optim.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                      # skipped if a gradient is inf or NaN
    scaler.update()                             # halve the scale after a skip, double it after
                                                # growth_interval clean steps in a row
The theory: docs/engine.md, "Mixed precision: GradScaler and master weights".
"""
import numpy

from .. import backend
from ..autograd import Tensor

# an optimizer's place in the step, between two update()s (torch's OptState)
READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


class GradScaler:
    """Loss scaling with torch's rules. ``group``: a communicator (or a tuple of them) over which
    the found-inf flag is all-reduced; by default the ``comm`` of the optimizer stepped, if it has
    one (ZeRO, ZeRO3, AllReduceOptimizer), so that a step is skipped on every rank or on none.
    Tensor or pipeline parallelism: ``group=(tp_comm, pp_comm)``."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, group=None):
        self._enabled = bool(enabled)
        if self._enabled and not growth_factor > 1.0:
            raise ValueError(f"GradScaler: growth_factor={growth_factor!r} must be > 1.0")
        if self._enabled and not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor={backoff_factor!r} must be in (0, 1)")
        # the scale is a float32 number, as torch's scale tensor: every change is rounded to it
        self._scale = numpy.float32(init_scale)
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0  # clean steps in a row since the last growth or backoff
        self.group = group
        self._per_optimizer = {}  # id(optimizer) -> {"stage", "found_inf", "inv_scale"}
        # torch makes its scale tensor at the first scale(), and refuses to unscale or step
        # before: gradients no scale() multiplied would be divided by the scale all the same
        self._scaled = False

    def is_enabled(self):
        return self._enabled

    def get_scale(self):
        """The scale as a Python float (1.0 when disabled)."""
        return float(self._scale) if self._enabled else 1.0

    def get_growth_factor(self):
        return self._growth_factor

    def get_backoff_factor(self):
        return self._backoff_factor

    def get_growth_interval(self):
        return self._growth_interval

    def scale(self, outputs):
        """``outputs`` (a Tensor, or a list or tuple of them) times the scale; unchanged when
        disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(out) for out in outputs)
        if not isinstance(outputs, Tensor):
            raise TypeError(f"GradScaler.scale: outputs must be a Tensor or a list or tuple of "
                            f"them, got {type(outputs).__name__}")
        self._scaled = True
        # times a float32 0-d tensor, as torch does: a 16-bit loss is promoted to float32, so
        # the scaled loss (2**16 · loss) does not overflow float16's 65504
        xp = backend.get_array_module(outputs.data)
        return outputs * Tensor(xp.asarray(self._scale, dtype="float32"))

    def _state(self, optimizer):
        return self._per_optimizer.setdefault(id(optimizer), {"stage": READY, "found_inf": None})

    def unscale_(self, optimizer):
        """Divide the gradients ``optimizer`` will step on by the scale, and note whether any is
        inf or NaN (on any rank of the group). Once per optimizer between two update()s. A
        wrapper that reduces the gradients inside its ``step()`` (ZeRO, AllReduceOptimizer) is
        only checked here: its optimizer unscales them in that step, after the reduction."""
        self._unscale(optimizer, "unscale_")

    def _unscale(self, optimizer, caller):
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] is UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if state["stage"] is STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # 1/scale in float64, rounded to float32 (torch's inv_scale)
        state["inv_scale"] = inv_scale = numpy.float32(1.0 / numpy.float64(self._scale))
        holders = gradient_holders(optimizer)
        finite = [backend.get_array_module(p.grad).isfinite(p.grad).all() for p in holders]
        # Checked before a wrapper's reduction: an average of finite numbers is finite (when the
        # reduction adds in float32), so the verdict is the one after it
        state["found_inf"] = self._found_inf(optimizer, finite, caller)
        state["stage"] = UNSCALED
        if getattr(optimizer, "optimizer", None) is not None:
            return  # a wrapper: unscaled inside its step (see step)
        for p in holders:
            g = p.grad
            # A 16-bit gradient comes back in float32: unscaled in 16 bits, the small entries
            # the scale lifted above float16's smallest number would flush to zero again
            # (Megatron unscales its float32 main gradients). Replaced, never changed in
            # place: the engine may hand two leaves the same gradient array.
            if backend.is_low_precision(g.dtype):
                g = g.astype("float32")
            p.grad = g * inv_scale

    def _found_inf(self, optimizer, finite, caller):
        """1.0 if a gradient was inf or NaN on this rank or on any rank of the group, else 0.0
        (one host read); torch's AssertionError where no scale() came first (on any rank of
        the group: a pipeline scales the loss on its last stage alone)."""
        groups = self.group if self.group is not None else getattr(optimizer, "comm", None)
        groups = [] if groups is None else groups if isinstance(groups, (list, tuple)) else [groups]
        groups = [comm for comm in groups if comm.size > 1]
        xp = backend.get_array_module(*finite) if finite else backend.xp()
        found = xp.zeros(1, "float32")
        if finite:
            found += xp.logical_not(xp.stack(finite).all())
        if not self._scaled:
            # -1 where no scale() came and nothing is inf: the max stays -1 only if no rank of
            # the group scaled (in the same message; an inf there still skips the step)
            found = found * 2 - 1
        # the flag all-reduced (max) over the gradient's group: with ZeRO each rank checks only
        # its shard, with tensor or pipeline parallelism only its own parameters, yet every rank
        # must skip the same steps or their weights part. (DDP's averaged gradients are the same
        # on every rank already: an inf on one rank is an inf in the average.)
        for comm in groups:
            found = comm.all_reduce(found, op="max")
        found = float(backend.to_numpy(found)[0])
        if found < 0 or not (groups or self._scaled):
            raise AssertionError(f"Attempted {caller} but _scale is None.  This may indicate your "
                                 f"script did not use scaler.scale(loss or outputs) earlier in "
                                 f"the iteration.")
        return max(found, 0.0)

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` on the unscaled gradients (``unscale_`` first,
        unless called already), skipped if any was inf or NaN; returns what that step returns
        (None when skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state(optimizer)
        if state["stage"] is STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is READY:
            self._unscale(optimizer, "step")
        state["stage"] = STEPPED
        found_inf = bool(state["found_inf"])
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            return None if found_inf else optimizer.step(*args, **kwargs)
        # A wrapper (ZeRO, ZeRO3, AllReduceOptimizer) steps even when skipped: its step finishes
        # the gradients' reduction and resets its bookkeeping. Its optimizer then unscales the
        # reduced gradients as it reads them (16-bit ones in float32), or skips the update.
        with inner.unscaling(state["inv_scale"], found_inf):
            retval = optimizer.step(*args, **kwargs)
        return None if found_inf else retval

    def update(self, new_scale=None):
        """The scale for the next step: ``new_scale`` if given; else, after a skipped step,
        scale·backoff_factor, and after growth_interval clean steps in a row, scale·growth_factor
        (torch's _amp_update_scale_). Call it once per iteration, after every step()."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                new_scale = new_scale.data
            if getattr(new_scale, "size", 1) != 1:
                raise ValueError(f"GradScaler.update: new_scale must be a number or hold one "
                                 f"element, got shape {new_scale.shape}")
            self._scale = numpy.float32(float(backend.to_numpy(new_scale).reshape(-1)[0])
                                        if hasattr(new_scale, "shape") else new_scale)
        else:
            found = [s["found_inf"] for s in self._per_optimizer.values()
                     if s["found_inf"] is not None]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update(): call "
                                   "step(optimizer) (or unscale_) first.")
            self._update_scale(sum(found))
        self._per_optimizer = {}

    def _update_scale(self, found_inf):
        """The dynamic loss-scale rule. After a step that found an inf or NaN (``found_inf``
        nonzero): scale·backoff_factor, and the growth tracker back to 0. After a clean step: one
        more in the tracker, and when it reaches growth_interval, scale·growth_factor (unless
        that overflows float32: the scale stays) and the tracker back to 0. The scale stays a
        float32 number (see __init__)."""
        ### BEGIN SOLUTION loss-scale-update
        if found_inf:  # an overflow: back off at once, and count clean steps from zero
            self._scale = numpy.float32(float(self._scale) * self._backoff_factor)
            self._growth_tracker = 0
            return
        successful = self._growth_tracker + 1
        if successful == self._growth_interval:
            with numpy.errstate(over="ignore"):
                grown = numpy.float32(float(self._scale) * self._growth_factor)
            if numpy.isfinite(grown):  # at float32's top the scale stays where it is
                self._scale = grown
            self._growth_tracker = 0
        else:
            self._growth_tracker = successful
        ### END SOLUTION

    def state_dict(self):
        """torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker;
        {} when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict):
        """Restore ``state_dict()``'s values (a no-op when disabled)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: the state dict lacks {sorted(missing)}")
        self._scale = numpy.float32(state_dict["scale"])
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


def gradient_holders(optimizer):
    """The parameters holding a gradient that a step of ``optimizer`` will read: a plain
    optimizer's own; for a wrapper whose ``step()`` replaces optimizer.step() (ZeRO, ZeRO3,
    AllReduceOptimizer), its inner optimizer's (the shards) and the whole parameters whose
    gradient is not reduced yet."""
    inner = getattr(optimizer, "optimizer", None)
    stepped = optimizer if inner is None else inner
    params = [p for group in stepped.param_groups for p in group["params"]]
    if inner is not None:
        whole = getattr(optimizer, "params", None)
        params += list(whole if whole is not None else optimizer.module.parameters())
    seen, holders = set(), []
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            holders.append(p)
    return holders
