"""Cutting a sequential model into pipeline stages: by hand, or balanced by measured cost.

A split is a list of ``(start, end)`` layer ranges, one per stage, contiguous and non-empty.

    split_after(names, ["block2", "block5"])   cut after the named layers (as PiPPy's split points)
    balanced_split(costs, p)                   minimise the slowest stage (min-max partition)
    balanced_split(costs, p, transfer)         ... counting the send of each stage's output

A pipeline runs at the pace of its slowest stage, so the balanced split minimises
max_s (sum of layer costs in s + transfer cost at its end). Dynamic programme over prefixes:

    best[k][j] = min over i < j of max(best[k-1][i], cost(i, j)),   O(p * n^2)

where best[k][j] is the slowest stage when the first j layers form k stages.
"""
import time


def _check(n_layers, n_stages):
    if n_stages < 1:
        raise ValueError(f"need at least one stage (got {n_stages})")
    if n_layers < n_stages:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} stages: "
                         "every stage needs at least one layer")


def split_after(names, cut_after, n_stages=None):
    """Cut the layers ``names`` after each layer named in ``cut_after``: k names give k+1 stages."""
    names = list(names)
    unknown = [c for c in cut_after if c not in names]
    if unknown:
        raise ValueError(f"no layer named {', '.join(map(repr, unknown))} (layers: {', '.join(names)})")
    cuts = sorted({names.index(c) + 1 for c in cut_after})
    if len(cuts) != len(cut_after):
        raise ValueError(f"split points repeat: {list(cut_after)}")
    if cuts and cuts[-1] == len(names):
        raise ValueError(f"cannot cut after the last layer {names[-1]!r}: the last stage would be empty")
    if n_stages is not None and len(cuts) + 1 != n_stages:
        raise ValueError(f"{len(cuts)} split points give {len(cuts) + 1} stages, not {n_stages}")
    _check(len(names), len(cuts) + 1)
    edges = [0] + cuts + [len(names)]
    return list(zip(edges[:-1], edges[1:]))


def stage_costs(costs, bounds, transfer=None):
    """Cost of each stage: its layers, plus sending its output (``transfer[end-1]``) if not last."""
    n = len(costs)
    return [sum(costs[a:b]) + (transfer[b - 1] if transfer is not None and b < n else 0)
            for a, b in bounds]


def balanced_split(costs, n_stages, transfer=None):
    """The contiguous split of layers with per-layer ``costs`` into ``n_stages`` stages whose
    slowest stage is cheapest; ``transfer[i]`` (optional) is the cost of sending layer i's output."""
    n = len(costs)
    _check(n, n_stages)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j):  # layers i..j-1 as one stage
        return prefix[j] - prefix[i] + (transfer[j - 1] if transfer is not None and j < n else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):  # leave at least one layer per later stage
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


def split_layers(layers, bounds):
    """The layers of each stage: ``[layers[a:b] for a, b in bounds]``."""
    layers = list(layers)
    return [layers[a:b] for a, b in bounds]


def measure_costs(layers, x, repeats=3, clock=time.perf_counter):
    """Per-layer forward time: run ``x`` through the callables ``layers`` ``repeats`` times and
    keep each layer's fastest run (the least disturbed by other processes)."""
    best = [float("inf")] * len(layers)
    for _ in range(repeats):
        h = x
        for i, layer in enumerate(layers):
            t = clock()
            h = layer(h)
            best[i] = min(best[i], clock() - t)
    return best
