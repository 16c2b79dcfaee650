"""Ring attention (Liu et al. 2023): attention over a sequence split across the cp ranks of a group.

Each rank keeps its queries; the k/v blocks travel round the ring (to rank r+1, from r−1) for
cp−1 steps, and each block is folded into the output by the online softmax (Milakov &
Gimelshein 2018; FlashAttention's running max and sum), keeping only the log-sum-exp for the
backward. The backward recomputes each block's probabilities and sends the dk/dv accumulators
round the same ring. In the balanced layout (layout.py, Megatron-core's zig-zag; Brandon et al.
2023 measure the imbalance it removes) a block above the diagonal is skipped, a diagonal block
is masked. Theory and measurements: docs/context_parallel.md.

    q, k, v = (split_sequence(a, group, dim=2) for a in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, group)            # this rank's (B, H, T/cp, D)
    out_all = gather_sequence(out, group, dim=2)
"""
import math
import time

from ... import backend
from ...attention import causal_mask
from ...autograd import as_tensor, make_result
from ...comm.agreement import same_everywhere, settings_differ
from . import work
from .layout import rank_chunks

# the ring's messages carry their own tags, so they never match other point-to-point traffic
TAG_KV, TAG_DKV = 2401, 2402


class _Pass:
    """One move round the ring in flight: ``a`` sent to the next rank, its like received from
    the previous one. Posted before the block in hand is computed, waited for after."""

    def __init__(self, group, a, tag):
        xp = backend.get_array_module(a)
        after, before = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        self.send = group.isend(a, after, tag)  # a must not change until wait()
        self.recv = group.irecv(xp.empty_like(a), before, tag)

    def wait(self, direction, step):
        t0 = time.perf_counter()
        arrived = self.recv.wait()
        self.send.wait()
        work.note_wait(direction, step, time.perf_counter() - t0)  # the exposed communication
        return arrived


def _kind(i, j, causal):
    """Query chunk i against key chunk j: all visible, the diagonal (masked), or all future."""
    if not causal or j < i:
        return "full"
    return "diagonal" if i == j else "skipped"


def _blocks(rank, source, cp, layout, causal, c):
    """(query rows, key rows, q chunk, k chunk, kind) of one step: this rank's two query chunks
    against the two key chunks of ``source``'s block, rows as slices of the local sequence."""
    halves = (slice(0, c), slice(c, 2 * c))
    for rows_q, i in zip(halves, rank_chunks(rank, cp, layout)):
        for rows_k, j in zip(halves, rank_chunks(source, cp, layout)):
            yield rows_q, rows_k, i, j, _kind(i, j, causal)


def _scores(q, k, kind, scale):
    s = (q @ k.swapaxes(-1, -2)) * scale
    if kind == "diagonal":
        s += causal_mask(backend.get_array_module(s), s.shape[-1], s.dtype)
    return s


def _fold(s, v, m, l, acc):
    """The online softmax: fold one block of scores ``s`` and its values ``v`` into the running
    max ``m``, sum ``l`` and output ``acc`` (unnormalised), in place. A row whose keys so far
    are all masked (−inf) keeps m = −inf, l = 0 and acc = 0."""
    xp = backend.get_array_module(s)
    ### BEGIN SOLUTION online-softmax-merge
    m_new = xp.maximum(m, s.max(axis=-1))
    # a row that has seen only masked keys (−inf) subtracts 0: exp(−inf − 0) = 0, not NaN
    shift = xp.where(m_new == -xp.inf, 0.0, m_new)
    alpha = xp.exp(m - shift)  # what was summed under the old max, rescaled to the new one
    p = xp.exp(s - shift[..., None])
    l *= alpha
    l += p.sum(axis=-1)
    acc *= alpha[..., None]
    acc += p @ v
    m[...] = m_new
    ### END SOLUTION


def _forward(q, k, v, group, causal, layout, overlap):
    """(this rank's output, its log-sum-exp per query) after cp steps round the ring."""
    xp = backend.get_array_module(q)
    cp, rank, c = group.size, group.rank, q.shape[2] // 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = xp.full(q.shape[:3], -xp.inf, q.dtype)
    l = xp.zeros(q.shape[:3], q.dtype)
    acc = xp.zeros_like(q)
    kv = xp.stack([k, v])  # one message a step: k and v together
    for step in range(cp):
        source = (rank - step) % cp  # whose block is in hand: blocks move one rank a step
        moving = _Pass(group, kv, TAG_KV) if step < cp - 1 else None
        if moving is not None and not overlap:
            moving.wait("forward", step)  # the block arrives before this one is computed
        for rows_q, rows_k, i, j, kind in _blocks(rank, source, cp, layout, causal, c):
            work.note_block("forward", step, i, j, kind, (*q.shape[:2], c, c))
            if kind == "skipped":
                continue
            s = _scores(q[..., rows_q, :], kv[0][..., rows_k, :], kind, scale)
            _fold(s, kv[1][..., rows_k, :], m[..., rows_q], l[..., rows_q], acc[..., rows_q, :])
        if moving is not None:
            kv = moving.wait("forward", step)
    return acc / l[..., None], m + xp.log(l)


def _backward(g, q, k, v, out, lse, group, causal, layout, overlap):
    """(dq, dk, dv) of this rank. k and v go round the ring again rather than being kept from
    the forward: keeping them would hold the whole sequence's k and v on every rank."""
    xp = backend.get_array_module(g)
    cp, rank, c = group.size, group.rank, q.shape[2] // 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = (g * out).sum(axis=-1)  # Σ_j P_ij dP_ij = Σ_d dO·O per query (FlashAttention-2)
    dq = xp.zeros_like(q)
    kv = xp.stack([k, v])
    incoming = None  # the dk/dv accumulators of the block in hand, from the ranks before
    for step in range(cp):
        source = (rank - step) % cp
        moving = _Pass(group, kv, TAG_KV) if step < cp - 1 else None
        if moving is not None and not overlap:
            moving.wait("backward", step)
        dkv = xp.zeros_like(kv)  # this rank's share of the block's dk and dv
        for rows_q, rows_k, i, j, kind in _blocks(rank, source, cp, layout, causal, c):
            work.note_block("backward", step, i, j, kind, (*q.shape[:2], c, c))
            if kind == "skipped":
                continue
            qi, gi = q[..., rows_q, :], g[..., rows_q, :]
            kj, vj = kv[0][..., rows_k, :], kv[1][..., rows_k, :]
            # P recomputed from the kept log-sum-exp: no (T/cp)² probabilities were held
            p = xp.exp(_scores(qi, kj, kind, scale) - lse[..., rows_q, None])
            dkv[1][..., rows_k, :] += p.swapaxes(-1, -2) @ gi
            ds = p * (gi @ vj.swapaxes(-1, -2) - delta[..., rows_q, None]) * scale
            dq[..., rows_q, :] += ds @ kj
            dkv[0][..., rows_k, :] += ds.swapaxes(-1, -2) @ qi
        if incoming is not None:
            dkv += incoming.wait("backward", step)
        if cp > 1:  # on to the next rank; the last of cp moves takes them home to their owner
            incoming = _Pass(group, dkv, TAG_DKV)
        if moving is not None:
            kv = moving.wait("backward", step)
    if cp > 1:
        dkv = incoming.wait("backward", cp)
    return dq, dkv[0], dkv[1]


def _agree(q, group, causal, layout):
    """The ranks of the ring agree on what its messages and its masks are made of, or every
    rank raises the same CommError: a rank that split the sequence by a cp of its own holds
    another T/cp, and its k/v blocks would not fit the others' receives."""
    b, h, t, d = q.shape
    mine = {"T/cp": t, "batch, heads, d": (b, h, d), "dtype": str(q.dtype), "causal": causal,
            "layout": layout}
    same_everywhere(group, f"ring_attention over a context group of cp = {group.size} ranks",
                    mine, lambda everyone: settings_differ(everyone) + ": every rank holds "
                    "two chunks of the same sequences, 2·T/(2·cp) tokens; split them with "
                    "one cp, the group's (split_sequence(x, group))")


def ring_attention(q, k, v, group, causal=True, layout="balanced", overlap=True):
    """softmax(q kᵀ/√d + M) v over the whole sequence, from this rank's q, k, v of shape
    (B, H, T/cp, d) in ``layout`` (its two chunks side by side, layout.py); returns this
    rank's output rows. ``causal=False``: no mask. ``overlap=False`` waits for each k/v block
    before computing the one in hand (to measure what posting early hides)."""
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ValueError(f"ring_attention: q, k, v must share one (batch, heads, T/cp, d) "
                         f"shape, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % 2:
        raise ValueError(f"ring_attention: this rank's sequence length {q.shape[2]} is odd: a "
                         f"rank holds two equal chunks of the 2·cp = {2 * group.size} (the "
                         f"whole length must be a multiple of 2·cp: split_sequence)")
    rank_chunks(0, 1, layout)  # a clear error for an unknown layout
    if group.size > 1:
        _agree(q, group, causal, layout)
    # C order: the k/v blocks and their gradients are sent as they are (q, k, v of a model
    # are often permuted views of one qkv projection); an array already in C order is kept
    xp = backend.get_array_module(q.data)
    qd, kd, vd = (t.data if t.data.flags.c_contiguous else xp.ascontiguousarray(t.data)
                  for t in (q, k, v))
    out, lse = _forward(qd, kd, vd, group, causal, layout, overlap)

    def backward(g):
        return _backward(g, qd, kd, vd, out, lse, group, causal, layout, overlap)

    return make_result(out, (q, k, v), backward, "ring_attention")
