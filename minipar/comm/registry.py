"""The table of algorithms: every collective's implementations by name, each with its cost and
its number in the call's fingerprint.

    @algorithm("all_reduce", "ring", 2, cost=lambda p, n, a, b, g: ...)
    def _all_reduce_ring(c, x, buf, op): ...

registers a function as ``ALGORITHMS["all_reduce"]["ring"]``, so the communicator's entry point,
the benchmark, ``auto``'s choice (cost.py) and the lessons all read the one formula that sits
above the code. ``cost(p, n, alpha, beta, gamma)`` is the time of n bytes on p ranks; ``beta``
and ``gamma`` are functions of the message size (cost.py). MPI's own collectives are registered
here too, as ``"mpi"`` (mpi.py), with no formula. The number (0-15, one per name of a
collective) is what the fingerprint carries (agreement.py), whatever order modules load in.

``ALGORITHMS[collective][name]`` of an unknown name, like ``pick``, names the valid choices.
"""
from minipar.comm.errors import CommError

OPS = ("sum", "avg", "max", "min", "prod")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all",
               "gather", "scatter", "all_to_all_v")


class Algorithms(dict):
    """One collective's algorithms by name; a name it lacks is a CommError listing them."""

    def __init__(self, collective):
        super().__init__()
        self.collective = collective

    def __missing__(self, name):
        raise CommError(f"unknown {self.collective} algorithm {name!r}: choose one of "
                        f"{', '.join(sorted(self))}")


ALGORITHMS = {name: Algorithms(name) for name in COLLECTIVES}


def algorithm(collective, name, number, cost=None, one_way=False):
    """Register ``fn`` as ``ALGORITHMS[collective][name]``, carried as ``number`` in its
    fingerprint; ``cost(p, n, alpha, beta, gamma)``, whose ``beta`` is the one-way beta when
    ``one_way`` (a rank sends, its peer only receives)."""
    taken = {fn.id: other for other, fn in ALGORITHMS[collective].items()}
    if not 0 <= number < 16 or taken.get(number, name) != name:
        raise ValueError(f"{collective} algorithm {name!r}: number {number} is taken or not in "
                         f"0-15 (taken: {taken})")

    def register(fn):
        fn.id, fn.cost, fn.one_way = number, cost, one_way
        ALGORITHMS[collective][name] = fn
        return fn
    return register


def check_op(op):
    """A CommError naming the valid reduction ops unless ``op`` is one."""
    if op not in OPS:
        raise CommError(f"unknown reduction op {op!r}: choose one of {', '.join(OPS)}")


def pick(collective, name, op=None):
    """The registered function, or a CommError listing the valid names (and reduction ops)."""
    run = ALGORITHMS[collective][name]
    if op is not None:
        check_op(op)
    return run
