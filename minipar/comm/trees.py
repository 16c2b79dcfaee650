"""Broadcast and reduce: one root and p-1 others, over a binomial tree or scatter + all-gather.

    broadcast  binomial            log p (alpha + n beta(n))
               scatter_allgather   (log p + p - 1) alpha + 2(p-1)/p n beta(n/p)   (long vectors)
    reduce     binomial            log p (alpha + n beta(n) + n gamma(n))

A binomial tree over p ranks, numbered relative to the root (rel = (rank - root) mod p): in step
k every rank that has the data sends it 2^k ranks further, so after ceil(log2 p) steps all have
it. Reduce is the broadcast run backwards: receive from the children, send to the parent.
"""
from minipar.comm.buffers import Accumulator, check_call, chunk_bounds, copy, finish, result_buffer
from minipar.comm.patterns import log2, ring_all_gather
from minipar.comm.registry import ALGORITHMS, algorithm


def broadcast(comm, x, root=0, algorithm="binomial", out=None, check=None):
    """Every rank gets root's x. Other ranks pass an array of the same shape and dtype (its
    values are ignored) or ``out``; ``out=x`` receives in place."""
    check_call(comm, "broadcast", x, check)
    run = ALGORITHMS["broadcast"][algorithm]
    root = comm.check_peer(root)
    result = result_buffer(x, out)
    if comm.rank == root and result is not x:
        result[...] = x
    if comm.size > 1:
        with comm.coll.call("broadcast", algorithm, None, x, root, check):
            run(comm.coll, result.reshape(-1), root)
    return result


@algorithm("broadcast", "binomial", 0, lambda p, n, a, b, g: log2(p) * (a + n * b(n)))
def _broadcast_binomial(c, buf, root):
    """Binomial tree: in step k every rank that has the data sends it 2^k ranks further."""
    p, rel = c.size, (c.rank - root) % c.size
    mask = 1
    while mask < p:  # receive from the parent: rel with its lowest set bit cleared
        if rel & mask:
            c.Recv(buf, (rel - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask:  # then send to the children rel + 2^j, largest subtree first
        if rel + mask < p:
            c.Send(buf, (rel + mask + root) % p)
        mask >>= 1


@algorithm("broadcast", "scatter_allgather", 1,
           lambda p, n, a, b, g: (log2(p) + p - 1) * a + 2 * (p - 1) / p * n * b(n / p))
def _broadcast_scatter_allgather(c, buf, root):
    """Van de Geijn: a binomial scatter cuts the vector into p chunks (chunk k to relative
    rank k), then a ring all-gather puts them back together on every rank. For long vectors."""
    p, rel = c.size, (c.rank - root) % c.size
    bounds = chunk_bounds(buf.size, p)
    span = lambda lo, hi: buf[bounds[lo]:bounds[min(hi, p)]]  # noqa: E731  (chunks lo..hi-1)
    mask = 1
    while mask < p:  # a subtree of size mask starts at rel: receive all its chunks
        if rel & mask:
            c.Recv(span(rel, rel + mask), (rel - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if rel + mask < p:
            c.Send(span(rel + mask, rel + 2 * mask), (rel + mask + root) % p)
        mask >>= 1
    ring_all_gather(c, buf, bounds, shift=-root)


def reduce(comm, x, root=0, op="sum", algorithm="binomial", out=None, check=None):
    """Root gets op(x_0, ..., x_{p-1}) (returned; other ranks get None)."""
    check_call(comm, "reduce", x, check, op)
    run = ALGORITHMS["reduce"][algorithm]
    root = comm.check_peer(root)
    at_root = comm.rank == root
    work = result_buffer(x, out) if at_root else copy(x)
    if work is not x:
        work[...] = x
    if comm.size > 1:
        with comm.coll.call("reduce", algorithm, op, x, root, check):
            run(comm.coll, work.reshape(-1), root, op)
    return finish(work, op, comm.size) if at_root else None


@algorithm("reduce", "binomial", 0, lambda p, n, a, b, g: log2(p) * (a + n * b(n) + n * g(n)))
def _reduce_binomial(c, buf, root, op):
    """Binomial tree, the broadcast run backwards: receive from children, send to the parent."""
    p, rel = c.size, (c.rank - root) % c.size
    got = c.scratch("tmp", buf.size, buf)
    total = Accumulator(op, buf)
    total.add(buf)
    mask = 1
    while mask < p and not rel & mask:  # children rel + 1, rel + 2, rel + 4, ...
        if rel + mask < p:
            total.add(c.Recv(got, (rel + mask + root) % p))
        mask <<= 1
    total.done()  # 16-bit: the children's sums added in float32, rounded once here
    if mask < p:  # then to the parent, rel with its lowest set bit cleared
        c.Send(buf, (rel - mask + root) % p)
