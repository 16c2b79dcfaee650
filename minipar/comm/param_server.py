"""The parameter server as an all-reduce (Li et al. 2014): workers push, servers reduce and push
the result back. One server's link carries 2(p-1)n bytes, the bottleneck that all-reduce removes;
sharded over every rank it moves a ring's bytes. (Training with a parameter server, optimizer on
the servers, is ``minipar.parallel.data.ParameterServer``.)

    parameter_server    2(p-1)(alpha + n beta1(n)) + (p-1) n gamma(n)    server: (p-1) n each way
    sharded_ps          2(p-1)(alpha + n/p beta(n/p)) + (p-1) n/p gamma(n/p)    2(p-1)/p n
"""
from minipar.comm.buffers import Accumulator, bounds
from minipar.comm.registry import algorithm


# one way: a worker sends while the server only receives, then the reverse (beta1, cost.py)
@algorithm("all_reduce", "parameter_server", 7,
           lambda p, n, a, b, g: 2 * (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n), one_way=True)
def _all_reduce_ps(c, x, buf, op, server=0):
    """One parameter server: workers push their vector to rank 0, which reduces and pushes
    the result back. The server's link carries 2(p-1)n bytes: the bottleneck."""
    if c.rank == server:
        got = c.scratch("tmp", buf.size, buf)
        total = Accumulator(op, buf)  # 16 bits: added in float32, rounded once
        total.add(x)
        for j in range(c.size):
            if j != server:
                total.add(c.Recv(got, j))
        total.done()
        c.Waitall([c.Isend(buf, j) for j in range(c.size) if j != server])
    else:
        c.Send(x, server)
        c.Recv(buf, server)


@algorithm("all_reduce", "sharded_ps", 8,
           lambda p, n, a, b, g: (2 * (p - 1) * (a + n / p * b(n / p))
                                  + (p - 1) * n / p * g(n / p)))
def _all_reduce_sharded_ps(c, x, buf, op):
    """Sharded parameter server: rank j serves chunk j. Push chunk j to server j, each server
    reduces its shard, then every server sends its shard to every rank."""
    r, p = c.rank, c.size
    chunks = bounds(buf.size, p)
    chunk = lambda a, j: a[chunks[j]:chunks[j + 1]]  # noqa: E731
    mine, src = chunk(buf, r), chunk(x, r)
    sends = [c.Isend(chunk(x, j), j) for j in range(p) if j != r]
    got = c.scratch("tmp", mine.size, buf)
    total = Accumulator(op, mine)  # 16 bits: added in float32, rounded once
    total.add(src)
    for j in range(p):
        if j != r:
            total.add(c.Recv(got, j))
    total.done()
    c.Waitall(sends)
    recvs = [c.Irecv(chunk(buf, j), j) for j in range(p) if j != r]
    c.Waitall([c.Isend(mine, j) for j in range(p) if j != r] + recvs)
