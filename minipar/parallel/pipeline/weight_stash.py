"""PipeDream's weight stashing (Narayanan et al. 2019): a backward runs with its forward's weights.

Without a flush, a stage updates its weights between a micro-batch's forward and its backward,
so the backward would differentiate a function the forward never computed. The runtime's
asynchronous OPT_STEP writes each update into fresh arrays, which leaves the arrays a forward saw
alive as long as something refers to them; ``WeightStash`` refers to them, per version, until
the last backward that needs them has run:

    stash.note(a)               F ``a`` runs with the live weights, which must be version a.version
    with stash.swapped_in(a):   B ``a`` runs with the arrays of version a.version, then the live
                                ones are put back; a version is dropped after its last backward
    stash.version = v           OPT_STEP(v): the live weights are version v from now on

Actions of synchronous schedules carry no version, and the stash leaves them alone.
"""
import contextlib


class WeightStash:
    """The stashed weight versions of this rank's parameters for one step (module docstring)."""

    def __init__(self, params=(), rank=0):
        self.params, self.rank = list(params), rank
        self.version = 0          # of the live weights
        self.kept = {}            # version -> the parameters' arrays of that version
        self.uses = {}            # version -> backwards still to run with it
        self.versions_used = {}   # (stage, mb) -> (the version F found live, the one B swapped in)

    def note(self, a):
        """At F ``a``: keep the live arrays for its backward."""
        if a.version is None:
            return
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
        if version is None:
            yield
            return
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
