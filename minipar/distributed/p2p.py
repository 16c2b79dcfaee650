"""torch.distributed's point-to-point calls over minipar's communicator: send, recv, isend,
irecv and batch_isend_irecv, in place, as collectives.py's calls are.

    if rank == 0:
        dist.send(tensor, dst=1)
    else:
        sender = dist.recv(tensor)      # no src: from any rank, as in torch; returns the sender

Ranks named (``dst``, ``src``, a ``P2POp``'s ``peer``) are world ranks, as in torch; ``group_dst``,
``group_src`` and ``group_peer`` a group's own numbering.
"""
from .collectives import Work, _Buffer, _member, _root
from .process_group import resolve


def _peer(group, rank, group_rank, what):
    if rank is None and group_rank is None:
        raise ValueError(f"{what}: name the peer rank (dst or group_dst)")
    return _root(group, rank, group_rank, what)


def _source(comm, group, src, group_src, tag, what):
    """The group rank to receive from: ``src`` (or ``group_src``), else, as torch's recv without
    src, the sender of the first message with this tag to arrive (MPI_ANY_SOURCE, probed)."""
    if src is not None or group_src is not None:
        return _root(group, src, group_src, what)
    from mpi4py import MPI

    from ..comm import watch
    status = MPI.Status()
    with watch.blocking(f"{what} from any rank", comm.world_ranks, 0, tag):
        comm.mpi.Probe(MPI.ANY_SOURCE, tag, status)
    return status.Get_source()


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Send the tensor to world rank ``dst`` (blocking)."""
    comm = _member(group)
    if comm is not None:
        comm.send(_Buffer(tensor, "send").array, _peer(group, dst, group_dst, "send"), tag)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Fill the tensor with what world rank ``src`` sends (any rank when None); returns the
    sender's world rank."""
    comm = _member(group)
    if comm is None:
        return -1
    peer = _source(comm, group, src, group_src, tag, "recv")
    buf = _Buffer(tensor, "recv")
    comm.recv(buf.array, peer, tag)
    buf.store()
    return resolve(group).ranks[peer]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Start sending; returns a Work (do not change the tensor before its wait())."""
    comm = _member(group)
    if comm is None:
        return None
    request = comm.isend(_Buffer(tensor, "isend").array, _peer(group, dst, group_dst, "isend"),
                         tag)
    return Work(request.wait)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """Start receiving into the tensor; returns a Work whose wait() fills it. Without ``src``
    the wait() receives from whichever rank sends first (``work._source_rank()``, as torch's)."""
    comm = _member(group)
    if comm is None:
        return None
    if src is None and group_src is None:
        return _AnySource(tensor, group, tag)
    buf = _Buffer(tensor, "irecv")
    peer = _peer(group, src, group_src, "irecv")
    request = comm.irecv(buf.array, peer, tag)
    return Work(lambda: (request.wait(), buf.store()), source=resolve(group).ranks[peer])


class _AnySource(Work):
    """irecv without src: the receive happens in wait(), once a message names its sender (a
    peer's large blocking send to this rank waits until then, as for a receive posted late)."""

    def __init__(self, tensor, group, tag):
        super().__init__(lambda: setattr(self, "source", recv(tensor, None, group, tag)))


class P2POp:
    """One send or receive of ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv``."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if op not in (isend, irecv):
            raise ValueError(f"P2POp: op must be minipar.distributed.isend or irecv, got {op!r}")
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.group_peer = _peer(group, peer, group_peer, "P2POp")
        self.peer = resolve(group).ranks[self.group_peer]


def batch_isend_irecv(p2p_op_list):
    """Start every send and receive of the list at once; returns their Works (wait() each)."""
    if not all(isinstance(p2p, P2POp) for p2p in p2p_op_list):
        raise TypeError("batch_isend_irecv takes a list of P2POp")
    return [p2p.op(p2p.tensor, group=p2p.group, tag=p2p.tag, **{
        ("group_dst" if p2p.op is isend else "group_src"): p2p.group_peer})
        for p2p in p2p_op_list]
