"""Collectives that move pieces: reduce-scatter, all-gather, all-to-all, gather and scatter.

    reduce_scatter  ring / pairwise     (p-1)(alpha + n/p (beta(n/p) + gamma(n/p)))
                    recursive_halving   sum over m = n/2 ... n/p of alpha + m (beta(m) + gamma(m))
    all_gather      ring                (p-1)(alpha + n/p beta(n/p))
                    recursive_doubling  sum over m = n/2 ... n/p of alpha + m beta(m)
    all_to_all      pairwise            (p-1)(alpha + n/p beta(n/p))
    all_to_all_v    pairwise            (p-1)(alpha + n/p beta(n/p))      (n: the bytes a rank
                                         sends, spread evenly; else each step costs its largest)
    gather, scatter linear              (p-1)(alpha + n/p beta(n/p))      (n: the whole stack)

A reduce-scatter followed by an all-gather is an all-reduce (ring, or halving then doubling):
ZeRO uses the two halves separately. Rank r's piece is chunk r of ``chunk_bounds``.
"""
import collections
import itertools
import math
import numbers

from minipar import backend
from minipar.comm.buffers import (Accumulator, bounds as chunks_of, check_call, contiguous, copy,
                                  finish, result_buffer)
from minipar.comm.errors import CommError
from minipar.comm.patterns import (block_bounds, doubling_all_gather, fold, fold_cost, fold_in,
                                   fold_out, halves, halving_reduce_scatter, ring_all_gather,
                                   ring_reduce_scatter)
from minipar.comm.registry import ALGORITHMS, algorithm


# -- reduce_scatter: x is the whole vector; rank r gets chunk r of the reduced one ---------------

def reduce_scatter(comm, x, op="sum", algorithm="ring", out=None, check=None):
    """Rank r gets chunk r of op(x_0, ..., x_{p-1}) flattened (1-D, ``chunk_bounds`` sizes)."""
    check_call(comm, "reduce_scatter", x, check, op)
    run = ALGORITHMS["reduce_scatter"][algorithm]
    bounds = chunks_of(x.size, comm.size)
    lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
    result = result_buffer(x, out, shape=(hi - lo,))
    work = copy(x).reshape(-1)
    if comm.size > 1:
        with comm.coll.call("reduce_scatter", algorithm, op, x, check=check):
            run(comm.coll, work, bounds, op)
    result[...] = work[lo:hi]
    return finish(result, op, comm.size)


@algorithm("reduce_scatter", "ring", 0,
           lambda p, n, a, b, g: (p - 1) * (a + n / p * (b(n / p) + g(n / p))))
def _reduce_scatter_ring(c, buf, bounds, op):
    """The first half of the ring all-reduce, shifted so that rank r ends with chunk r."""
    ring_reduce_scatter(c, buf, bounds, op, shift=-1)


@algorithm("reduce_scatter", "recursive_halving", 1,
           lambda p, n, a, b, g: (sum(a + m * (b(m) + g(m)) for m in halves(p, n))
                                  + fold_cost(p, n, a, b, g) / 2))
def _reduce_scatter_halving(c, buf, bounds, op):
    """Recursive halving; when p is not a power of two the odd partner, which reduced both
    chunks, hands rank - 1 its chunk at the end."""
    fold_in(c, buf, buf, op)
    if fold(c.size)[2](c.rank) >= 0:
        halving_reduce_scatter(c, buf, block_bounds(bounds, c.size), op)
    if c.rank < 2 * fold(c.size)[1]:
        r = c.rank - c.rank % 2  # the even rank's chunk
        part = buf[bounds[r]:bounds[r + 1]]
        c.Recv(part, c.rank + 1) if c.rank % 2 == 0 else c.Send(part, c.rank - 1)


@algorithm("reduce_scatter", "pairwise", 2,
           lambda p, n, a, b, g: (p - 1) * (a + n / p * (b(n / p) + g(n / p))))
def _reduce_scatter_direct(c, buf, bounds, op):
    """Direct: send chunk j straight to rank j, reduce the p-1 chunks that arrive."""
    r, p = c.rank, c.size
    chunk = lambda j: buf[bounds[j]:bounds[j + 1]]  # noqa: E731
    mine = chunk(r)
    sends = [c.Isend(chunk((r + s) % p), (r + s) % p) for s in range(1, p)]
    got = c.scratch("tmp", mine.size, buf)
    # every chunk arrives as its rank's input, exact: a 16-bit sum rounds once, at done()
    total = Accumulator(op, mine)
    total.add(mine)
    for s in range(1, p):
        total.add(c.Recv(got, (r - s) % p))
    total.done()
    c.Waitall(sends)


# -- all_gather: rank r contributes x; everyone gets an array of shape (p, *x.shape) ------------

def all_gather(comm, x, algorithm="ring", out=None, check=None):
    """Every rank gets the stack [x_0, ..., x_{p-1}] (shape (p, *x.shape))."""
    check_call(comm, "all_gather", x, check)
    run = ALGORITHMS["all_gather"][algorithm]
    result = result_buffer(x, out, shape=(comm.size,) + tuple(x.shape))
    result[comm.rank] = x
    if comm.size > 1:
        bounds = [j * x.size for j in range(comm.size + 1)]
        with comm.coll.call("all_gather", algorithm, None, x, check=check):
            run(comm.coll, result.reshape(-1), bounds)
    return result


@algorithm("all_gather", "ring", 0, lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _all_gather_ring(c, buf, bounds):
    """p-1 steps: pass on to the right the chunk that arrived from the left."""
    ring_all_gather(c, buf, bounds, shift=0)


@algorithm("all_gather", "recursive_doubling", 1,
           lambda p, n, a, b, g: (sum(a + m * b(m) for m in halves(p, n))
                                  + fold_cost(p, n, a, b, lambda m: 0)))
def _all_gather_doubling(c, buf, bounds):
    """log p steps, the block each rank holds doubling every step (MPICH fold when p is not a
    power of two: the even rank lends its chunk to rank + 1 and gets the whole result back)."""
    _, rem, _, _ = fold(c.size)
    r = c.rank
    if r < 2 * rem:
        even = r - r % 2
        part = buf[bounds[even]:bounds[even + 1]]
        c.Send(part, r + 1) if r % 2 == 0 else c.Recv(part, r - 1)
    if fold(c.size)[2](r) >= 0:
        doubling_all_gather(c, buf, block_bounds(bounds, c.size))
    fold_out(c, buf)


# -- all_to_all, gather, scatter -----------------------------------------------------------------

def all_to_all(comm, x, algorithm="pairwise", out=None, check=None):
    """x has shape (p, ...): row j goes to rank j; rank r gets [x_0[r], ..., x_{p-1}[r]]."""
    check_call(comm, "all_to_all", x)
    run = ALGORITHMS["all_to_all"][algorithm]
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise CommError(f"all_to_all needs x of shape ({comm.size}, ...), got {x.shape}")
    check_call(comm, "all_to_all", x, check)
    x = contiguous(x)
    result = result_buffer(x, out)
    result[comm.rank] = x[comm.rank]
    with comm.coll.call("all_to_all", algorithm, None, x, check=check):
        run(comm.coll, x, result)
    return result


@algorithm("all_to_all", "pairwise", 0, lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _all_to_all_pairwise(c, x, result):
    """p-1 steps: in step s send row r+s to rank r+s and receive row r from rank r-s (rows as
    slices: a row of a 1-D x is a scalar, not a buffer)."""
    r, p = c.rank, c.size
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        c.Sendrecv(x[dst:dst + 1], dst, result[src:src + 1], src)


def gather(comm, x, root=0, algorithm="linear", out=None, check=None):
    """Root gets the stack [x_0, ..., x_{p-1}] (returned; other ranks get None)."""
    check_call(comm, "gather", x, check)
    run = ALGORITHMS["gather"][algorithm]
    root = comm.check_peer(root)
    x = contiguous(x)
    at_root = comm.rank == root
    result = result_buffer(x, out, shape=(comm.size,) + tuple(x.shape)) if at_root else None
    if at_root:
        result[root] = x
    with comm.coll.call("gather", algorithm, None, x, root, check):
        run(comm.coll, x, result, root)
    return result


@algorithm("gather", "linear", 0, lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _gather_linear(c, x, result, root):
    """Root receives from every rank in turn (its link carries (p-1)/p of the result)."""
    if c.rank == root:
        for j in range(c.size):
            if j != root:
                c.Recv(result[j], j)
    else:
        c.Send(x, root)


def scatter(comm, x, root=0, algorithm="linear", out=None, check=None):
    """Rank r gets row r of root's x (shape (p, ...)). Other ranks pass x of the same shape
    (values ignored), or x=None with ``out`` of shape x.shape[1:]."""
    check_call(comm, "scatter", x if x is not None else out)
    run = ALGORITHMS["scatter"][algorithm]
    root = comm.check_peer(root)
    at_root = comm.rank == root
    if x is None and (at_root or out is None):
        raise CommError("scatter: the root passes x; other ranks pass x or out")
    if x is not None and (x.ndim == 0 or x.shape[0] != comm.size):
        raise CommError(f"scatter needs x of shape ({comm.size}, ...), got {x.shape}")
    check_call(comm, "scatter", x[0] if x is not None else out, check)
    result = result_buffer(out if x is None else x[0], out)
    x = contiguous(x) if at_root else x
    if at_root:
        result[...] = x[root]
    with comm.coll.call("scatter", algorithm, None, result, root, check):
        run(comm.coll, x, result, root)
    return result


@algorithm("scatter", "linear", 0, lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _scatter_linear(c, x, result, root):
    """Root sends row j to rank j, all at once."""
    if c.rank == root:
        c.Waitall([c.Isend(x[j], j) for j in range(c.size) if j != root])
    else:
        c.Recv(result, root)


# -- all_to_all_v: a different number of rows for every peer (expert parallelism) ----------------

def all_to_all_v(comm, x, send_counts, recv_counts=None, algorithm="pairwise", check=None):
    """x's rows grouped by destination: the first ``send_counts[0]`` go to rank 0, the next
    ``send_counts[1]`` to rank 1, ...; returns the rows received, rank 0's first (shape
    (sum(recv_counts), *x.shape[1:])). ``recv_counts[j]`` is rank j's ``send_counts[me]``; when
    None, the ranks first exchange their counts (an all_to_all of p integers, counted too)."""
    check_call(comm, "all_to_all_v", x)
    run = ALGORITHMS["all_to_all_v"][algorithm]
    send = _counts(comm, "send_counts", send_counts)
    if x.ndim == 0 or x.shape[0] != sum(send):
        raise CommError(f"rank {comm.rank}: all_to_all_v: send_counts {send} add up to "
                        f"{sum(send)} rows, but x has shape {tuple(x.shape)}")
    check_call(comm, "all_to_all_v (row counts shown as 0)", x[:0], check)  # the row shape
    if recv_counts is None:
        recv = [int(n) for n in all_to_all(comm, backend.numpy.asarray(send, "int64"))]
    else:
        recv = _counts(comm, "recv_counts", recv_counts)
    if recv[comm.rank] != send[comm.rank]:
        raise CommError(f"rank {comm.rank}: all_to_all_v: keeps {send[comm.rank]} rows for "
                        f"itself (send_counts) but expects {recv[comm.rank]} (recv_counts)")
    width = math.prod(x.shape[1:])
    rows = contiguous(x).reshape(len(x), width)
    result = backend.get_array_module(x).empty((sum(recv), width), x.dtype)
    sent, got = offsets(send), offsets(recv)
    me = comm.rank
    result[got[me]:got[me + 1]] = rows[sent[me]:sent[me + 1]]
    like = _Like(x.dtype, width)  # the fingerprint's count: the row width, equal on every rank
    with comm.coll.call("all_to_all_v", algorithm, None, like, check=check):
        run(comm.coll, rows, result, sent, got)
    return result.reshape((sum(recv),) + tuple(x.shape[1:]))


_Like = collections.namedtuple("_Like", "dtype size")


def offsets(counts):
    """[0, c0, c0 + c1, ...]: where each peer's rows start."""
    return [0, *itertools.accumulate(counts)]


def _counts(comm, name, counts):
    """``counts`` as p non-negative Python ints, or a CommError naming what is wrong."""
    counts = [int(n) if isinstance(n, numbers.Integral) else n for n in counts]
    if len(counts) != comm.size or any(not isinstance(n, int) or n < 0 for n in counts):
        raise CommError(f"rank {comm.rank}: all_to_all_v: {name} must be {comm.size} "
                        f"non-negative integers (one per rank), got {counts}")
    return counts


@algorithm("all_to_all_v", "pairwise", 0, lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _all_to_all_v_pairwise(c, rows, result, sent, got):
    """p-1 steps: in step s send my rows for rank r+s and receive rank r-s's rows for me (a
    message of zero rows still goes: both sides know the counts, and it keeps the steps paired)."""
    r, p = c.rank, c.size
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        c.Sendrecv(rows[sent[dst]:sent[dst + 1]], dst, result[got[src]:got[src + 1]], src)
