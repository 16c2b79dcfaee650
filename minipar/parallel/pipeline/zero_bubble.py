"""Zero-bubble schedules with two chunks per rank: ZB-V and interleaved zero bubble.

    build("zb-v", p=4, m=8)            # stages in a V: rank r holds r and 2p-1-r; bubble 3/51
    build("zb-interleaved", 4, 8, v=2) # Megatron's placement: rank r holds r, r+p; bubble 3/51

Zero Bubble Pipeline Parallelism (Qi et al. 2023, arXiv:2401.10241) splits each backward into
B, the input gradient dL/dx that the previous stage waits for, and W, the weight gradient dL/dW
that nothing waits for, and moves the W's into what would be bubble. ZB-H1 (schedules.py) does
it on 1F1B; the two schedules here do it with two model chunks per rank, each a stage of 1/2
the work, in the per-rank order of torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and
``ScheduleInterleavedZeroBubble``. Their bubbles and memory: docs/pipeline.md.
"""
from .actions import B, F, W, assemble, check_sizes


def zb_v(p, m):
    """ZB-V (the paper's section 6): rank r holds stage r ("down", chunk 0) and stage 2p-1-r
    ("up", chunk 1), so the last stage is on rank 0 beside the first, and stage p-1 hands its
    output to stage p on the same rank p-1 without a message. B and W split."""
    check_sizes(p, m)
    # Planned for n = max(m, 2p-1) micro-batches (fewer never reach the steady state), those
    # beyond m then left out.
    n = max(m, 2 * p - 1)
    order = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        plan = _Numbered()
        # warm-up: 2(p-r)-1 x F(down);  r x [F(up), F(down)];  p-r x [F(up), B(up), W(up)]
        plan.run(2 * (p - r) - 1, (F, down))
        plan.run(r, (F, up), (F, down))
        plan.run(p - r, (F, up), (B, up), (W, up))
        # steady: [F(down), B(down), W(down), F(up), B(up), W(up)] until every F has run
        while plan.count(F, up) < plan.count(F, down) or plan.count(F, down) < n:
            if plan.count(F, down) < n:
                plan.run(1, (F, down))
            plan.run(1, (B, down), (W, down), (F, up), (B, up), (W, up))
        # cool-down: r x [B(down), B(up)];  p-r x [B(down), W(down)];  then the W's still owed
        plan.run(r, (B, down), (B, up))
        plan.run(p - r, (B, down), (W, down))
        plan.run(plan.count(B, up) - plan.count(W, up), (W, up))
        plan.run(plan.count(B, down) - plan.count(W, down), (W, down))
        order.append([(kind, stage, k) for kind, stage, k in plan.seq if k < m])
    return assemble("zb-v", p, m, 2, order, split_backward=True, placement="v")


def zb_interleaved(p, m, v=2):
    """Interleaved zero bubble (the paper's ZB-1P on Megatron's interleaved placement: rank r
    holds stages r, r+p, ..., chunk c = stage // p): interleaved 1F1B's order of F and B with a
    shorter warm-up, and ZB-H1's rule for W, so rank r runs its W's r backwards late, which fills
    the drain. With v = 1 it is ZB-H1's order exactly. Micro-batches are numbered per stage in
    the order they arrive."""
    check_sizes(p, m, v)
    # Micro-batches go through the chunks in rounds of g = m / rounds (p when p divides m), and
    # m must be a multiple of the rounds, as torch requires. One chunk: no rounds.
    rounds = max(1, m // p) if v > 1 else 1
    if m % rounds:
        raise ValueError(f"interleaved zero bubble sends micro-batches through the chunks in "
                         f"{rounds} rounds of equal size: m={m} must be a multiple of {rounds} "
                         f"(as in torch.distributed.pipelining; try m={rounds * (m // rounds)})")
    group, total = m // rounds, m * v
    order = []
    for r in range(p):
        # the i-th F of a rank is in chunk (i // g) % v, the i-th B in chunk v-1 - (i // g) % v
        def chunk(kind, i):  # the chunk of rank r's i-th forward or backward
            c = (i // group) % v
            return (kind, (c if kind == F else v - 1 - c) * p + r)

        # warm-up: (v-1) g + p-1-r forwards, at most all m*v (interleaved 1F1B: 2(p-1-r), not
        # p-1-r); steady: one F, one B; cool-down: the remaining B's; then the W's still owed
        warm = min((v - 1) * group + p - 1 - r, total)
        plan, owed = _Numbered(), []

        def backward(i):  # B, then (from the (r+1)-th B on) the W of the oldest B still owed
            plan.run(1, chunk(B, i))
            owed.append(chunk(B, i)[1])
            if i >= r:
                plan.run(1, (W, owed.pop(0)))

        for i in range(warm):
            plan.run(1, chunk(F, i))
        for i in range(total - warm):
            plan.run(1, chunk(F, warm + i))
            backward(i)
        for i in range(total - warm, total):
            backward(i)
        for stage in owed:
            plan.run(1, (W, stage))
        order.append(plan.seq)
    return assemble("zb-interleaved", p, m, v, order, split_backward=True)


class _Numbered:
    """A rank's order being written: each (kind, stage) gets the next micro-batch of its own."""

    def __init__(self):
        self.seq, self.next = [], {}

    def count(self, kind, stage):
        return self.next.get((kind, stage), 0)

    def run(self, times, *steps):
        """Append ``steps`` (each a (kind, stage)) ``times`` times over."""
        for _ in range(times):
            for kind, stage in steps:
                self.seq.append((kind, stage, self.count(kind, stage)))
                self.next[(kind, stage)] = self.count(kind, stage) + 1
