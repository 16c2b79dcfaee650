"""The step patterns the collectives are built from: ring passes and recursive halving and
doubling, with MPICH's fold for rank counts that are not a power of two.

    ring_reduce_scatter   p-1 steps right round the ring, each reducing one chunk
    ring_all_gather       p-1 steps passing on the chunk that just arrived
    halving_reduce_scatter  log p steps, each exchanging half of the current window
    doubling_all_gather   log p steps, the block each rank holds doubling every step

Not a power of two (Thakur, Rabenseifner & Gropp 2005, as MPICH does it): the first 2*rem ranks
pair up (the even one hands its data to the odd one and sits out), the remaining pof2 ranks run
the power-of-two pattern on "newranks", and the result is handed back (``fold_in``,
``fold_out``). That costs 2(alpha + n beta(n)) + n gamma(n) more (``fold_cost``).
"""
import functools
import math

from minipar.comm.buffers import reducer


def log2(p):
    """Depth of a binomial tree over p ranks: ceil(log2 p)."""
    return math.ceil(math.log2(p)) if p > 1 else 0


def halves(p, n):
    """Bytes per step of recursive halving over the largest power of two <= p ranks:
    n/2, n/4, ..., n/pof2 (log2 pof2 steps; they add up to (pof2-1)/pof2 n)."""
    return [n / 2 ** k for k in range(1, p.bit_length())]


def fold_cost(p, n, a, b, g):
    """The two extra full-vector messages (and one reduction) when p is not a power of two."""
    return 0 if p & (p - 1) == 0 else 2 * (a + n * b(n)) + n * g(n)


@functools.lru_cache(maxsize=None)
def fold(p):
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


def block_bounds(bounds, p):
    """Element offsets of the pof2 blocks after the fold: block j holds real ranks' chunks.

    Newrank j < rem stands for ranks 2j and 2j+1, so its block is their two chunks."""
    pof2, rem, _, _ = fold(p)
    return [bounds[2 * j if j < rem else j + rem] for j in range(pof2)] + [bounds[p]]


def fold_in(c, x, buf, op):
    """Non-power-of-two pre-step: even ranks below 2*rem give their vector to rank + 1.
    Returns where this rank's vector now is: buf (it received and reduced) or still x."""
    _, rem, _, _ = fold(c.size)
    if c.rank < 2 * rem:
        if c.rank % 2 == 0:
            c.Send(x, c.rank + 1)
        else:
            got = c.scratch("tmp", buf.size, buf)
            c.Recv(got, c.rank - 1)
            reducer(op, buf)(x, got, out=buf)
            return buf
    return x


def fold_out(c, buf):
    """Non-power-of-two post-step: odd ranks below 2*rem hand the result back to rank - 1."""
    _, rem, _, _ = fold(c.size)
    if c.rank < 2 * rem:
        if c.rank % 2 == 0:
            c.Recv(buf, c.rank + 1)
        else:
            c.Send(buf, c.rank - 1)


def halving_reduce_scatter(c, buf, nb, op, src=None):
    """Recursive halving over pof2 newranks: after log p steps newrank j holds block j reduced.

    Step k exchanges half of the current window with newrank ^ (pof2 >> k). The first step
    reads the input from ``src`` (default: buf itself) and writes the kept half into buf.
    16-bit partial sums travel, so each step rounds once (log2 p roundings, + 1 for a fold)."""
    pof2, _, newrank, real = fold(c.size)
    me, lo, hi, mask = newrank(c.rank), 0, pof2, pof2 >> 1
    reduce = reducer(op, buf)
    tmp = c.scratch("halving", max(nb[(pof2 >> 1)] - nb[0], nb[pof2] - nb[pof2 >> 1]), buf)
    src = buf if src is None else src
    ### BEGIN SOLUTION recursive-halving
    while mask:
        mid = (lo + hi) // 2
        (k0, k1), (g0, g1) = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        got = tmp[:nb[k1] - nb[k0]]
        c.Sendrecv(src[nb[g0]:nb[g1]], real(me ^ mask), got, real(me ^ mask))
        reduce(src[nb[k0]:nb[k1]], got, out=buf[nb[k0]:nb[k1]])
        lo, hi, mask, src = k0, k1, mask >> 1, buf
    ### END SOLUTION


def doubling_all_gather(c, buf, nb):
    """Recursive doubling over pof2 newranks: the window each holds doubles every step."""
    pof2, _, newrank, real = fold(c.size)
    me, mask = newrank(c.rank), 1
    while mask < pof2:
        lo = me - me % mask
        peer_lo = lo ^ mask
        c.Sendrecv(buf[nb[lo]:nb[lo + mask]], real(me ^ mask),
                   buf[nb[peer_lo]:nb[peer_lo + mask]], real(me ^ mask))
        mask <<= 1


def ring_reduce_scatter(c, buf, bounds, op, shift, src=None):
    """p-1 steps round the ring; rank r ends holding chunk (r + shift + 1) % p reduced.

    Each chunk is reduced once, from the input ``src`` (default: buf itself) into buf, so an
    out-of-place all-reduce never copies its input first (NCCL: read sendbuff, write recvbuff).
    16-bit chunks are added in float32 (``reducer``), but every partial sum goes on the wire,
    so it is rounded at every hop: p - 1 roundings, not one (the bound: docs/comm.md)."""
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    reduce = reducer(op, buf)
    tmp = c.scratch("ring", bounds[1] - bounds[0], buf)
    src = buf if src is None else src
    for s in range(p - 1):
        ### BEGIN SOLUTION ring-all-reduce
        send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
        lo, hi = bounds[recv], bounds[recv + 1]
        got = tmp[:hi - lo]
        c.Sendrecv((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right, got, left)
        reduce(src[lo:hi], got, out=buf[lo:hi])
        ### END SOLUTION


def ring_all_gather(c, buf, bounds, shift):
    """p-1 steps round the ring; rank r starts holding chunk (r + shift) % p, ends with all."""
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
        c.Sendrecv(buf[bounds[send]:bounds[send + 1]], right,
                   buf[bounds[recv]:bounds[recv + 1]], left)
