"""Hierarchical all-reduce: shared memory inside each node, point-to-point across the nodes.

    y = comm.all_reduce(x, algorithm="hierarchical")   # "auto" weighs it when nodes are shared
    MINIPAR_RANKS_PER_NODE=2 mpiexec -n 4 ...          # one machine plays two nodes (node.py)

MPICH's and NCCL's two-level scheme, for N nodes of L ranks: on each node, the shm
all-reduce's first two steps put the node's sum R in its window (shm.py); the node leaders
(local rank 0) all-reduce R across the N nodes by the point-to-point algorithm the cost model
favours (cost.cheapest); every rank copies R out. Only n bytes per node cross the network per
direction and step, where a flat ring sends L times as many messages out of each node.

    time   3 alpha + copy(n) + (L-1) n/L gamma(n/L) + T_auto(N, n) + copy(n)

The derivation, and what NCCL does beyond it: docs/comm.md.
"""
import functools
import weakref

from mpi4py import MPI

from minipar.comm import agreement, cost, node
from minipar.comm.errors import CommError
from minipar.comm.registry import ALGORITHMS, algorithm
from minipar.comm.shm import (Window, copy_cost, copy_out, node_reduce, node_reduce_cost,
                              reduce_into, shm_cost)


def across_cost(nodes, n, a, b, g):
    """The leaders' all-reduce: the cheapest of ``auto``'s point-to-point candidates."""
    if nodes == 1:
        return 0
    return min(ALGORITHMS["all_reduce"][name].cost(nodes, n, a, b, g)
               for name in cost.AUTO_CANDIDATES)


def hierarchical_cost(p, n, a, b, g, nodes=1):
    """The formula above for p ranks on ``nodes`` nodes (the fullest holds ceil(p/nodes))."""
    if nodes == 1:
        return shm_cost(p, n, a, g)
    local = -(-p // nodes)
    return (3 * a + node_reduce_cost(local, n, g)
            + across_cost(nodes, n, a, b, g) + copy_cost(n, g))


class Hierarchy:
    """A communicator's two levels: its node's Window, and (on leaders) the leaders'
    Communicator, counting into the same counters."""

    def __init__(self, c):
        local = node.shared(c.mpi)
        leader = local.Get_rank() == 0
        self.nodes = c.mpi.allreduce(int(leader), op=MPI.SUM)
        self.ranks = tuple(MPI.Group.Translate_ranks(
            local.Get_group(), list(range(local.Get_size())), MPI.COMM_WORLD.Get_group()))
        split = c.mpi.Split(0 if leader else MPI.UNDEFINED, key=c.rank)
        self.leaders = type(c.comm)(split, counters=c.counters) if leader else None
        self.window = Window(local)


_levels = weakref.WeakKeyDictionary()  # communicator -> its Hierarchy


def hierarchy(c):
    if c not in _levels:
        _levels[c] = Hierarchy(c)
    return _levels[c]


def agree_across(h, error):
    """Run on every rank after its node compared headers: a leader gathers every node's
    verdict and header (one small message) and posts the first complaint, in the same words on
    every leader, for its node's ranks to read after the next barrier. Returns the node's own
    complaint (raised at once by all its ranks), else None (the node goes on to that barrier)."""
    if h.leaders is None:
        return error
    everyone = h.leaders.all_gather_object((error, h.window.heads[0].tolist()))
    words = next((e for e, _ in everyone if e), None)
    differ = next((j for j, (_, head) in enumerate(everyone) if head != everyone[0][1]), None)
    if words is None and differ is not None:
        (tag0, n0, _, _), (tag, n, _, _) = everyone[0][1], everyone[differ][1]
        why = (agreement.difference(tag0, tag) if agreement.fingerprinted(tag0 | tag)
               else f"counts or dtypes differ across ranks ({n0} and {n} elements)")
        words = f"all_reduce across nodes: node 0 and node {differ} differ: {why}"
    h.window.post(words, 0)  # read by every rank of the node after the next barrier
    return error  # a node that disagrees inside raises its own words at once


@algorithm("all_reduce", "hierarchical", 6, hierarchical_cost)
def _all_reduce_hierarchical(c, x, buf, op):
    """Shared memory inside each node, the leaders' all-reduce across, the result copied out."""
    # the window's barriers and the leaders' exchanges are MPI's, where a peer inside another
    # collective never comes: every rank of c meets by trading the call's fingerprint first, in
    # the first barrier's place and before the levels are made (shm.py does the same), so a
    # rank in another collective meets a CommError naming both calls
    meet = functools.partial(agreement.exchange, c)
    if c not in _levels:
        meet()
    h, tag = hierarchy(c), c.tag
    w = h.window
    if h.nodes == 1:  # one node: the shm all-reduce
        reduce_into(w, x, buf, op, tag, h.ranks, meet)
        return
    # ranks that disagree on the count, dtype or op hear it inside a node as in shm.py; across
    # nodes the leaders compare every node's header while their nodes reduce (agree_across),
    # so every rank raises the same CommError before any message of the leaders' all-reduce
    result = node_reduce(w, x, op, tag, h.ranks, agree=lambda error: agree_across(h, error),
                         meet=meet)
    error = w.posted(0)  # the leaders' verdict on the nodes, read after node_reduce's barrier
    if error:
        raise CommError(error)
    if h.leaders is not None:
        name = cost.cheapest("all_reduce", cost.AUTO_CANDIDATES, h.leaders.size, result.nbytes)
        try:
            # the leaders' messages carry this call's fingerprint, on their own channel
            h.leaders.coll.tag = tag
            ALGORITHMS["all_reduce"][name](h.leaders.coll, result, result, op)
            w.post(None, 1)
        except CommError as err:
            w.post(f"across nodes: {err}", 1)
    w.sync(h.ranks)
    error = w.posted(1)
    if error:
        raise CommError(error)
    copy_out(result, buf)
