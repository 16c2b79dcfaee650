"""Collectives written by hand over point-to-point messages, each beside its cost formula.

Cost model (Hockney; Thakur, Rabenseifner & Gropp 2005): a step sending an m-byte message
takes alpha + m beta(m); reducing m bytes takes m gamma(m). beta and gamma are fitted per size
(cost.py: caches), so each term reads them at its own message size; alpha per algorithm (the
Python around a step differs: cost.py). For p ranks, n bytes:

    all_reduce          time                                             bytes sent per rank
    sequential          2(p-1)(alpha + n beta(n)) + (p-1) n gamma(n)     n (2n on inner ranks)
    parallel            (p-1)(alpha + n beta(n)) + (p-1) n gamma(n)      (p-1) n
    ring                2(p-1)(alpha + n/p beta(n/p)) + (p-1) n/p gamma(n/p)    2(p-1)/p n
    recursive_halving   sum over m = n/2, n/4, ..., n/p of                2(p-1)/p n
                          2(alpha + m beta(m)) + m gamma(m)
    recursive_doubling  log p (alpha + n beta(n) + n gamma(n))           n log p
    parameter_server    2(p-1)(alpha + n beta(n)) + (p-1) n gamma(n)     server: (p-1) n each way
    sharded_ps          2(p-1)(alpha + n/p beta(n/p)) + (p-1) n/p gamma(n/p)    2(p-1)/p n
    mpi                 MPI_Allreduce (the reference); auto: the cheapest formula for n

(p not a power of two: log p and p read pof2, plus the fold's 2(alpha + n beta(n)) + n gamma(n).)

Every algorithm is registered with ``@algorithm(collective, name, cost)``, so the benchmark, the
``auto`` choice and the lessons read the same formula that sits above the code.

Conventions. Arrays go in and a new array comes out; pass ``out=x`` to work in place. A vector is
cut into p chunks by ``chunk_bounds`` (sizes differ by at most one, so any count works, zero and
counts smaller than p included). Ranks that are not a power of two are handled as MPICH does:
the first 2*rem ranks pair up (the even one hands its data to the odd one and sits out), the
remaining pof2 ranks run the power-of-two algorithm, and the result is handed back.

Checking. Messages travel on the communicator's private channel, tagged with their dtype; every
receive checks size and tag, so ranks that disagree on length or dtype get a ``CommError``
instead of a wrong sum (and an uncaught error aborts the job). With ``check=True`` or
``MINIPAR_DEBUG=1`` the ranks first exchange (count, dtype), and every rank raises the same error.
"""
import functools
import math
import os
import queue
import threading

from mpi4py import MPI

from minipar import backend
from minipar.comm import cost as cost_model
from minipar.comm.communicator import CommError, Communicator, Request, dtype_tag

OPS = ("sum", "avg", "max", "min", "prod")
_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}
_MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

ALGORITHMS = {name: {} for name in ("all_reduce", "broadcast", "reduce", "reduce_scatter",
                                    "all_gather", "all_to_all", "gather", "scatter")}


def algorithm(collective, name, cost=None):
    """Register ``fn`` as ``ALGORITHMS[collective][name]``; ``cost(p, n, alpha, beta, gamma)``."""
    def register(fn):
        fn.cost = cost
        ALGORITHMS[collective][name] = fn
        return fn
    return register


def chunk_bounds(n, p):
    """Offsets of p nearly equal chunks of n elements: chunk i is [b[i], b[i+1])."""
    return list(_chunk_bounds(n, p))


@functools.lru_cache(maxsize=256)
def _chunk_bounds(n, p):  # cached: the collectives ask for the same (n, p) call after call
    q, r = divmod(n, p)
    return tuple(i * q + min(i, r) for i in range(p + 1))


def log2(p):
    """Depth of a binomial tree over p ranks: ceil(log2 p)."""
    return math.ceil(math.log2(p)) if p > 1 else 0


def _halves(p, n):
    """Bytes per step of recursive halving over the largest power of two <= p ranks:
    n/2, n/4, ..., n/pof2 (log2 pof2 steps; they add up to (pof2-1)/pof2 n)."""
    return [n / 2 ** k for k in range(1, p.bit_length())]


# ----------------------------------------------------------------------------------------------
# Shared pieces: checks, scratch buffers, the reduction, MPICH's non-power-of-two fold
# ----------------------------------------------------------------------------------------------

DEBUG = os.environ.get("MINIPAR_DEBUG", "0") not in ("", "0")  # read once: checks are per call


def _pick(collective, name, op=None):
    table = ALGORITHMS[collective]
    if name not in table:
        raise CommError(f"unknown {collective} algorithm {name!r}: choose one of "
                        f"{', '.join(sorted(table))}")
    if op is not None and op not in OPS:
        raise CommError(f"unknown reduction op {op!r}: choose one of {', '.join(OPS)}")
    return table[name]


def check_same(comm, what, x, check=None):
    """Raise the same CommError on every rank when ranks disagree on x's shape or dtype.

    Runs when ``check`` is True, or when it is None and MINIPAR_DEBUG=1 (one small MPI
    allgather of metadata: a check, not part of any algorithm)."""
    if comm.size == 1 or not (check or (check is None and DEBUG)):
        return
    mine = (tuple(x.shape), x.dtype.name) if x is not None else None
    seen = comm.all_gather_object(mine)
    if any(s != seen[0] for s in seen if s is not None):
        table = ", ".join(f"rank {r}: {s[1]}{list(s[0])}" for r, s in enumerate(seen) if s)
        raise CommError(f"{what}: arrays differ across ranks ({table})")


def _scratch(comm, slot, n, like):
    """A reusable work buffer of n elements of like's dtype (grown, never shrunk, per slot)."""
    have = comm._scratch.get(slot)
    if have is None or have.size < n or have.dtype != like.dtype or type(have) is not type(like):
        have = backend.get_array_module(like).empty(max(n, 1), like.dtype)
        comm._scratch[slot] = have
    return have[:n]


def _reducer(op, like):
    """The in-place reduction ``f(a, b, out=a)`` for op on like's array module."""
    return getattr(backend.get_array_module(like), _UFUNC[op])


def _finish(buf, op, p):
    """avg = sum / p (floor division for integer dtypes, like MPI's SUM followed by // p)."""
    if op == "avg":
        xp = backend.get_array_module(buf)
        divide = xp.floor_divide if buf.dtype.kind in "iub" else xp.true_divide
        divide(buf, buf.dtype.type(p), out=buf)
    return buf


def _result(x, out, shape=None, dtype=None):
    """The array the result is written into: ``out`` (checked) or a fresh one."""
    if out is None:
        return backend.get_array_module(x).empty(x.shape if shape is None else shape,
                                                 x.dtype if dtype is None else dtype)
    if not out.flags.c_contiguous:
        raise CommError("out must be a C-contiguous array")
    want = tuple(x.shape if shape is None else shape)
    if out.shape != want:
        raise CommError(f"out has shape {out.shape}, expected {want}")
    return out


@functools.lru_cache(maxsize=None)
def _fold(p):
    """MPICH's non-power-of-two plan: (pof2, rem, newrank of rank r, real rank of newrank j)."""
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2

    def newrank(r):
        if r < 2 * rem:
            return -1 if r % 2 == 0 else r // 2
        return r - rem

    def real(j):
        return 2 * j + 1 if j < rem else j + rem
    return pof2, rem, newrank, real


def _block_bounds(bounds, p):
    """Element offsets of the pof2 blocks after the fold: block j holds real ranks' chunks.

    Newrank j < rem stands for ranks 2j and 2j+1, so its block is their two chunks."""
    pof2, rem, _, _ = _fold(p)
    return [bounds[2 * j if j < rem else j + rem] for j in range(pof2)] + [bounds[p]]


def _halving_reduce_scatter(c, buf, nb, op, tag, src=None):
    """Recursive halving over pof2 newranks: after log p steps newrank j holds block j reduced.

    Step k exchanges half of the current window with newrank ^ (pof2 >> k). The first step
    reads the input from ``src`` (default: buf itself) and writes the kept half into buf."""
    pof2, _, newrank, real = _fold(c.size)
    me, lo, hi, mask = newrank(c.rank), 0, pof2, pof2 >> 1
    reduce = _reducer(op, buf)
    tmp = _scratch(c, "halving", max(nb[(pof2 >> 1)] - nb[0], nb[pof2] - nb[pof2 >> 1]), buf)
    src = buf if src is None else src
    while mask:
        mid = (lo + hi) // 2
        (k0, k1), (g0, g1) = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        got = tmp[:nb[k1] - nb[k0]]
        c.sendrecv(src[nb[g0]:nb[g1]], real(me ^ mask), got, real(me ^ mask), tag)
        reduce(src[nb[k0]:nb[k1]], got, out=buf[nb[k0]:nb[k1]])
        lo, hi, mask, src = k0, k1, mask >> 1, buf


def _doubling_all_gather(c, buf, nb, tag):
    """Recursive doubling over pof2 newranks: the window each holds doubles every step."""
    pof2, _, newrank, real = _fold(c.size)
    me, mask = newrank(c.rank), 1
    while mask < pof2:
        lo = me - me % mask
        peer_lo = lo ^ mask
        c.sendrecv(buf[nb[lo]:nb[lo + mask]], real(me ^ mask),
                   buf[nb[peer_lo]:nb[peer_lo + mask]], real(me ^ mask), tag)
        mask <<= 1


def _ring_reduce_scatter(c, buf, bounds, op, tag, shift, src=None):
    """p-1 steps round the ring; rank r ends holding chunk (r + shift + 1) % p reduced.

    Each chunk is reduced once, from the input ``src`` (default: buf itself) into buf, so an
    out-of-place all-reduce never copies its input first (NCCL: read sendbuff, write recvbuff)."""
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    reduce = _reducer(op, buf)
    tmp = _scratch(c, "ring", bounds[1] - bounds[0], buf)
    src = buf if src is None else src
    for s in range(p - 1):
        send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
        lo, hi = bounds[recv], bounds[recv + 1]
        got = tmp[:hi - lo]
        c.sendrecv((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right, got, left, tag)
        reduce(src[lo:hi], got, out=buf[lo:hi])


def _ring_all_gather(c, buf, bounds, tag, shift):
    """p-1 steps round the ring; rank r starts holding chunk (r + shift) % p, ends with all."""
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
        c.sendrecv(buf[bounds[send]:bounds[send + 1]], right,
                   buf[bounds[recv]:bounds[recv + 1]], left, tag)


# ----------------------------------------------------------------------------------------------
# all_reduce
# ----------------------------------------------------------------------------------------------

AUTO_CANDIDATES = ("ring", "recursive_halving", "recursive_doubling")


def all_reduce(comm, x, op="sum", algorithm="auto", out=None, check=None):
    """Every rank gets op(x_0, ..., x_{p-1}) elementwise; ``out=x`` reduces in place.

    An algorithm ``run(c, x, buf, op, tag)`` reads the flat input x and writes the flat result
    buf (the same array when in place); ring and the recursive ones never copy x into buf."""
    if algorithm == "auto":
        algorithm = choose(comm.size, x.nbytes)
    run = _pick("all_reduce", algorithm, op)
    check_same(comm, "all_reduce", x, check)
    result = _result(x, out)
    if algorithm == "mpi":
        return _finish(_mpi_all_reduce(comm, x, result, op), op, comm.size)
    if comm.size > 1 and x.size:
        run(comm.coll, x.reshape(-1), result.reshape(-1), op, dtype_tag(x.dtype))
    elif result is not x:
        result[...] = x
    return _finish(result, op, comm.size)


def choose(p, nbytes, params=None):
    """``auto``: the hand-coded all-reduce the cost model predicts fastest for n bytes."""
    return min(AUTO_CANDIDATES,
               key=lambda a: cost_model.predict("all_reduce", a, p, nbytes, params))


@algorithm("all_reduce", "sequential",
           lambda p, n, a, b, g: 2 * (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n))
def _all_reduce_sequential(c, x, buf, op, tag):
    """A chain: rank i adds its vector to the running sum from i-1 and passes it to i+1;
    the last rank holds the total and it travels back down the chain."""
    r, p = c.rank, c.size
    if r > 0:
        got = _scratch(c, "tmp", buf.size, buf)
        c.recv(got, r - 1, tag)
        _reducer(op, buf)(got, x, out=buf)  # (x0 + ... + x_{r-1}) + x_r, in rank order
    if r < p - 1:
        c.send(buf if r > 0 else x, r + 1, tag)
        c.recv(buf, r + 1, tag)
    if r > 0:
        c.send(buf, r - 1, tag)


@algorithm("all_reduce", "parallel",
           lambda p, n, a, b, g: (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n))
def _all_reduce_parallel(c, x, buf, op, tag):
    """Everyone to everyone: each rank sends its whole vector to all others at once and
    reduces the p vectors itself, in rank order (so every rank computes the same bits)."""
    r, p = c.rank, c.size
    mine = _scratch(c, "mine", buf.size, buf)
    mine[...] = x
    if r == 0 and buf is not x:
        buf[...] = x  # rank 0's running sum starts as x_0
    sends = [c.isend(mine, j, tag) for j in range(p) if j != r]
    got = _scratch(c, "tmp", buf.size, buf)
    reduce = _reducer(op, buf)
    for j in range(p):
        if j == 0 and r != 0:
            c.recv(buf, 0, tag)  # buf starts as x_0 (rank 0's buf already is)
        elif j > 0:
            reduce(buf, mine if j == r else c.recv(got, j, tag), out=buf)
    Request.wait_all(sends)


@algorithm("all_reduce", "ring",
           lambda p, n, a, b, g: (2 * (p - 1) * (a + n / p * b(n / p))
                                  + (p - 1) * n / p * g(n / p)))
def _all_reduce_ring(c, x, buf, op, tag):
    """Ring (Baidu / Patarasuk & Yuan): reduce-scatter round the ring, then all-gather.
    Every chunk of buf is written once: by a reduction (from x) or by a receive."""
    bounds = _chunk_bounds(buf.size, c.size)
    _ring_reduce_scatter(c, buf, bounds, op, tag, shift=0, src=x)
    _ring_all_gather(c, buf, bounds, tag, shift=1)


def _fold_in(c, x, buf, op, tag):
    """Non-power-of-two pre-step: even ranks below 2*rem give their vector to rank + 1.
    Returns where this rank's vector now is: buf (it received and reduced) or still x."""
    pof2, rem, _, _ = _fold(c.size)
    if c.rank < 2 * rem:
        if c.rank % 2 == 0:
            c.send(x, c.rank + 1, tag)
        else:
            got = _scratch(c, "tmp", buf.size, buf)
            c.recv(got, c.rank - 1, tag)
            _reducer(op, buf)(x, got, out=buf)
            return buf
    return x


def _fold_out(c, buf, tag):
    """Non-power-of-two post-step: odd ranks below 2*rem hand the result back to rank - 1."""
    _, rem, _, _ = _fold(c.size)
    if c.rank < 2 * rem:
        if c.rank % 2 == 0:
            c.recv(buf, c.rank + 1, tag)
        else:
            c.send(buf, c.rank - 1, tag)


def _fold_cost(p, n, a, b, g):
    """The two extra full-vector messages (and one reduction) when p is not a power of two."""
    return 0 if p & (p - 1) == 0 else 2 * (a + n * b(n)) + n * g(n)


@algorithm("all_reduce", "recursive_halving",
           lambda p, n, a, b, g: (sum(2 * (a + m * b(m)) + m * g(m) for m in _halves(p, n))
                                  + _fold_cost(p, n, a, b, g)))
def _all_reduce_rabenseifner(c, x, buf, op, tag):
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    nb = _block_bounds(_chunk_bounds(buf.size, c.size), c.size)
    src = _fold_in(c, x, buf, op, tag)
    if _fold(c.size)[2](c.rank) >= 0:
        _halving_reduce_scatter(c, buf, nb, op, tag, src)
        _doubling_all_gather(c, buf, nb, tag)
    _fold_out(c, buf, tag)


@algorithm("all_reduce", "recursive_doubling",
           lambda p, n, a, b, g: (len(_halves(p, n)) * (a + n * b(n) + n * g(n))
                                  + _fold_cost(p, n, a, b, g)))
def _all_reduce_doubling(c, x, buf, op, tag):
    """Recursive doubling: log p steps, each swapping the whole vector with rank ^ 2^k."""
    pof2, _, newrank, real = _fold(c.size)
    src = _fold_in(c, x, buf, op, tag)
    me = newrank(c.rank)
    if me >= 0:
        got = _scratch(c, "tmp", buf.size, buf)
        reduce = _reducer(op, buf)
        mask = 1
        while mask < pof2:
            c.sendrecv(src, real(me ^ mask), got, real(me ^ mask), tag)
            # the lower rank's data first, so both partners compute the same bits
            if me & mask:
                reduce(got, src, out=buf)
            else:
                reduce(src, got, out=buf)
            src, mask = buf, mask << 1
    _fold_out(c, buf, tag)


@algorithm("all_reduce", "parameter_server",
           lambda p, n, a, b, g: 2 * (p - 1) * (a + n * b(n)) + (p - 1) * n * g(n))
def _all_reduce_ps(c, x, buf, op, tag, server=0):
    """One parameter server: workers push their vector to rank 0, which reduces and pushes
    the result back. The server's link carries 2(p-1)n bytes: the bottleneck."""
    if c.rank == server:
        got = _scratch(c, "tmp", buf.size, buf)
        reduce = _reducer(op, buf)
        src = x
        for j in range(c.size):
            if j != server:
                reduce(src, c.recv(got, j, tag), out=buf)
                src = buf
        Request.wait_all([c.isend(buf, j, tag) for j in range(c.size) if j != server])
    else:
        c.send(x, server, tag)
        c.recv(buf, server, tag)


@algorithm("all_reduce", "sharded_ps",
           lambda p, n, a, b, g: (2 * (p - 1) * (a + n / p * b(n / p))
                                  + (p - 1) * n / p * g(n / p)))
def _all_reduce_sharded_ps(c, x, buf, op, tag):
    """Sharded parameter server: rank j serves chunk j. Push chunk j to server j, each server
    reduces its shard, then every server sends its shard to every rank."""
    r, p = c.rank, c.size
    bounds = _chunk_bounds(buf.size, p)
    chunk = lambda a, j: a[bounds[j]:bounds[j + 1]]  # noqa: E731
    mine, src = chunk(buf, r), chunk(x, r)
    sends = [c.isend(chunk(x, j), j, tag) for j in range(p) if j != r]
    got = _scratch(c, "tmp", mine.size, buf)
    reduce = _reducer(op, buf)
    for j in range(p):
        if j != r:
            reduce(src, c.recv(got, j, tag), out=mine)
            src = mine
    Request.wait_all(sends)
    recvs = [c.irecv(chunk(buf, j), j, tag) for j in range(p) if j != r]
    Request.wait_all([c.isend(mine, j, tag) for j in range(p) if j != r] + recvs)


@algorithm("all_reduce", "mpi")
def _mpi_all_reduce(comm, x, out, op):
    """MPI's own MPI_Allreduce: the reference every hand-coded algorithm is checked against."""
    send = MPI.IN_PLACE if out is x and not backend.is_gpu_array(x) else comm._send_buffer(x)
    recv, finish = comm._recv_buffer(out)
    if send is not MPI.IN_PLACE and send is recv:
        send = MPI.IN_PLACE
    comm.mpi.Allreduce(send, recv, op=_MPI_OP[op])
    if finish:
        finish()
    return out



def _inout(comm, a):
    """(buffer MPI reads and writes in place, function to call afterwards) for array a."""
    if backend.is_gpu_array(a) and not comm.is_cuda_aware():
        host = backend.to_numpy(a)
        return host, lambda: a.set(host)
    backend.synchronize()
    return a, None


def _mpi(comm, call, *buffers):
    """Run MPI's own collective ``call`` on (send, recv) arrays, staging GPU arrays if needed."""
    send, recv = buffers
    sbuf = comm._send_buffer(send) if send is not None else None
    rbuf, finish = comm._recv_buffer(recv) if recv is not None else (None, None)
    call(sbuf, rbuf)
    if finish:
        finish()
    return recv


def _contiguous(x):
    return backend.get_array_module(x).ascontiguousarray(x)


def _copy(x):
    """A fresh C-contiguous copy of x (the work buffer a collective may overwrite)."""
    return backend.get_array_module(x).array(x, order="C", copy=True)


# ----------------------------------------------------------------------------------------------
# broadcast
# ----------------------------------------------------------------------------------------------

def broadcast(comm, x, root=0, algorithm="binomial", out=None, check=None):
    """Every rank gets root's x. Other ranks pass an array of the same shape and dtype (its
    values are ignored) or ``out``; ``out=x`` receives in place."""
    run = _pick("broadcast", algorithm)
    comm._check_peer(root)
    check_same(comm, "broadcast", x, check)
    result = _result(x, out)
    if comm.rank == root and result is not x:
        result[...] = x
    if comm.size == 1 or x.size == 0:
        return result
    if algorithm == "mpi":
        buf, finish = _inout(comm, result)
        comm.mpi.Bcast(buf, root)
        if finish:
            finish()
        return result
    run(comm.coll, result.reshape(-1), root, dtype_tag(x.dtype))
    return result


@algorithm("broadcast", "binomial", lambda p, n, a, b, g: log2(p) * (a + n * b(n)))
def _broadcast_binomial(c, buf, root, tag):
    """Binomial tree: in step k every rank that has the data sends it 2^k ranks further."""
    p, rel = c.size, (c.rank - root) % c.size
    mask = 1
    while mask < p:  # receive from the parent: rel with its lowest set bit cleared
        if rel & mask:
            c.recv(buf, (rel - mask + root) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask:  # then send to the children rel + 2^j, largest subtree first
        if rel + mask < p:
            c.send(buf, (rel + mask + root) % p, tag)
        mask >>= 1


@algorithm("broadcast", "scatter_allgather",
           lambda p, n, a, b, g: (log2(p) + p - 1) * a + 2 * (p - 1) / p * n * b(n / p))
def _broadcast_scatter_allgather(c, buf, root, tag):
    """Van de Geijn: a binomial scatter cuts the vector into p chunks (chunk k to relative
    rank k), then a ring all-gather puts them back together on every rank. For long vectors."""
    p, rel = c.size, (c.rank - root) % c.size
    bounds = chunk_bounds(buf.size, p)
    span = lambda lo, hi: buf[bounds[lo]:bounds[min(hi, p)]]  # noqa: E731  (chunks lo..hi-1)
    mask = 1
    while mask < p:  # a subtree of size mask starts at rel: receive all its chunks
        if rel & mask:
            c.recv(span(rel, rel + mask), (rel - mask + root) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if rel + mask < p:
            c.send(span(rel + mask, rel + 2 * mask), (rel + mask + root) % p, tag)
        mask >>= 1
    _ring_all_gather(c, buf, bounds, tag, shift=-root)


# ----------------------------------------------------------------------------------------------
# reduce
# ----------------------------------------------------------------------------------------------

def reduce(comm, x, root=0, op="sum", algorithm="binomial", out=None, check=None):
    """Root gets op(x_0, ..., x_{p-1}) (returned; other ranks get None)."""
    run = _pick("reduce", algorithm, op)
    comm._check_peer(root)
    check_same(comm, "reduce", x, check)
    at_root = comm.rank == root
    work = _result(x, out) if at_root else _copy(x)
    if work is not x:
        work[...] = x
    if algorithm == "mpi":
        if comm.size > 1:
            send = _copy(x) if work is x else x
            _mpi(comm, lambda s, r: comm.mpi.Reduce(s, r, _MPI_OP[op], root), send,
                 work if at_root else None)
    elif comm.size > 1 and x.size:
        run(comm.coll, work.reshape(-1), root, op, dtype_tag(x.dtype))
    return _finish(work, op, comm.size) if at_root else None


@algorithm("reduce", "binomial", lambda p, n, a, b, g: log2(p) * (a + n * b(n) + n * g(n)))
def _reduce_binomial(c, buf, root, op, tag):
    """Binomial tree, the broadcast run backwards: receive from children, send to the parent."""
    p, rel = c.size, (c.rank - root) % c.size
    got = _scratch(c, "tmp", buf.size, buf)
    reduce_ = _reducer(op, buf)
    mask = 1
    while mask < p:
        if rel & mask:
            c.send(buf, (rel - mask + root) % p, tag)
            break
        if rel + mask < p:
            reduce_(buf, c.recv(got, (rel + mask + root) % p, tag), out=buf)
        mask <<= 1


# ----------------------------------------------------------------------------------------------
# reduce_scatter: x is the whole vector; rank r gets chunk r (chunk_bounds) of the reduced one
# ----------------------------------------------------------------------------------------------

def reduce_scatter(comm, x, op="sum", algorithm="ring", out=None, check=None):
    """Rank r gets chunk r of op(x_0, ..., x_{p-1}) flattened (1-D, ``chunk_bounds`` sizes)."""
    run = _pick("reduce_scatter", algorithm, op)
    check_same(comm, "reduce_scatter", x, check)
    bounds = chunk_bounds(x.size, comm.size)
    lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
    result = _result(x, out, shape=(hi - lo,))
    if algorithm == "mpi":
        counts = [bounds[j + 1] - bounds[j] for j in range(comm.size)]
        _mpi(comm, lambda s, r: comm.mpi.Reduce_scatter(s, r, counts, _MPI_OP[op]),
             _contiguous(x).reshape(-1), result)
        return _finish(result, op, comm.size)
    work = _copy(x).reshape(-1)
    if comm.size > 1 and x.size:
        run(comm.coll, work, bounds, op, dtype_tag(x.dtype))
    result[...] = work[lo:hi]
    return _finish(result, op, comm.size)


@algorithm("reduce_scatter", "ring",
           lambda p, n, a, b, g: (p - 1) * (a + n / p * (b(n / p) + g(n / p))))
def _reduce_scatter_ring(c, buf, bounds, op, tag):
    """The first half of the ring all-reduce, shifted so that rank r ends with chunk r."""
    _ring_reduce_scatter(c, buf, bounds, op, tag, shift=-1)


@algorithm("reduce_scatter", "recursive_halving",
           lambda p, n, a, b, g: (sum(a + m * (b(m) + g(m)) for m in _halves(p, n))
                                  + _fold_cost(p, n, a, b, g) / 2))
def _reduce_scatter_halving(c, buf, bounds, op, tag):
    """Recursive halving; when p is not a power of two the odd partner, which reduced both
    chunks, hands rank - 1 its chunk at the end."""
    _fold_in(c, buf, buf, op, tag)
    if _fold(c.size)[2](c.rank) >= 0:
        _halving_reduce_scatter(c, buf, _block_bounds(bounds, c.size), op, tag)
    if c.rank < 2 * _fold(c.size)[1]:
        r = c.rank - c.rank % 2  # the even rank's chunk
        part = buf[bounds[r]:bounds[r + 1]]
        c.recv(part, c.rank + 1, tag) if c.rank % 2 == 0 else c.send(part, c.rank - 1, tag)


@algorithm("reduce_scatter", "pairwise",
           lambda p, n, a, b, g: (p - 1) * (a + n / p * (b(n / p) + g(n / p))))
def _reduce_scatter_direct(c, buf, bounds, op, tag):
    """Direct: send chunk j straight to rank j, reduce the p-1 chunks that arrive."""
    r, p = c.rank, c.size
    chunk = lambda j: buf[bounds[j]:bounds[j + 1]]  # noqa: E731
    mine = chunk(r)
    sends = [c.isend(chunk((r + s) % p), (r + s) % p, tag) for s in range(1, p)]
    got = _scratch(c, "tmp", mine.size, buf)
    reduce_ = _reducer(op, buf)
    for s in range(1, p):
        reduce_(mine, c.recv(got, (r - s) % p, tag), out=mine)
    Request.wait_all(sends)


# ----------------------------------------------------------------------------------------------
# all_gather: rank r contributes x; everyone gets an array of shape (p, *x.shape)
# ----------------------------------------------------------------------------------------------

def all_gather(comm, x, algorithm="ring", out=None, check=None):
    """Every rank gets the stack [x_0, ..., x_{p-1}] (shape (p, *x.shape))."""
    run = _pick("all_gather", algorithm)
    check_same(comm, "all_gather", x, check)
    result = _result(x, out, shape=(comm.size,) + tuple(x.shape))
    if algorithm == "mpi":
        return _mpi(comm, comm.mpi.Allgather, _contiguous(x), result)
    result[comm.rank] = x
    if comm.size > 1 and x.size:
        bounds = [j * x.size for j in range(comm.size + 1)]
        run(comm.coll, result.reshape(-1), bounds, dtype_tag(x.dtype))
    return result


@algorithm("all_gather", "ring", lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _all_gather_ring(c, buf, bounds, tag):
    """p-1 steps: pass on to the right the chunk that arrived from the left."""
    _ring_all_gather(c, buf, bounds, tag, shift=0)


@algorithm("all_gather", "recursive_doubling",
           lambda p, n, a, b, g: (sum(a + m * b(m) for m in _halves(p, n))
                                  + _fold_cost(p, n, a, b, lambda m: 0)))
def _all_gather_doubling(c, buf, bounds, tag):
    """log p steps, the block each rank holds doubling every step (MPICH fold when p is not a
    power of two: the even rank lends its chunk to rank + 1 and gets the whole result back)."""
    _, rem, _, _ = _fold(c.size)
    r = c.rank
    if r < 2 * rem:
        even = r - r % 2
        part = buf[bounds[even]:bounds[even + 1]]
        c.send(part, r + 1, tag) if r % 2 == 0 else c.recv(part, r - 1, tag)
    if _fold(c.size)[2](r) >= 0:
        _doubling_all_gather(c, buf, _block_bounds(bounds, c.size), tag)
    _fold_out(c, buf, tag)


# ----------------------------------------------------------------------------------------------
# all_to_all, gather, scatter
# ----------------------------------------------------------------------------------------------

def all_to_all(comm, x, algorithm="pairwise", out=None, check=None):
    """x has shape (p, ...): row j goes to rank j; rank r gets [x_0[r], ..., x_{p-1}[r]]."""
    run = _pick("all_to_all", algorithm)
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise CommError(f"all_to_all needs x of shape ({comm.size}, ...), got {x.shape}")
    check_same(comm, "all_to_all", x, check)
    x = _contiguous(x)
    result = _result(x, out)
    if algorithm == "mpi":
        return _mpi(comm, comm.mpi.Alltoall, x, result)
    result[comm.rank] = x[comm.rank]
    run(comm.coll, x, result, dtype_tag(x.dtype))
    return result


@algorithm("all_to_all", "pairwise", lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _all_to_all_pairwise(c, x, result, tag):
    """p-1 steps: in step s send row r+s to rank r+s and receive row r from rank r-s."""
    r, p = c.rank, c.size
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        c.sendrecv(x[dst], dst, result[src], src, tag)


def gather(comm, x, root=0, algorithm="linear", out=None, check=None):
    """Root gets the stack [x_0, ..., x_{p-1}] (returned; other ranks get None)."""
    run = _pick("gather", algorithm)
    comm._check_peer(root)
    check_same(comm, "gather", x, check)
    x = _contiguous(x)
    at_root = comm.rank == root
    result = _result(x, out, shape=(comm.size,) + tuple(x.shape)) if at_root else None
    if algorithm == "mpi":
        _mpi(comm, lambda s, r: comm.mpi.Gather(s, r, root), x, result)
    else:
        if at_root:
            result[root] = x
        run(comm.coll, x, result, root, dtype_tag(x.dtype))
    return result


@algorithm("gather", "linear", lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _gather_linear(c, x, result, root, tag):
    """Root receives from every rank in turn (its link carries (p-1)/p of the result)."""
    if c.rank == root:
        for j in range(c.size):
            if j != root:
                c.recv(result[j], j, tag)
    else:
        c.send(x, root, tag)


def scatter(comm, x, root=0, algorithm="linear", out=None, check=None):
    """Rank r gets row r of root's x (shape (p, ...)). Other ranks pass x of the same shape
    (values ignored), or x=None with ``out`` of shape x.shape[1:]."""
    run = _pick("scatter", algorithm)
    comm._check_peer(root)
    at_root = comm.rank == root
    if x is None and (at_root or out is None):
        raise CommError("scatter: the root passes x; other ranks pass x or out")
    if x is not None and (x.ndim == 0 or x.shape[0] != comm.size):
        raise CommError(f"scatter needs x of shape ({comm.size}, ...), got {x.shape}")
    check_same(comm, "scatter", x[0] if x is not None else out, check)
    like = out if x is None else x[0]
    result = _result(like, out)
    x = _contiguous(x) if at_root else x
    if algorithm == "mpi":
        return _mpi(comm, lambda s, r: comm.mpi.Scatter(s, r, root), x if at_root else None,
                    result)
    if at_root:
        result[...] = x[root]
    run(comm.coll, x, result, root, dtype_tag(result.dtype))
    return result


@algorithm("scatter", "linear", lambda p, n, a, b, g: (p - 1) * (a + n / p * b(n / p)))
def _scatter_linear(c, x, result, root, tag):
    """Root sends row j to rank j, all at once."""
    if c.rank == root:
        Request.wait_all([c.isend(x[j], j, tag) for j in range(c.size) if j != root])
    else:
        c.recv(result, root, tag)


for _name in ("broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all", "gather",
              "scatter"):
    algorithm(_name, "mpi")(lambda *args: None)  # MPI's own: handled in each function above


# ----------------------------------------------------------------------------------------------
# Non-blocking all-reduce (gradient buckets overlap with the backward pass)
# ----------------------------------------------------------------------------------------------

class Work:
    """A running all-reduce: ``wait()`` returns its result (or raises its error)."""

    def __init__(self, wait_fn=None):
        self._wait_fn, self._done = wait_fn, threading.Event()
        self.result = self.error = None

    def is_completed(self):
        return self._done.is_set()

    def _set(self, result=None, error=None):
        self.result, self.error = result, error
        self._done.set()

    def wait(self):
        if self._wait_fn is not None:
            self._set(self._wait_fn())
            self._wait_fn = None
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class AsyncWorker:
    """One background thread per communicator running queued all-reduces in call order, on a
    duplicate communicator (MPI_THREAD_MULTIPLE), so they never mix with the caller's messages.
    Every rank must queue the same all-reduces in the same order, as for blocking ones."""

    def __init__(self, comm):
        self.comm = comm.dup()
        self.comm.counters = self.comm.coll.counters = comm.counters
        self.queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="minipar-iall_reduce").start()

    def _loop(self):
        while True:
            work, args = self.queue.get()
            try:
                work._set(all_reduce(self.comm, *args))
            except BaseException as error:  # handed to the waiting caller
                work._set(error=error)


def iall_reduce(comm, x, op="sum", algorithm="auto", out=None):
    """Start an all-reduce and return a ``Work`` at once; x must not change until ``wait()``.

    ``algorithm="mpi"`` uses MPI_Iallreduce (progressed by MPI); hand-coded ones run on the
    communicator's ``AsyncWorker`` thread."""
    _pick("all_reduce", "ring" if algorithm == "auto" else algorithm, op)
    if algorithm == "mpi":
        result = _result(x, out)
        if result is x:
            send, (recv, finish) = MPI.IN_PLACE, _inout(comm, result)
        else:
            send, (recv, finish) = comm._send_buffer(x), comm._recv_buffer(result)
        request = comm.mpi.Iallreduce(send, recv, _MPI_OP[op])

        def complete():
            request.Wait()
            if finish:
                finish()
            return _finish(result, op, comm.size)
        return Work(complete)
    if comm._async is None:
        comm._async = AsyncWorker(comm)
    work = Work()
    comm._async.queue.put((work, (x, op, algorithm, out)))
    return work


for _name in ("all_reduce", "iall_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather",
              "all_to_all", "gather", "scatter"):  # comm.all_reduce(x) is all_reduce(comm, x)
    setattr(Communicator, _name, globals()[_name])
