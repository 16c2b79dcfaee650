"""Pipeline schedules as data: the builders of the lecture's schedules, and ``build`` by name.

    schedule = build("1f1b", p=4, m=8)      # schedule.actions[rank]: that rank's list of actions

Each builder returns, per rank, the order of its (kind, stage, mb) computations; ``assemble``
(actions.py, which defines Action, Schedule, an example and the contract with a runtime) adds the
messages. Stage s lives on rank s % p as its chunk s // p; the zero-bubble schedules with two
chunks per rank, ZB-V (a V placement) and interleaved zero bubble, are in zero_bubble.py, and
DualPipeV (the V again, a forward paired with a backward) in dualpipe.py.
"""
from .actions import B, F, R, W, assemble, check_sizes
from .dualpipe import dualpipe_v
from .pipedream import PipeDream
from .zero_bubble import zb_interleaved, zb_v


class ArgumentError(ValueError):
    """An argument ``build`` refuses: ``rule`` says which rule it breaks (a caller such as
    ``minipar schedule`` words it for its own options), ``str()`` adds the values given."""

    def __init__(self, name, rule, given=""):
        super().__init__(f"{rule} ({given})" if given else rule)
        self.name, self.rule = name, rule


# --- the builders: each returns, per rank, the order of (kind, stage, mb) computations -----------

def naive(p, m=1):
    """Naive model parallelism: each micro-batch runs through all stages and back before the next
    starts, so one rank works at a time. Utilisation 1/p, bubble (p-1)/p."""
    check_sizes(p, m)
    order = [[(kind, r, k) for k in range(m) for kind in (F, B)] for r in range(p)]
    return assemble("naive", p, m, 1, order)


def gpipe(p, m, remat=False):
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards; bubble (p-1)/(m+p-1),
    and every stage holds m micro-batches of activations at the peak. With ``remat`` a forward
    keeps only its input and each backward first re-computes it (R): peak one micro-batch."""
    check_sizes(p, m)
    backward = (R, B) if remat else (B,)
    order = [[(F, r, k) for k in range(m)] + [(kind, r, k) for k in range(m) for kind in backward]
             for r in range(p)]
    return assemble("gpipe", p, m, 1, order, remat=remat)


def _one_f_one_b(p, m, r):
    """Rank r's 1F1B order of (F or B, mb): p-1-r warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards. At most p-r micro-batches are ever live."""
    ### BEGIN SOLUTION one-f-one-b
    warm = min(p - 1 - r, m)
    steady = [pair for k in range(m - warm) for pair in ((F, warm + k), (B, k))]
    return [(F, k) for k in range(warm)] + steady + [(B, k) for k in range(m - warm, m)]
    ### END SOLUTION


def one_f_one_b(p, m):
    """1F1B, PipeDream-Flush (Narayanan et al. 2021): the same bubble as GPipe, (p-1)/(m+p-1), but
    a backward starts as soon as it can, so rank r holds at most p-r micro-batches, not m."""
    check_sizes(p, m)
    order = [[(kind, r, k) for kind, k in _one_f_one_b(p, m, r)] for r in range(p)]
    return assemble("1f1b", p, m, 1, order)


def interleaved(p, m, v=2):
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each rank holds v chunks (stages
    r, r+p, ...), each 1/v of the work, so the fill and drain shrink v times: bubble
    (p-1)/(v*m + p-1). Micro-batches go in groups of p through chunk 0, then chunk 1, ...; so
    Megatron needs m to be a multiple of p."""
    check_sizes(p, m, v)
    check_groups(p, m)
    total = m * v

    def step(kind, i, r):  # rank r's i-th forward (or backward): groups of p micro-batches per chunk
        chunk = (i // p) % v
        chunk = v - 1 - chunk if kind == B else chunk  # backwards walk the chunks in reverse
        return kind, chunk * p + r, (i // (p * v)) * p + i % p

    order = []
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)
        seq = [(F, i) for i in range(warm)]
        seq += [pair for i in range(total - warm) for pair in ((F, warm + i), (B, i))]
        seq += [(B, i) for i in range(total - warm, total)]
        order.append([step(kind, i, r) for kind, i in seq])
    return assemble("interleaved", p, m, v, order)


def zb_h1(p, m):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): split the backward into B (the
    input gradient, on the critical path) and W (the weight gradient, which nothing waits for).
    1F1B's order of F and B, with rank r running its W's r micro-batches late, so they fill the
    drain: bubble (p-1)(T_F+T_B-T_W), i.e. (p-1)/(3m+p-1) with F = B = W, a third of 1F1B's, at
    1F1B's activation memory (p-r live micro-batches on rank r)."""
    check_sizes(p, m)
    order = []
    for r in range(p):
        seq, done_b = [], 0
        for kind, k in _one_f_one_b(p, m, r):
            seq.append((kind, r, k))
            if kind == B:
                done_b += 1
                if done_b > r:
                    seq.append((W, r, done_b - 1 - r))
        seq += [(W, r, k) for k in range(max(0, m - r), m)]
        order.append(seq)
    return assemble("zb-h1", p, m, 1, order, split_backward=True)


def pipedream(p, m):
    """PipeDream's asynchronous 1F1B (Narayanan et al. 2019): no flush; each stage updates its
    weights after every backward. Weight stashing: a micro-batch's backward uses the weights its
    forward used, so on rank r micro-batch k runs on version max(0, k-(p-1-r)) -- p-1-r updates
    behind rank p-1. Over m micro-batches the fill and drain cost (p-1)/(m+p-1); in the steady
    state there is no bubble."""
    check_sizes(p, m)
    order = [[(kind, r, k) for kind, k in _one_f_one_b(p, m, r)] for r in range(p)]
    return assemble("pipedream", p, m, 1, order, asynchronous=True, runtime=PipeDream)


BUILDERS = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
            "zb-h1": zb_h1, "zb-v": zb_v, "zb-interleaved": zb_interleaved, "pipedream": pipedream,
            "dualpipev": dualpipe_v}
CHUNKED = ("interleaved", "zb-interleaved")  # take v chunks per rank, default 2; zb-v has 2
V_SHAPED = ("zb-v", "dualpipev")  # exactly two chunks per rank, in a V


def chunks_of(name, v=None):
    """The chunks per rank ``build(name, p, m, v)`` gives: v (default 2) for the interleaved
    schedules, always 2 for the V of zb-v and dualpipev, else 1."""
    if name in CHUNKED:
        return 2 if v is None else v
    return 2 if name in V_SHAPED else 1


def check_groups(p, m):
    """Interleaved 1F1B sends micro-batches through the chunks in groups of p."""
    if m % p:
        raise ArgumentError("groups", f"interleaved 1F1B sends micro-batches in groups of p: "
                            f"m={m} must be a multiple of p={p}",
                            f"try m={p * max(1, round(m / p))}")


def check_arguments(name, p, m, v=None, remat=False):
    """The rules of ``build``'s arguments, checked before any list is built (``ArgumentError``,
    or ``ValueError`` for an unknown name or a size below 1)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(BUILDERS)}")
    if name in V_SHAPED and v not in (None, 2):
        raise ArgumentError(f"{name} chunks", f"{name} holds exactly two chunks per rank, a V",
                            f"got v={v}")
    if name == "dualpipev" and m < 2 * p:
        raise ArgumentError("dualpipev micro-batches", "dualpipev needs at least as many "
                            "micro-batches as stages, m >= 2p (as torch's ScheduleDualPipeV)",
                            f"m={m}, p={p}: try m={2 * p}")
    if v not in (None, 1) and name not in CHUNKED + V_SHAPED:
        raise ArgumentError("chunks", f"only the interleaved schedules ({', '.join(CHUNKED)}) "
                            f"take chunks", f"got v={v} for {name}")
    if remat and name != "gpipe":
        raise ArgumentError("remat", "re-materialisation is an option of the gpipe schedule")
    if name == "interleaved":  # its builder's own rule, in its order: sizes, then groups of p
        check_sizes(p, m, chunks_of(name, v))
        check_groups(p, m)


def build(name, p, m, v=None, remat=False):
    """The schedule ``name`` (a key of BUILDERS) for p ranks and m micro-batches."""
    check_arguments(name, p, m, v, remat)
    if name in CHUNKED:
        return BUILDERS[name](p, m, chunks_of(name, v))
    return gpipe(p, m, remat) if name == "gpipe" else BUILDERS[name](p, m)
