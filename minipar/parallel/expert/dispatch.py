"""Dispatch and combine: each token travels to the rank that holds its expert, and back.

Every rank routes its own tokens and lays its kept assignments out expert by expert
(``nn.moe.Routing.order``). A rank's experts are consecutive, so that layout is already grouped
by the rank each row must go to:

    rank 0's rows   | e0 e0 e0 | e1 |  e2 e2 | e3 e3 e3 e3 |       E = 4 experts, ep = 2
                    |- to rank 0 --|---------- to rank 1 -----|

    p = plan(routing.kept_per_expert, group)         # 1. an all_to_all of the counts
    rows = dispatch(flat[routing.order], p, group)   # 2. all_to_all_v of the rows
    out = run_experts(rows, p.per_expert)            # 3. local expert i on its rows from all
    y = combine(out, p, group, gates, routing)       # 4. back home, each token's gated sum
An expert over tp, under sequence parallelism: ``gather_rows``, ``reduce_scatter_rows``.
"""
import dataclasses

from ... import backend
from ...autograd import concat, make_result
from ...nn import moe


def all_to_all_v(x, send_counts, recv_counts, group):
    """Differentiable all_to_all_v of x's rows (``Communicator.all_to_all_v``); backward sends
    the gradient rows back the way they came: the same exchange with the counts swapped."""
    out = group.all_to_all_v(x.data, send_counts, recv_counts)
    return make_result(out, (x,), lambda g: (group.all_to_all_v(g, recv_counts, send_counts),),
                       "all_to_all_v")


@dataclasses.dataclass
class Plan:
    """Who sends how many rows where, for one forward pass (host arrays):

    sent (ep, E/ep)      rows this rank sends to each rank's each expert
    received (ep, E/ep)  rows each rank sends to each of this rank's experts
    order                arrival position of each row, expert-major (expert, then source)
    """
    sent: object
    received: object
    order: object

    send_counts = property(lambda self: [int(n) for n in self.sent.sum(axis=1)])
    recv_counts = property(lambda self: [int(n) for n in self.received.sum(axis=1)])
    per_expert = property(lambda self: self.received.sum(axis=0))  # rows of each local expert


def plan(kept_per_expert, group):
    """The ``Plan`` of this rank's kept rows per expert (step 1: one all_to_all of counts, cut
    (ep, E/ep): every rank learns how many rows will arrive from each rank for each of its
    experts)."""
    host = backend.numpy
    sent = host.asarray(kept_per_expert, dtype=host.int64).reshape(group.size, -1)
    received = group.all_to_all(sent)  # row s: what rank s sends to my experts
    start = host.concatenate([[0], host.cumsum(received.reshape(-1))[:-1]]).reshape(received.shape)
    ranges = [host.arange(start[s, e], start[s, e] + received[s, e])
              for e in range(received.shape[1]) for s in range(received.shape[0])]
    order = host.concatenate(ranges) if ranges else host.zeros(0, host.int64)
    return Plan(sent, received, order.astype(host.int64))


def dispatch(rows, plan, group):
    """This rank's kept rows (expert-major) -> the rows of its own experts, expert-major."""
    # Rank j gets send_counts[j] = Σ counts[me, j's experts] rows of C numbers, kept rows only
    # (dropped tokens never travel); they arrive by source rank, then expert, and ``order``
    # puts each expert's together.
    return all_to_all_v(rows, plan.send_counts, plan.recv_counts, group)[plan.order]


def combine(expert_rows, plan, group, gates, routing):
    """The experts' outputs back to the ranks that sent them (the inverse order, the counts
    swapped), then each token's gated sum (``nn.moe.combine``)."""
    inverse = backend.numpy.argsort(plan.order)
    home = all_to_all_v(expert_rows[inverse], plan.recv_counts, plan.send_counts, group)
    return moe.combine(home, gates, routing)


def gather_rows(x, counts, group):
    """Every rank's rows, rank 0's first: rank j brings ``counts[j]`` rows (an all-gather of
    unequal parts, sent as an all_to_all_v of my rows to every rank). Backward: each rank's rows'
    gradients summed over the group and sent home, a reduce-scatter (the concat's sum)."""
    mine = [len(x)] * group.size
    return all_to_all_v(concat([x] * group.size, axis=0), mine, counts, group)


def reduce_scatter_rows(y, counts, group):
    """The conjugate of ``gather_rows``: ``y`` holds partial sums of every rank's rows (rank j's
    ``counts[j]`` first); each rank gets its own rows summed over the group. Backward: an
    all-gather of the rows' gradients."""
    n = counts[group.rank]
    parts = all_to_all_v(y, counts, [n] * group.size, group)  # my rows' partial sums, per rank
    return parts.reshape(group.size, n, *y.shape[1:]).sum(axis=0)


def counts_matrix(routing, group):
    """counts[s, e]: kept rows rank s sends to expert e, on every rank (a gather of metadata)."""
    return backend.numpy.array(group.all_gather_object(routing.kept_per_expert.tolist()))


def table(counts, ep):
    """The counts matrix as lines of text: one row per sending rank, one column per expert,
    experts grouped under the rank that holds them."""
    E = counts.shape[1]
    per = E // ep
    head = " | ".join(" ".join(f"e{e:<3d}" for e in range(r * per, (r + 1) * per))
                      for r in range(ep))
    owners = " | ".join(f"{'on rank ' + str(r):<{5 * per - 1}s}" for r in range(ep))
    lines = [f"{'':12s}{owners}", f"{'':12s}{head}"]
    for s, row in enumerate(counts):
        cells = " | ".join(" ".join(f"{n:<4d}" for n in row[r * per:(r + 1) * per])
                           for r in range(ep))
        lines.append(f"from rank {s:<2d}{cells}")
    return lines
