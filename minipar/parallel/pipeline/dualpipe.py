"""DualPipeV: DeepSeek-V3's DualPipe folded onto p ranks, as schedule data.

    build("dualpipev", p=4, m=8)   # stages in a V (rank r holds r and 2p-1-r); needs m >= 2p

DualPipe (DeepSeek-V3, arXiv:2412.19437) runs, in the steady state, the forward of one
micro-batch beside the backward of another, so that one's communication hides under the
other's compute. DualPipeV is its V-shaped half on p ranks, ZB-V's placement (zero_bubble.py):
rank r holds stage r ("down", chunk 0) and stage 2p-1-r ("up", chunk 1). The order is rank r's
in torch.distributed.pipelining's ``ScheduleDualPipeV`` (which refuses m < 2p), in eight
phases. Its passes (actions.py): F; BW, a whole backward (torch's FULL_BACKWARD); B, the input
gradient alone, its W deferred as in zero bubble and run later, oldest first; and F&B, a
forward paired with a backward (torch's OVERLAP_F_B), run as its F, then its B, with the
messages of both already posted. Its bubble beside DualPipe's formula: docs/pipeline.md.
"""
from .actions import B, BW, F, FB, W, assemble, check_sizes


def dualpipe_v(p, m):
    """DualPipeV on p ranks with m >= 2p micro-batches: rank r's order of F, B, BW, W and F&B."""
    check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least as many micro-batches as stages: m={m} < "
                         f"2p={2 * p} (as torch's ScheduleDualPipeV; try m={2 * p})")
    order = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        plan = _Plan()
        # 1-2. warm-up: 2(p-1-r) x F(down), then r+1 x [F(down), F(up)]
        plan.run(2 * (p - 1 - r), (F, down))
        plan.run(r + 1, (F, down), (F, up))
        # 3. zero bubble: p-1-r x [B(up), its W, F(up)]
        plan.run(p - 1 - r, (B, up), (W,), (F, up))
        # 4. steady: m-2p+r+1 x [F(down) & BW(up), F(up) & BW(down)]; the last rank runs its
        # first pair's two halves apart (torch: "to further reduce bubble size")
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                plan.run(1, (F, down), (BW, up))
            else:
                plan.pair((F, down), (BW, up))
            plan.pair((F, up), (BW, down))
        # 5. p-1-r x [BW(up), F(up) & BW(down)]
        for _ in range(p - 1 - r):
            plan.run(1, (BW, up))
            plan.pair((F, up), (BW, down))
        # 6. r+1 x [backward(up), backward(down)]: whole backwards for the first half, then
        # input gradients only (their W's deferred); an odd rank switches before its up one
        half, split = (r + 1) // 2, False
        for i in range(r + 1):
            split = split or (i == half and r % 2 == 1)
            plan.run(1, (B if split else BW, up))
            split = split or (i == half and r % 2 == 0)
            plan.run(1, (B if split else BW, down))
        # 7-8. cool-down: p-1-r x [a deferred W, B(down)], then r+1 more deferred W's
        plan.run(p - 1 - r, (W,), (B, down))
        plan.run(r + 1, (W,))
        order.append(plan.seq)
    return assemble("dualpipev", p, m, 2, order, split_backward=True, placement="v")


class _Plan:
    """A rank's order being written: each F, and each backward (B or BW) of a stage, gets the
    next micro-batch of its own; a B's W is owed until a (W,) step runs the oldest one owed."""

    def __init__(self):
        self.seq, self.next, self.owed = [], {}, []

    def _take(self, kind, stage=None):
        if kind == W:  # the oldest deferred weight gradient, if any is owed
            return [(W, *self.owed.pop(0))] if self.owed else []
        key = (F if kind == F else B, stage)  # B and BW count the same backwards
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        if kind == B:
            self.owed.append((stage, mb))
        return [(kind, stage, mb)]

    def run(self, times, *steps):
        """Append ``steps`` (each (kind, stage), or (W,) for the oldest W owed) ``times`` over."""
        for _ in range(times):
            for step in steps:
                self.seq += self._take(*step)

    def pair(self, forward, backward):
        """Append one F&B: the forward ``(F, stage)`` paired with the backward ``(BW, stage)``."""
        self.seq.append((FB, *self._take(*forward), *self._take(*backward)))
