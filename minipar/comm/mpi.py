"""MPI's own collectives, registered as algorithm ``"mpi"`` of each: the reference every
hand-coded algorithm is checked against (bit for bit where the reduction order allows) and timed
against (``minipar bench allreduce``).

Each entry takes the same arguments as the hand-coded algorithms of its collective, so the
communicator's entry points run every algorithm alike. GPU arrays go to MPI directly when it is
CUDA-aware and through host copies otherwise (staging.py). ``op="avg"`` reaches MPI as a sum;
the entry point divides (buffers.finish).
"""
import functools

from mpi4py import MPI

from minipar import backend
from minipar.comm import agreement, watch
from minipar.comm.errors import CommError
from minipar.comm.registry import algorithm
from minipar.comm.wire import inout_buffer, recv_buffer, send_buffer

MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def mpi_algorithm(collective, number, reduces=False):
    """Register ``fn(c, ...)`` as algorithm ``"mpi"`` of ``collective`` (``number`` in the
    fingerprint): the ranks agree on the call first, and the whole call is noted for the
    watchdog (it waits on every rank). A reduction (``reduces``) of bfloat16 is refused first
    (``refuse_bfloat16``)."""
    def register(fn):
        @functools.wraps(fn)
        def run(c, *args):
            if reduces:
                refuse_bfloat16(collective, args[0])
            with watch.blocking("MPI collective", c.world_ranks):
                agree(c)
                fn(c, *args)
        return algorithm(collective, "mpi", number)(run)
    return register


def refuse_bfloat16(collective, x):
    """MPI has no bfloat16 type: its bits travel as uint16 (buffers.bits), and MPI's own
    reduction would add those integers. The same CommError on every rank (the dtype is part of
    the call), before any message. float16 is MPICH's MPIX_C_FLOAT16: MPI sums it."""
    if x.dtype.name == "bfloat16":
        raise CommError(f"{collective} algorithm 'mpi': MPI has no bfloat16 type, so its own "
                        f"reduction cannot add bfloat16 arrays (it would add their bits as "
                        f"integers); use a hand-coded algorithm (ring, recursive_halving, "
                        f"recursive_doubling, ...: they add in float32) or reduce a float32 copy")


def agree(c):
    """MPI's own collectives carry no message of ours to put the call's fingerprint in, so the
    ranks compare it first with one MPI_Allreduce of (tag, -tag) under MAX: max = -min exactly
    when every rank made the same call. On a mismatch every rank raises the same CommError."""
    tag = c.tag
    if not agreement.fingerprinted(tag):
        return
    both = backend.numpy.array([tag, -tag], dtype="int64")
    c.mpi.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    if both[0] != -both[1]:
        agreement.same_everywhere(c.comm, "the ranks disagree on an MPI collective call",
                                  tag, _calls)


def _calls(tags):
    """'(rank 0: all_reduce #3 (mpi, sum, float32); rank 1: ...): dtypes differ across ranks'"""
    other = next(t for t in tags if t != tags[0])
    return ("(" + "; ".join(f"rank {r}: {agreement.describe(t)}" for r, t in enumerate(tags))
            + f"): {agreement.difference(tags[0], other)}")


def agree_on_call(comm, collective, op, x):
    """Number and fingerprint a call of MPI's on Communicator ``comm`` that does not run
    through ``mpi_algorithm`` (the non-blocking all-reduce), and ``agree`` on it."""
    with comm.coll.call(collective, "mpi", op, x), watch.blocking("MPI collective",
                                                                  comm.world_ranks):
        agree(comm.coll)


def _run(c, call, send, recv):
    """``call(send buffer, receive buffer)`` on arrays (either may be None), staging GPU arrays."""
    aware = c.is_cuda_aware()
    sbuf, sent = send_buffer(send, aware) if send is not None else (None, None)
    rbuf, done = recv_buffer(recv, aware, c.rank) if recv is not None else (None, None)
    call(MPI.IN_PLACE if sbuf is not None and sbuf is rbuf else sbuf, rbuf)
    for finish in filter(None, (sent, done)):  # staged: copy in, give host buffers back
        finish()


@mpi_algorithm("all_reduce", 9, reduces=True)
def _all_reduce(c, x, buf, op):
    """MPI_Allreduce (in place when x is buf)."""
    _run(c, lambda s, r: c.mpi.Allreduce(s, r, op=MPI_OP[op]), x, buf)


@mpi_algorithm("broadcast", 2)
def _broadcast(c, buf, root):
    data, done = inout_buffer(buf, c.is_cuda_aware())
    c.mpi.Bcast(data, root)
    if done:
        done(copy_back=c.rank != root)  # the root's data is unchanged


@mpi_algorithm("reduce", 1, reduces=True)
def _reduce(c, buf, root, op):
    """MPI_Reduce: the root reduces in place into buf, the others send theirs."""
    data, done = inout_buffer(buf, c.is_cuda_aware())
    at_root = c.rank == root
    c.mpi.Reduce(MPI.IN_PLACE if at_root else data, data if at_root else None, MPI_OP[op], root)
    if done:
        done(copy_back=at_root)  # only the root receives


@mpi_algorithm("reduce_scatter", 3, reduces=True)
def _reduce_scatter(c, buf, bounds, op):
    """MPI_Reduce_scatter with the chunk sizes of ``chunk_bounds``; chunk r lands in place."""
    lo, hi = bounds[c.rank], bounds[c.rank + 1]
    counts = [bounds[j + 1] - bounds[j] for j in range(c.size)]
    mine = c.scratch("mpi", hi - lo, buf)
    _run(c, lambda s, r: c.mpi.Reduce_scatter(s, r, counts, MPI_OP[op]), buf, mine)
    buf[lo:hi] = mine


@mpi_algorithm("all_gather", 2)
def _all_gather(c, buf, bounds):
    """MPI_Allgather in place: every rank's block already sits at its place in buf."""
    data, done = inout_buffer(buf, c.is_cuda_aware())
    c.mpi.Allgather(MPI.IN_PLACE, data)
    if done:
        done()


@mpi_algorithm("all_to_all", 1)
def _all_to_all(c, x, result):
    _run(c, c.mpi.Alltoall, x, result)


@mpi_algorithm("all_to_all_v", 1)
def _all_to_all_v(c, rows, result, sent, got):
    """MPI_Alltoallv, counts and displacements in elements (rows times the row width)."""
    _check_counts(c, sent, got)
    w = rows.shape[1]
    send = ([w * (b - a) for a, b in zip(sent, sent[1:])], [w * a for a in sent[:-1]])
    recv = ([w * (b - a) for a, b in zip(got, got[1:])], [w * a for a in got[:-1]])
    _run(c, lambda s, r: c.mpi.Alltoallv([s, send], [r, recv]), rows, result)


def _check_counts(c, sent, got):
    """The same CommError on every rank unless each rank expects from each peer the rows that
    peer sends it: MPI_Alltoallv receives fewer elements than asked without a word, leaving the
    rest of the buffer as it was (rows nobody sent). One MPI_Allgather of the count rows."""
    p = c.size
    mine = backend.numpy.array([b - a for a, b in zip(sent, sent[1:])]
                               + [b - a for a, b in zip(got, got[1:])], dtype="int64")
    every = backend.numpy.empty((p, 2 * p), dtype="int64")
    c.mpi.Allgather(mine, every)
    sends, expects = every[:, :p], every[:, p:]  # sends[i, j]: rows i sends j; expects[j, i]
    wrong = [f"rank {j} expects {expects[j, i]} rows from rank {i}, which sends it {sends[i, j]}"
             for i in range(p) for j in range(p) if sends[i, j] != expects[j, i]]
    if wrong:
        raise CommError(f"all_to_all_v: send_counts and recv_counts do not pair up across "
                        f"ranks: {'; '.join(wrong)}")


@mpi_algorithm("gather", 1)
def _gather(c, x, result, root):
    _run(c, lambda s, r: c.mpi.Gather(s, r, root), x, result)


@mpi_algorithm("scatter", 1)
def _scatter(c, x, result, root):
    _run(c, lambda s, r: c.mpi.Scatter(s, r, root), x if c.rank == root else None, result)
