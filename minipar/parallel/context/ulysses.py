"""Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509): the sequence
split over a context group, attention over its heads.

Each of the P ranks holds N/P tokens of all H heads (layout.py, as ring_attention takes them).
One all-to-all on each of q, k and v gives every rank the whole sequence of H/P heads, attention
runs locally (minipar/attention.py), and the inverse all-to-all brings the output back to this
rank's tokens of all heads; the backward runs the same all-to-alls the other way. Bytes each
rank sends, b the itemsize, each all-to-all keeping 1/P of its rows at home:

    forward = backward = 4 · (P − 1)/P · B · (N/P) · H · d · b   (q, k, v, then the output)

    q, k, v = (split_sequence(a, group, dim=2) for a in (q_all, k_all, v_all))
    out = ulysses_attention(q, k, v, group)         # this rank's (B, H, N/P, d)
    out_all = gather_sequence(out, group, dim=2)
"""
import math

from ... import backend
from ...attention import causal_self_attention
from ...autograd import as_tensor, make_result
from ...comm.agreement import same_everywhere, settings_differ
from ...functional import softmax
from .layout import rank_chunks


def _placement(P, layout):
    """The chunk number (of 2·P, in sequence order) at each slot of the gathered sequence: an
    all-to-all stacks rank 0's two chunks, then rank 1's, ... (each rank's in its layout)."""
    return [chunk for s in range(P) for chunk in rank_chunks(s, P, layout)]


def _seq_to_heads(x, group, layout):
    """(B, H, N/P, d), this rank's tokens of all heads -> (B, H/P, N, d), the whole sequence
    of this rank's heads, in sequence order."""
    xp = backend.get_array_module(x)
    P, (B, H, n, d) = group.size, x.shape
    # one all-to-all (group.all_to_all: row j of its argument to rank j); then the 2·P chunks of
    # the sequence put in sequence order, ``_placement`` saying where each arrived
    ### BEGIN SOLUTION ulysses-all-to-all
    # row j of the message: heads j·H/P .. (j+1)·H/P − 1 of my tokens, for rank j
    rows = xp.ascontiguousarray(x.reshape(B, P, H // P, n, d).transpose(1, 0, 2, 3, 4))
    got = group.all_to_all(rows)  # got[s]: rank s's tokens of my heads, (B, H/P, n, d)
    chunks = got.transpose(1, 2, 0, 3, 4).reshape(B, H // P, 2 * P, n // 2, d)
    # the zig-zag layout's chunks arrive out of order: put chunk i at position i, so that the
    # causal mask of the whole sequence lines up with the global positions
    placement = _placement(P, layout)
    order = [placement.index(i) for i in range(2 * P)]  # the slot chunk i arrived in
    return chunks[:, :, order].reshape(B, H // P, P * n, d)
    ### END SOLUTION


def _heads_to_seq(y, group, layout):
    """The inverse of ``_seq_to_heads``: (B, H/P, N, d) -> (B, H, N/P, d)."""
    xp = backend.get_array_module(y)
    P, (B, h, N, d) = group.size, y.shape
    n = N // P
    ### BEGIN SOLUTION ulysses-all-to-all
    # the chunks back in the slots an all-to-all reads: rank s's two chunks, rank by rank
    chunks = y.reshape(B, h, 2 * P, n // 2, d)[:, :, _placement(P, layout)]
    rows = xp.ascontiguousarray(chunks.reshape(B, h, P, n, d).transpose(2, 0, 1, 3, 4))
    got = group.all_to_all(rows)  # got[s]: my tokens of rank s's heads, (B, H/P, n, d)
    return got.transpose(1, 0, 2, 3, 4).reshape(B, P * h, n, d)
    ### END SOLUTION


def seq_to_heads(x, group, layout="balanced"):
    """Differentiable ``_seq_to_heads``: its backward is the inverse all-to-all."""
    return make_result(_seq_to_heads(x.data, group, layout), (x,),
                       lambda g: (_heads_to_seq(g, group, layout),), "seq_to_heads")


def heads_to_seq(y, group, layout="balanced"):
    """Differentiable ``_heads_to_seq``: its backward is the forward all-to-all."""
    return make_result(_heads_to_seq(y.data, group, layout), (y,),
                       lambda g: (_seq_to_heads(g, group, layout),), "heads_to_seq")


def _full_attention(q, k, v):
    """softmax(q kᵀ/√d) v with no mask, from the engine's differentiable ops."""
    return softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))) @ v


def head_splits(n):
    """The group sizes that split ``n`` heads into whole heads per rank."""
    return [p for p in range(1, n + 1) if n % p == 0]


def _check(q, k, v, group, causal, layout):
    """The same shapes everywhere, then whole heads per rank, or the same error on every rank."""
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ValueError(f"ulysses_attention: q, k, v must share one (batch, heads, N/P, d) "
                         f"shape, got {q.shape}, {k.shape}, {v.shape}")
    rank_chunks(0, 1, layout)  # a clear error for an unknown layout
    (b, H, n, d), P = q.shape, group.size
    if P > 1:
        # a rank with other shapes would post all-to-all rows the others' receives do not fit
        mine = {"N/P": n, "batch, heads, d": (b, H, d), "dtype": str(q.dtype),
                "causal": causal, "layout": layout}
        same_everywhere(group, f"ulysses_attention over a context group of P = {P} ranks",
                        mine, lambda everyone: settings_differ(everyone) + ": every rank "
                        "holds two chunks of the same sequences (split_sequence(x, group))")
    if n % 2:
        raise ValueError(f"ulysses_attention: this rank's sequence length {n} is odd: a rank "
                         f"holds two equal chunks of the 2·P = {2 * P} (split_sequence)")
    if H % P:
        # every rank holds the same H (agreed above), so every rank raises this
        usable = head_splits(H)
        below = max(p for p in usable if p < P)
        above = [p for p in usable if p > P][:1]
        nearest = " or ".join(str(p) for p in [below] + above)
        raise ValueError(f"ulysses_attention: H = {H} heads do not split over P = {P} ranks "
                         f"(each rank takes H/P whole heads): use a group size that divides "
                         f"H, the nearest {nearest} (divisors of {H}: {usable})")


def ulysses_attention(q, k, v, group, causal=True, layout="balanced"):
    """softmax(q kᵀ/√d + M) v over the whole sequence, from this rank's q, k, v of shape
    (B, H, N/P, d) in ``layout`` (its two chunks side by side, layout.py); returns this
    rank's output rows (B, H, N/P, d), as ``ring_attention`` does. ``causal=False``: no mask.
    H must be a multiple of P = group.size (ValueError naming the sizes that fit)."""
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    _check(q, k, v, group, causal, layout)
    heads = [seq_to_heads(t, group, layout) for t in (q, k, v)]  # (B, H/P, N, d) each
    out = causal_self_attention(*heads) if causal else _full_attention(*heads)
    return heads_to_seq(out, group, layout)
