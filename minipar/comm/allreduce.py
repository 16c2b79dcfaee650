"""All-reduce written by hand over point-to-point messages, each algorithm beside its cost.

    y = comm.all_reduce(x, op="sum", algorithm="ring")    # or "auto": the cheapest formula

sequential, parallel, ring (Patarasuk & Yuan), recursive halving (Rabenseifner) and recursive
doubling (Thakur, Rabenseifner & Gropp 2005); shm.py, hierarchical.py and param_server.py add
theirs. Each ``cost(p, n, alpha, beta, gamma)`` is the alpha-beta-gamma model's (cost.py); the
table of them all, with the bytes each sends: docs/comm.md.

An algorithm ``run(c, x, buf, op)`` reads the flat input x and writes the flat result buf
(the same array when in place) on ``c``, the collectives' channel (a wire.Wire); ring and the
recursive ones never copy x into buf first. Reductions run in rank order where ranks would
otherwise add in different orders, so every rank computes the same bits.
"""
import functools

from minipar.comm import cost
from minipar.comm.buffers import Accumulator, bounds, check_call, finish, reducer, result_buffer
from minipar.comm.cost import AUTO_CANDIDATES  # the point-to-point ones: any placement of ranks
from minipar.comm.patterns import (block_bounds, doubling_all_gather, fold, fold_cost, fold_in,
                                   fold_out, halves, halving_reduce_scatter, ring_all_gather,
                                   ring_reduce_scatter)
from minipar.comm.registry import ALGORITHMS, algorithm


def all_reduce(comm, x, op="sum", algorithm="auto", out=None, check=None):
    """Every rank of Communicator ``comm`` gets op(x_0, ..., x_{p-1}) elementwise (op: sum,
    avg, max, min, prod); ``out=x`` reduces in place; ``auto`` picks the algorithm the cost
    model favours (``choose``, asked once per size)."""
    check_call(comm, "all_reduce", x, check, op)
    if algorithm == "auto":
        algorithm = cost.CHOICES.get((comm.size, x.nbytes, comm.nodes)) or auto(comm, x.nbytes)
    run = ALGORITHMS["all_reduce"][algorithm]
    result = result_buffer(x, out)
    if comm.size > 1:  # empty arrays too: a rank whose count differs must hear of it
        flat = result.reshape(-1)
        with comm.coll.call("all_reduce", algorithm, op, x, check=check):
            run(comm.coll, flat if result is x else x.reshape(-1), flat, op)
    elif result is not x:
        result[...] = x
    return finish(result, op, comm.size)


def auto(comm, nbytes):
    """``choose`` for n bytes on comm's ranks and nodes, kept in cost.CHOICES until the cost
    model changes (``cost.use``)."""
    key = (comm.size, nbytes, comm.nodes)
    cost.CHOICES[key] = choose(comm.size, nbytes, nodes=comm.nodes)
    return cost.CHOICES[key]


def choose(p, nbytes, params=None, nodes=None):
    """``auto``: the hand-coded all-reduce the cost model predicts fastest for n bytes on p
    ranks spanning ``nodes`` nodes (None: unknown): shm competes when they all share one node,
    hierarchical when some of them share one (1 < nodes < p)."""
    return _cheapest(p, nbytes, params or cost.default_model(), nodes)


# auto asks on every all-reduce, and four formulas cost about 12 µs of Python a call: the
# answer is kept per size and model (a new fit is a new model, so it asks again)
@functools.lru_cache(maxsize=4096)
def _cheapest(p, nbytes, params, nodes):
    times = {a: cost.predict("all_reduce", a, p, nbytes, params) for a in AUTO_CANDIDATES}
    if nodes == 1:
        times["shm"] = cost.predict("all_reduce", "shm", p, nbytes, params)
    elif nodes is not None and 1 < nodes < p:
        times["hierarchical"] = cost.predict("all_reduce", "hierarchical", p, nbytes, params,
                                             nodes=nodes)
    return min(times, key=times.get)


# one way: each link of the chain sends while the next rank only receives (beta1, cost.py)
@algorithm("all_reduce", "sequential", 0,
           lambda p, n, a, b, g: 2 * (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n), one_way=True)
def _all_reduce_sequential(c, x, buf, op):
    """A chain: rank i adds its vector to the running sum from i-1 and passes it to i+1;
    the last rank holds the total and it travels back down the chain."""
    r, p = c.rank, c.size
    if r > 0:
        got = c.scratch("tmp", buf.size, buf)
        c.Recv(got, r - 1)
        reducer(op, buf)(got, x, out=buf)  # (x0 + ... + x_{r-1}) + x_r, in rank order
    if r < p - 1:
        c.Send(buf if r > 0 else x, r + 1)
        c.Recv(buf, r + 1)
    if r > 0:
        c.Send(buf, r - 1)


@algorithm("all_reduce", "parallel", 1,
           lambda p, n, a, b, g: (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n))
def _all_reduce_parallel(c, x, buf, op):
    """Everyone to everyone: each rank sends its whole vector to all others at once and
    reduces the p vectors itself, in rank order (so every rank computes the same bits)."""
    r, p = c.rank, c.size
    mine = c.scratch("mine", buf.size, buf)
    mine[...] = x
    sends = [c.Isend(mine, j) for j in range(p) if j != r]
    got = c.scratch("tmp", buf.size, buf)
    total = Accumulator(op, buf)  # 16-bit: every vector arrives exact, the sum rounds once
    for j in range(p):
        if j == r:
            total.add(mine)
        else:  # x_0 straight into buf (read at the next add): got is reused for the others
            total.add(c.Recv(buf if j == 0 else got, j))
    total.done()
    c.Waitall(sends)


@algorithm("all_reduce", "ring", 2,
           lambda p, n, a, b, g: (2 * (p - 1) * (a + n / p * b(n / p))
                                  + (p - 1) * n / p * g(n / p)))
def _all_reduce_ring(c, x, buf, op):
    """Ring (Baidu / Patarasuk & Yuan): reduce-scatter round the ring, then all-gather.
    Every chunk of buf is written once: by a reduction (from x) or by a receive."""
    chunks = bounds(buf.size, c.size)
    ring_reduce_scatter(c, buf, chunks, op, shift=0, src=x)
    ring_all_gather(c, buf, chunks, shift=1)


@algorithm("all_reduce", "recursive_halving", 3,
           lambda p, n, a, b, g: (sum(2 * (a + m * b(m)) + m * g(m) for m in halves(p, n))
                                  + fold_cost(p, n, a, b, g)))
def _all_reduce_rabenseifner(c, x, buf, op):
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    nb = block_bounds(bounds(buf.size, c.size), c.size)
    src = fold_in(c, x, buf, op)
    if fold(c.size)[2](c.rank) >= 0:
        halving_reduce_scatter(c, buf, nb, op, src)
        doubling_all_gather(c, buf, nb)
    fold_out(c, buf)


@algorithm("all_reduce", "recursive_doubling", 4,
           lambda p, n, a, b, g: (len(halves(p, n)) * (a + n * b(n) + n * g(n))
                                  + fold_cost(p, n, a, b, g)))
def _all_reduce_doubling(c, x, buf, op):
    """Recursive doubling: log p steps, each swapping the whole vector with rank ^ 2^k."""
    pof2, _, newrank, real = fold(c.size)
    src = fold_in(c, x, buf, op)
    me = newrank(c.rank)
    if me >= 0:
        got = c.scratch("tmp", buf.size, buf)
        reduce = reducer(op, buf)
        mask = 1
        while mask < pof2:
            c.Sendrecv(src, real(me ^ mask), got, real(me ^ mask))
            # the lower rank's data first, so both partners compute the same bits
            if me & mask:
                reduce(got, src, out=buf)
            else:
                reduce(src, got, out=buf)
            src, mask = buf, mask << 1
    fold_out(c, buf)


from minipar.comm import shm, hierarchical  # noqa: E402,F401,I001  (listed after the above)
