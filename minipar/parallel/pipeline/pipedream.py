"""PipeDream (Narayanan et al. 2019): asynchronous 1F1B, a backward run with its forward's weights.

    pipe = Pipeline(model, build("pipedream", p, m), comm, loss_fn, optimizer=...)  # a PipeDream
    pipe.step(x, y); pipe.versions_used   # (stage, mb) -> (version F found live, version B used)

Without a flush a stage updates its weights between a micro-batch's forward and its backward,
so the backward would differentiate a function the forward never computed. Each micro-batch is
its own SGD step (loss unscaled) and an OPT_STEP follows every B; each update writes into fresh
arrays, and ``WeightStash`` keeps the arrays a forward saw, per version, until the last backward
that needs them has run (weight stashing). ``Pipeline(...)`` gives this class for the schedule
that names it (``Schedule.runtime``); the versions are the schedule's (``Action.version``).
"""
import contextlib

from .runtime import Pipeline


class WeightStash:
    """The stashed weight versions of this rank's parameters for one step.

        stash.note(a)               F ``a`` runs with the live weights, which must be version a.version
        with stash.swapped_in(a):   B ``a`` runs with the arrays of version a.version, then the live
                                    ones are put back; a version is dropped after its last backward
        stash.version = v           OPT_STEP(v): the live weights are version v from now on
    """

    def __init__(self, params=(), rank=0):
        self.params, self.rank = list(params), rank
        self.version = 0          # of the live weights
        self.kept = {}            # version -> the parameters' arrays of that version
        self.uses = {}            # version -> backwards still to run with it
        self.versions_used = {}   # (stage, mb) -> (the version F found live, the one B swapped in)

    def note(self, a):
        """At F ``a``: keep the live arrays for its backward."""
        if a.version != self.version:
            raise RuntimeError(f"rank {self.rank}: {a} expects weight version {a.version}, "
                               f"the current one is {self.version}")
        self.kept.setdefault(a.version, [q.data for q in self.params])
        self.uses[a.version] = self.uses.get(a.version, 0) + 1
        self.versions_used[(a.stage, a.mb)] = (self.version,)

    @contextlib.contextmanager
    def swapped_in(self, a):
        """Around B ``a``: the arrays of its forward's version in the parameters, the live ones
        back afterwards."""
        version = a.version
        live = [q.data for q in self.params]
        self.versions_used[(a.stage, a.mb)] += (version,)
        for q, stashed in zip(self.params, self.kept[version]):
            q.data = stashed
        try:
            yield
        finally:
            for q, now in zip(self.params, live):
                q.data = now
            self.uses[version] -= 1
            if not self.uses[version]:
                del self.kept[version], self.uses[version]


class PipeDream(Pipeline):
    """The pipeline runtime with weight stashing, for PipeDream's asynchronous schedule."""

    def __init__(self, model, schedule, *args, **kwargs):
        if not schedule.asynchronous:
            raise ValueError(f"PipeDream runs an asynchronous schedule, not {schedule.name!r}: "
                             f"run that one with Pipeline")
        # An update between a micro-batch's F and its B would change the loss scale its backward
        # carries: no one unscaling would be right for every micro-batch
        if kwargs.get("scaler"):
            raise ValueError("PipeDream takes no GradScaler: the scale would change between a "
                             "micro-batch's forward and its backward")
        super().__init__(model, schedule, *args, **kwargs)
        self.weight_stash = WeightStash(self.params, self.rank)

    @property
    def versions_used(self):
        """Last step: (stage, mb) -> (the version F found live, the one B swapped in)."""
        return self.weight_stash.versions_used

    @property
    def stash(self):
        """Last step: weight versions still stashed (none once every B has run)."""
        return self.weight_stash.kept

    def step(self, x=None, y=None):
        """``Pipeline.step``, its loss the mean micro-batch loss (each micro-batch is a step)."""
        self.weight_stash = WeightStash(self.params, self.rank)
        loss = super().step(x, y)
        return None if loss is None else loss / self.schedule.microbatches

    def loss_scales(self, ys, y):
        return [1.0] * self.schedule.microbatches  # each micro-batch's own SGD step: unscaled

    def _forward(self, a, s):
        self.weight_stash.note(a)
        super()._forward(a, s)

    def _backward(self, a, s):
        with self.weight_stash.swapped_in(a):
            super()._backward(a, s)

    def _opt_step(self, a, s):
        # the update writes into fresh arrays; the old ones stay stashed while a backward needs them
        for q in self.params:
            q.data = q.data.copy()
        if self.optimizer:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.weight_stash.version = a.version
