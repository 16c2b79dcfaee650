"""What a hook's state does around each step, the same for every stateful hook (PowerSGDState,
TopKState, SignState):

    state.begin(comm, bucket)            # first thing: the ranks agree, the state is kept
    ...                                  # the hook changes error_dict, its memories
    return state.settle(bucket, result)  # last thing: a skipped step is undone

Agreement: at each step's first bucket the ranks compare the state's kind and the settings that
size its messages (one all_gather_object, outside the counters: they hold the hook's formula
bytes alone), so a setting one rank changes between steps is the same CommError on every rank,
naming it, not messages that never pair up. Undo: a step GradScaler skips changes nothing
(docs/engine.md). It skips when a gradient the optimizer reads is inf or NaN; under DDP those
are the hooks' results, the same bits on every rank, so every rank sees the same verdict here
and, when a result of the step is not finite, puts back its copy from the step's start.
"""
import copy

from .... import backend
from ....comm.agreement import same_everywhere
from ....comm.errors import CommError


class HookState:
    """A hook state's step: ``kept`` names what a step changes (copied at its start, put back
    if it is skipped), ``settings()`` what the ranks must agree on. The refusal sticks: with
    overlap the hook thread may still run the step's later buckets, and each raises it again
    without sending anything."""
    kept = ("error_dict",)
    refusal, _before = None, None

    def settings(self):
        return {}

    def begin(self, comm, bucket):
        if self.refusal:
            raise CommError(self.refusal)
        if bucket.index() != 0:
            return
        try:
            same_everywhere(comm, type(self).__name__,
                            {"state": type(self).__name__, **self.settings()})
        except CommError as error:
            self.refusal = str(error)
            raise
        # a whole copy: PowerSGD's P and Q memories are all-reduced in place
        self._before = {name: copy.deepcopy(getattr(self, name)) for name in self.kept}
        self._finite = []

    def settle(self, bucket, result):
        """``result``, after noting whether it is finite; at the step's last bucket, the state
        from the step's start put back if any result of the step was not."""
        if self._before is None:  # a bucket called outside a step begun at bucket 0
            return result
        self._finite.append(backend.get_array_module(result).isfinite(result).all())
        if bucket.is_last():
            if not all(bool(finite) for finite in self._finite):  # one host read a bucket
                for name, value in self._before.items():
                    setattr(self, name, value)
            self._before = None
        return result
