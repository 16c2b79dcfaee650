"""One seeded random stream for parameter initialisation and dropout, replayable.

The state is just (seed, counter): each draw builds a fresh generator from both numbers and then
advances the counter. Saving and restoring that pair replays the exact same masks, which is what
gradient checkpointing needs when it re-runs a forward pass with dropout (Chen et al. 2016), and
what lets every rank build identical parameters from one seed.
"""
from . import backend

_state = {"seed": 0, "counter": 0}


def manual_seed(seed):
    """Restart the stream (like torch.manual_seed)."""
    _state["seed"] = int(seed)
    _state["counter"] = 0


def get_rng_state():
    return (_state["seed"], _state["counter"])


def set_rng_state(state):
    _state["seed"], _state["counter"] = int(state[0]), int(state[1])


def generator(xp=None):
    """A generator for the next draw of the stream (NumPy's or CuPy's ``default_rng``)."""
    xp = xp or backend.xp()
    key = (_state["seed"] * 1_000_003 + _state["counter"]) % (2**63)
    _state["counter"] += 1
    return xp.random.default_rng(key)


class fork_rng:
    """Context: draws inside do not advance the stream outside (restores the state on exit)."""

    def __enter__(self):
        self._saved = get_rng_state()

    def __exit__(self, *exc):
        set_rng_state(self._saved)
        return False
