"""The table of algorithms: every collective's implementations by name, each with its cost.

    @algorithm("all_reduce", "ring", cost=lambda p, n, a, b, g: ...)
    def _all_reduce_ring(c, x, buf, op, tag): ...

registers a function as ``ALGORITHMS["all_reduce"]["ring"]``, so the communicator's entry point,
the benchmark, ``auto``'s choice (cost.py) and the lessons all read the one formula that sits
above the code. ``cost(p, n, alpha, beta, gamma)`` is the time of n bytes on p ranks; ``beta``
and ``gamma`` are functions of the message size (cost.py). MPI's own collectives are registered
here too, as ``"mpi"`` (mpi.py), with no formula.

``pick`` looks an algorithm up and names the valid choices when the name is unknown.
"""
from minipar.comm.errors import CommError

OPS = ("sum", "avg", "max", "min", "prod")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all",
               "gather", "scatter", "all_to_all_v")
ALGORITHMS = {name: {} for name in COLLECTIVES}


def algorithm(collective, name, cost=None, one_way=False):
    """Register ``fn`` as ``ALGORITHMS[collective][name]``; ``cost(p, n, alpha, beta, gamma)``,
    whose ``beta`` is the one-way beta when ``one_way`` (a rank sends, its peer only receives)."""
    def register(fn):
        fn.cost, fn.one_way = cost, one_way
        ALGORITHMS[collective][name] = fn
        return fn
    return register


def pick(collective, name, op=None):
    """The registered function, or a CommError listing the valid names (and reduction ops)."""
    table = ALGORITHMS[collective]
    if name not in table:
        raise CommError(f"unknown {collective} algorithm {name!r}: choose one of "
                        f"{', '.join(sorted(table))}")
    if op is not None and op not in OPS:
        raise CommError(f"unknown reduction op {op!r}: choose one of {', '.join(OPS)}")
    return table[name]
