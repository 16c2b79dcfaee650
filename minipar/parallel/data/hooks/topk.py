"""Top-k sparsification with error feedback, the core of Deep Gradient Compression (Lin et al.
2018): each rank sends only its k largest gradient entries (values and indices, by all-gather)
and keeps the rest as a residual that joins the next step's gradient, so nothing is lost, only
delayed.

    state = TopKState(ratio=0.01)              # k = round(0.01 n) per bucket of n entries
    model.register_comm_hook(state, topk_hook)

Bytes per rank per step (ring all-gather): (p-1) k (s + 4), s the gradient's item size and
4 the int32 index (int64, 8 bytes, from n = 2**31 on); plain all-reduce: 2 (p-1)/p n s.
"""
from .... import backend
from .default import communicator
from .state import HookState


class TopKState(HookState):
    """What ``topk_hook`` keeps between steps: the communicator (``process_group``; None: the
    DDP's), k per bucket (``k`` entries, or ``ratio`` of the bucket's n), and each bucket's
    residual in ``error_dict`` by bucket index (torch's PowerSGDState name)."""

    def __init__(self, process_group=None, ratio=0.01, k=None, use_error_feedback=True):
        if k is None and not 0 < ratio <= 1:
            raise ValueError(f"TopKState: ratio must be in (0, 1], got {ratio!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"TopKState: k must be a positive int, got {k!r}")
        self.process_group = process_group
        self.ratio, self.k = ratio, k
        self.use_error_feedback = use_error_feedback
        self.error_dict = {}

    def settings(self):
        """Ranks sending different k would gather arrays of different sizes (an error on some
        rank only, or a wait): compared before each step (HookState)."""
        return {"ratio": self.ratio if self.k is None else None, "k": self.k}

    def k_for(self, n):
        """Entries sent from a bucket of n: ``k``, or round(ratio n), at least 1, at most n."""
        k = self.k if self.k is not None else round(self.ratio * n)
        return min(max(k, 1), n)


def topk_hook(state, bucket):
    """Average the bucket's gradient over the ranks from each rank's k largest entries."""
    comm = communicator(state.process_group, bucket)
    g = bucket.buffer()
    xp = backend.get_array_module(g)
    n, index = g.size, bucket.index()
    state.begin(comm, bucket)
    k = state.k_for(n)
    # error feedback: what earlier steps left out is added back before choosing
    p = g + state.error_dict[index] if index in state.error_dict else g.copy()
    # the k largest |p|, NaN first: a NaN left out would stay in the residual for ever, unseen
    # by GradScaler, which must skip this step; a stable sort breaks ties by the lower index
    magnitude = xp.where(xp.isnan(p), xp.inf, xp.abs(p))
    chosen = xp.argsort(-magnitude, kind="stable")[:k]
    chosen = xp.sort(chosen).astype(xp.int32 if n < 2**31 else xp.int64)
    values = p[chosen]
    if state.use_error_feedback:
        p[chosen] = 0  # the residual: p minus what was sent
        state.error_dict[index] = p
    # every rank gets every rank's k values and k indices: two all-gathers, (p, k) each
    all_values = comm.all_gather(values)
    all_indices = comm.all_gather(chosen)
    # Added in rank order on every rank, from the same messages: the same bits everywhere. A
    # rank's indices are distinct, so a fancy-index add per rank is exact.
    total = xp.zeros_like(g)
    for r in range(comm.size):
        total[all_indices[r]] += all_values[r]
    g[...] = total / comm.size
    return state.settle(bucket, g)
