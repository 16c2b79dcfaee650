"""The alpha-beta-gamma cost model (Hockney): what a collective should cost, from three constants.

    time(one step, sending m bytes) = alpha + m * beta(m)      time(reduce m bytes) = m * gamma(m)

    cost.predict("all_reduce", "ring", p=4, nbytes=1 << 20)      # seconds, by the formula
    cost.cheapest("all_reduce", AUTO_CANDIDATES, 4, 1 << 20)     # what ``auto`` picks

Each algorithm's formula sits beside its code as ``cost(p, n, a, b, g)``, registered with it
(registry.py): ``a`` is alpha, and ``b(m)``, ``g(m)`` are seconds per byte of an m-byte message
and of an m-byte reduction, so a ring's formula asks for ``b(n / p)``; ``b`` is the exchange's
beta, or the one-way beta for an algorithm registered ``one_way``. fit.py measures the constants per
size on this machine; why per size, and what alpha holds: docs/comm.md.
"""
import collections
import functools
import math
import os

from minipar.comm.registry import ALGORITHMS

AUTO_CANDIDATES = ("ring", "recursive_halving", "recursive_doubling")  # any placement of ranks
Params = collections.namedtuple("Params", "alpha beta gamma")  # the constants at one size
_fitted = {}  # "model": the last fit in this process (fit.py sets it through use())
# auto's choice at the entry point, by (p, bytes, nodes): kept until the model changes (use())
CHOICES = {}


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
    per byte, fitted per size), and the one-way beta(m) in ``one_way`` ({size: seconds per
    byte}; none: the exchange's beta stands in)."""

    def __init__(self, alpha, betas, gammas, alphas=None, one_way=None):
        self.alpha, self.betas, self.gammas = alpha, dict(betas), dict(gammas)
        self.alphas, self.one_way = dict(alphas or {}), dict(one_way or {})

    def alpha_of(self, algorithm):
        """The per-step overhead fitted for this algorithm (else the ring's)."""
        return self.alphas.get(algorithm, self.alpha)

    def beta(self, m):
        return interpolate(self.betas, m)

    def one_way_beta(self, m):
        """Seconds per byte of an m-byte message its peer only receives (else ``beta``)."""
        return interpolate(self.one_way, m) if self.one_way else self.beta(m)

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
    CHOICES.clear()
    return model


def default_model():
    """The cost model ``auto`` and the benchmark use: the last fit in this process, else
    ``MINIPAR_COST="alpha,beta,gamma[,one_way_beta]"`` (seconds, then seconds per byte), else a
    laptop-like guess."""
    if "model" in _fitted:
        return _fitted["model"]
    env = os.environ.get("MINIPAR_COST")
    return from_text(env) if env else GUESS


# one Model per text: auto asks for the default model on every all-reduce (and remembers its
# choices per model: allreduce.choose)
@functools.lru_cache(maxsize=16)
def from_text(text):
    """The Model of ``"alpha,beta,gamma"`` or ``"alpha,beta,gamma,one_way_beta"`` (one value
    each, at every size), or a ValueError naming what is wrong."""
    names = ("alpha", "beta", "gamma", "one_way_beta")
    parts = text.split(",")
    if len(parts) not in (3, 4):
        raise ValueError(f"MINIPAR_COST={text!r}: give alpha,beta,gamma or "
                         f"alpha,beta,gamma,one_way_beta (seconds, seconds per byte)")
    values = {}
    for name, part in zip(names, parts):
        try:
            values[name] = float(part)
        except ValueError:
            raise ValueError(f"MINIPAR_COST={text!r}: {name} {part.strip()!r} is not a "
                             f"number") from None
        if not values[name] >= 0:  # a nan too
            raise ValueError(f"MINIPAR_COST={text!r}: {name} must be >= 0, not {part.strip()}")
    one_way = {1: values["one_way_beta"]} if "one_way_beta" in values else None
    return Model(values["alpha"], {1: values["beta"]}, {1: values["gamma"]}, one_way=one_way)


def predict(collective, algorithm, p, nbytes, model=None, **placement):
    """Predicted seconds of ``collective`` by ``algorithm`` on p ranks for n bytes (None: no
    formula). ``placement`` goes to formulas that depend on where ranks are (hierarchical's
    ``nodes=N``)."""
    fn = ALGORITHMS[collective][algorithm]
    model = model or default_model()
    if fn.cost is None:
        return None
    # an algorithm whose steps send one way (a chain's link, a worker and its server) pays the
    # one-way beta; every other algorithm's steps exchange (sendrecv)
    beta = model.one_way_beta if fn.one_way else model.beta
    return fn.cost(p, nbytes, model.alpha_of(algorithm), beta, model.gamma, **placement)


def cheapest(collective, candidates, p, nbytes, model=None, **placement):
    """The algorithm among ``candidates`` predicted fastest for n bytes on p ranks."""
    return min(candidates,
               key=lambda a: predict(collective, a, p, nbytes, model, **placement))
