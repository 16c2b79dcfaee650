"""The alpha-beta-gamma cost model: what a collective should cost, from three constants.

    time(one step, sending m bytes) = alpha + m * beta(m)      time(reduce m bytes) = m * gamma(m)

Each algorithm's formula sits beside its code (allreduce.py, trees.py, exchange.py, ...) as
``cost(p, n, a, b, g)``, registered with it (registry.py):
``a`` is alpha, and ``b(m)``, ``g(m)`` are seconds per byte of an m-byte message and of an
m-byte reduction, so a ring's formula asks for ``b(n / p)``, the size of the messages it sends.

Caches make beta and gamma depend on the size: 64 KiB stays in L2, 4 MiB in L3, and 16 MiB or
more streams from memory at a third of the speed. So ``fit.fit(comm)`` measures them at every power
of two in ``FIT_SIZES`` the way the algorithms use the machine (every rank sends a message to
rank + 1 while it receives one from rank - 1, a ring step; every rank reduces into a third
array at the same moment, as a ring reduces x and the chunk that arrived into the result), and
``b(m)`` and ``g(m)`` interpolate between them (linear in log2 m; below 32 KiB a message costs
about alpha, whatever its beta, so the 32 KiB values stand in). When ranks outnumber cores,
this folds the sharing of cores into the constants.

alpha is what one step costs beyond its bytes: MPI's latency, and the Python around it (the
wrapper's checks and counters, slicing, the ufunc call). That Python differs by algorithm, so
``fit.fit(comm, algorithms)`` gives each algorithm its own alpha: its tiny all-reduce (16 floats a
rank), timed like the benchmark times one, over its number of steps (the alphas in its formula,
read off as ``cost(p, n, 1, 0, 0)``). ``model.alpha`` is the ring's.

``default_model()`` is the last fit in this process, else ``MINIPAR_COST="alpha,beta,gamma"``
(seconds, seconds per byte, seconds per byte), else a laptop-like guess.
"""
import collections
import math
import os

from minipar.comm.registry import ALGORITHMS

AUTO_CANDIDATES = ("ring", "recursive_halving", "recursive_doubling")  # any placement of ranks
Params = collections.namedtuple("Params", "alpha beta gamma")  # the constants at one size
_fitted = {}  # "model": the last fit in this process (fit.py sets it through use())


def interpolate(table, m):
    """{size: value} at m bytes: linear in log2(m) between the fitted sizes around m."""
    sizes = sorted(table)
    x = math.log2(min(max(m, sizes[0]), sizes[-1]))
    for lo, hi in zip(sizes, sizes[1:]):
        if x <= math.log2(hi):
            w = (x - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return (1 - w) * table[lo] + w * table[hi]
    return table[sizes[-1]]


class Model:
    """alpha (seconds per step; per algorithm in ``alphas``), beta(m) and gamma(m) (seconds
    per byte, fitted per size)."""

    def __init__(self, alpha, betas, gammas, alphas=None):
        self.alpha, self.betas, self.gammas = alpha, dict(betas), dict(gammas)
        self.alphas = dict(alphas or {})

    def alpha_of(self, algorithm):
        """The per-step overhead fitted for this algorithm (else the ring's)."""
        return self.alphas.get(algorithm, self.alpha)

    def beta(self, m):
        return interpolate(self.betas, m)

    def gamma(self, m):
        return interpolate(self.gammas, m)

    def at(self, m):
        """The constants an m-byte message or reduction sees, as Params."""
        return Params(self.alpha, self.beta(m), self.gamma(m))

    def __repr__(self):
        return f"Model(alpha={self.alpha:.3g}, sizes={sorted(self.betas)})"


# a laptop's memory moving ~12 GB/s: a reduction streams 3 bytes per byte (2 read, 1 written),
# a message through MPI's shared memory 4 (copied into a cell and out of it)
GUESS = Model(5e-6, {1: 4 / 12e9}, {1: 3 / 12e9})


def use(model):
    """Make ``model`` the ``default_model()`` of this process (``fit.fit`` calls it)."""
    _fitted["model"] = model
    return model


def default_model():
    """The cost model ``auto`` and the benchmark use (see the module docstring)."""
    if "model" in _fitted:
        return _fitted["model"]
    env = os.environ.get("MINIPAR_COST")
    if env:
        alpha, beta, gamma = (float(v) for v in env.split(","))
        return Model(alpha, {1: beta}, {1: gamma})
    return GUESS


def predict(collective, algorithm, p, nbytes, model=None, **placement):
    """Predicted seconds of ``collective`` by ``algorithm`` on p ranks for n bytes (None: no
    formula). ``placement`` goes to formulas that depend on where ranks are (hierarchical's
    ``nodes=N``)."""
    formula = ALGORITHMS[collective][algorithm].cost
    model = model or default_model()
    if formula is None:
        return None
    return formula(p, nbytes, model.alpha_of(algorithm), model.beta, model.gamma, **placement)


def cheapest(collective, candidates, p, nbytes, model=None, **placement):
    """The algorithm among ``candidates`` predicted fastest for n bytes on p ranks."""
    return min(candidates,
               key=lambda a: predict(collective, a, p, nbytes, model, **placement))
