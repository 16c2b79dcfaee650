"""What a hook's state does around each step, the same for every stateful hook (PowerSGDState,
TopKState, SignState):

    state.begin(comm, bucket)            # first thing: the ranks agree
    ...                                  # the hook changes error_dict, its memories

At each step's first bucket the ranks compare the state's kind and the settings that
size its messages (one all_gather_object, outside the counters: they hold the hook's formula
bytes alone), so a setting one rank changes between steps is the same CommError on every rank,
naming it, not messages that never pair up.
"""
from ....comm.agreement import same_everywhere
from ....comm.errors import CommError


class HookState:
    """A hook state's step: ``settings()`` what the ranks must agree on. The refusal sticks:
    with overlap the hook thread may still run the step's later buckets, and each raises it
    again without sending anything."""
    refusal = None

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
