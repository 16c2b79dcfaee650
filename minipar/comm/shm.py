"""Shared-memory all-reduce: the ranks of one node add straight out of one another's memory.

    y = comm.all_reduce(x, algorithm="shm")       # every rank on one node
    buf = shared_array(comm, nbytes)              # a vector that lives in this rank's slot
    comm.all_reduce(buf, algorithm="shm", out=buf)   # reduced where it lies, nothing copied in

An MPI-3 window (``Win.Allocate_shared`` over ``Split_type(COMM_TYPE_SHARED)``) holds a slot
S_r per rank and a result R (the design of NCCL's and MPICH's intra-node paths): each rank
copies x into its slot, barrier, reduces its 1/p slice reading the peers' slots in place (into
R and its output), barrier, and copies the peers' slices of R out. Two barriers (the first of
empty messages that carry the call's fingerprint), no data sent: 4n bytes through memory per
rank at p = 2, where a ring through MPICH's shared memory moves 5.5n and pays 2(p-1)
handshakes. The steps, the bytes and the cost formula: docs/comm.md.
"""
import functools
import weakref

from mpi4py import MPI

from minipar import backend
from minipar.comm import agreement, node, watch
from minipar.comm.buffers import Accumulator, bounds
from minipar.comm.errors import CommError, dtype_tag, tag_dtype
from minipar.comm.registry import OPS, algorithm

PAGE = 4096
TEXT = 512  # bytes for an error's words, in each of two areas of rank 0's segment
np = backend.numpy


def copy_cost(n, g):
    """A copy reads and writes n bytes: 2n of traffic to a reduction's 3n, so 2/3 n gamma(n)."""
    return 2 / 3 * n * g(n)


def node_reduce_cost(p, n, g):
    """Copy in all but one's own slice, then each rank reduces its slice of the p slots: (p-1)
    reductions of n/p bytes."""
    return (p - 1) / p * copy_cost(n, g) + (p - 1) * n / p * g(n / p)


def shm_cost(p, n, a, g):
    """Two barriers, steps 1 and 2, my slice written out as it is reduced (read from the cache:
    a write, a third of a reduction's traffic), and the peers' slices copied out of R."""
    return 2 * a + node_reduce_cost(p, n, g) + n / p * g(n / p) / 3 + (p - 1) / p * copy_cost(n, g)


def traffic(p, bucket=False):
    """Bytes through memory per rank, in units of n. Out of place: copy in 2(p-1)/p, reduce
    1 + 1/p, my slice out 1/p (written; read from the cache), the peers' slices out 2(p-1)/p.
    A shared_array in place (``bucket``): reduce 1 + 1/p, the peers' slices out 2(p-1)/p."""
    if bucket:
        return 1 + 1 / p + 2 * (p - 1) / p
    return 4 * (p - 1) / p + 1 + 2 / p


def _pages(nbytes):
    return -(-nbytes // PAGE) * PAGE


class Window:
    """One shared segment over the ranks of ``mpi_comm`` (they must share a node): rank 0's
    part holds the headers (p x 4 int64), the error text and R; every rank's part its slot."""

    def __init__(self, mpi_comm):
        self.comm, self.win, self.cap = mpi_comm, None, -1
        self.p, self.rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        self.head = _pages(self.p * 32 + 2 * (8 + TEXT))
        self.allocate(0)

    def allocate(self, nbytes):
        """(Re)make the window with room for n-byte vectors (collective over the node); rank 0
        carries the posted words over."""
        posted = [t.copy() for t in self.text] if self.win is not None else None
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
        cap = _pages(nbytes)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each part in its owner's memory (NUMA)
        size = self.head + 2 * cap if self.rank == 0 else cap
        with watch.blocking("shared window allocation", watch.world_ranks(self.comm), size):
            self.win = MPI.Win.Allocate_shared(size, 1, info, comm=self.comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, for Win.Sync (MPI-3 unified model)
        parts = [np.frombuffer(self.win.Shared_query(j)[0], np.uint8) for j in range(self.p)]
        self.heads = parts[0][:self.p * 32].view(np.int64).reshape(self.p, 4)
        start = self.p * 32
        self.text = [parts[0][start + k * (8 + TEXT):start + (k + 1) * (8 + TEXT)]
                     for k in (0, 1)]
        if self.rank == 0:
            for text, old in zip(self.text, posted or [np.zeros(8, np.uint8)] * 2):
                text[:old.size] = old
        self.result = parts[0][self.head:self.head + cap]
        self.slots = [parts[0][self.head + cap:]] + [part[:cap] for part in parts[1:]]
        self.cap = cap

    def sync(self, ranks, meet=None):
        """Every rank's writes so far are seen by all (Win_sync, barrier, Win_sync); ``meet()``
        in the barrier's place, when given (any rendezvous will do, messages too: Win_sync
        on both sides of it is what MPI-3's unified memory model asks)."""
        with watch.blocking("shared-memory barrier", ranks):
            self.win.Sync()
            (meet or self.comm.Barrier)()
            self.win.Sync()

    def view(self, raw, dtype, n, offset=0):
        return raw[offset:offset + n * dtype.itemsize].view(dtype)

    def post(self, error, area):
        """One rank's words (or None) for every rank of the node to read after the next sync
        (``posted``); two areas, so a post never overwrites one still being read."""
        words = (error or "").encode()[:TEXT]
        text = self.text[area]
        text[8:8 + len(words)] = np.frombuffer(words, np.uint8)
        text[:8] = np.frombuffer(np.int64(len(words)).tobytes(), np.uint8)

    def posted(self, area):
        text = self.text[area]
        length = int(text[:8].view(np.int64)[0])
        return text[8:8 + length].tobytes().decode(errors="replace") if length else None


_windows = weakref.WeakKeyDictionary()  # communicator -> its Window (one per communicator)
_owners = []  # (first address, end address, Window) of each shared_array


def shared_array(comm, nbytes):
    """n zero bytes in this rank's slot of a window of their own over ``comm``'s ranks
    (collective; they must share a node; view parts of it as arrays). An in-place shm
    all-reduce of any such view reads the peers' slots where they lie, at the same offset, and
    copies nothing in: 3n - n/p bytes through memory per rank (``traffic``). The window lives
    as long as the process (MPI frees it at exit): make one for many arrays
    (buckets.bucket_buffers), and reduce one of its arrays at a time (its header and barriers
    are shared)."""
    window(comm)  # checks that the ranks share one node
    own = Window(node.shared(comm.mpi))
    own.allocate(nbytes)
    array = own.slots[own.rank][:nbytes]
    array[...] = 0
    start = array.__array_interface__["data"][0]
    _owners.append((start, start + nbytes, own))
    own.sync(tuple(comm.world_ranks))
    return array


def owner(x, buf):
    """(Window, byte offset) when x lies in a shared_array and is reduced in place, else None."""
    if x is not buf or type(x) is not np.ndarray or not _owners:
        return None
    address = x.__array_interface__["data"][0]
    for start, end, w in _owners:
        if start <= address and address + x.nbytes <= end:
            return w, address - start
    return None


def one_node(c):
    """A CommError on every rank when c's ranks span several nodes (shared memory reaches only
    one node's ranks); node.span knows it since c was made, so asking sends nothing."""
    nodes = node.span(c)
    if nodes > 1:
        raise CommError(f"all_reduce 'shm': the {c.size} ranks span {nodes} nodes, and "
                        f"shared memory reaches only the ranks of one node: use "
                        f"'hierarchical' (shm inside each node, ring across them) or 'auto'")


def window(c):
    """c's Window, made on a communicator's first shm all-reduce (collective; node_reduce grows
    it when a larger vector comes); its ranks must share one node (``one_node``)."""
    if c not in _windows:
        one_node(c)
        _windows[c] = Window(node.shared(c.mpi))
    return _windows[c]


def header_error(w, ranks):
    """Why the headers (tag, count, dtype, op) differ, in the same words on every rank; None
    when they agree."""
    heads = w.heads
    if (heads == heads[0]).all():
        return None
    bad = next(j for j in range(w.p) if (heads[j] != heads[0]).any())
    (tag0, n0, dt0, op0), (tag, n, dt, op) = heads[0].tolist(), heads[bad].tolist()
    who = f"rank {ranks[0]} and rank {ranks[bad]}"
    if agreement.fingerprinted(tag0) and agreement.fingerprinted(tag) and tag0 != tag:
        why = agreement.disagreement(heads[:, 0].tolist(), ranks)
    elif dt0 != dt:
        why = f"dtypes differ across ranks ({who}: {tag_dtype(dt0)}, {tag_dtype(dt)})"
    elif n0 != n:
        why = f"counts differ across ranks ({who}: {n0} and {n} elements)"
    elif op0 != op:
        why = f"reduction ops differ across ranks ({who}: {OPS[op0]}, {OPS[op]})"
    else:
        why = f"{agreement.difference(tag0, tag)} ({who})"
    return f"all_reduce on shared memory: {why}"


def copy_in(x, slot, lo, hi):
    """x into this rank's slot, but for [lo, hi), which this rank reduces reading x itself
    (a device array goes whole: it is staged, and the reduction reads the host copy; x that
    is the slot, a shared_array, stays where it is). Returns the array the reduction reads for
    this rank: x, or the slot."""
    if type(x) is np.ndarray and (x.__array_interface__["data"][0]
                                  == slot.__array_interface__["data"][0]):
        return x
    if backend.is_gpu_array(x):
        # staged as MPI's staging is (one copy each way), and reduced on the host by NumPy
        x.get(out=slot)  # device -> this rank's host slot
        return slot
    slot[:lo] = x[:lo]
    slot[hi:] = x[hi:]
    return x


def copy_out(result, buf):
    if backend.is_gpu_array(buf):
        buf.set(result)  # staged: host result -> device
        backend.synchronize()
    elif buf is not result:
        buf[...] = result


CHUNK = 1 << 18  # bytes of my slice reduced at a time when it also goes out: inside L2


def node_reduce(w, x, op, tag, ranks, agree=None, offset=0, in_slot=False, meet=None, out=None):
    """Steps 1 and 2 over the window's ranks: returns R (a view of n elements), the reduction
    of every rank's x, once every rank has written its slice. Headers that differ raise here;
    ``agree(error)``, when given, runs on every rank after the check and before the reduction
    (hierarchical.py: the leaders compare nodes), and an error it returns is raised. The
    vectors sit ``offset`` bytes into the slots (a part of a shared_array); with ``in_slot``
    (x is this rank's slot) each rank's slice goes back into x instead of R; ``meet``: the
    first barrier's rendezvous (Window.sync); ``out``: a host array that gets this rank's
    slice of R too, as it is reduced."""
    n, dtype = x.size, x.dtype
    lo, hi = bounds(n, w.p)[w.rank:w.rank + 2]
    # this call's header, compared by every rank after the first barrier: ranks that disagree
    # raise the same CommError, each on its own, before any result
    w.heads[w.rank] = (tag, n, dtype_tag(dtype), OPS.index(op))
    fits = x.nbytes <= w.cap
    if fits:
        own = copy_in(x, w.view(w.slots[w.rank], dtype, n, offset), lo, hi)
    w.sync(ranks, meet)
    error = header_error(w, ranks)
    if agree is not None:
        error = agree(error)
    if error:
        # every rank raises: they meet once more, so that none writes its next call's header
        # before every other has read this one's (a slow peer would name the wrong mismatch)
        w.sync(ranks)
        raise CommError(error)
    if not fits:  # every rank holds the same count here: they grow the window together
        w.allocate(x.nbytes)
        own = copy_in(x, w.view(w.slots[w.rank], dtype, n), lo, hi)
        w.sync(ranks)
    slots = [w.view(s, dtype, n, offset)[lo:hi] for s in w.slots]
    slots[w.rank] = own[lo:hi]  # this rank's own part: read where it is
    result = w.view(w.result, dtype, n, offset)
    # the sum runs in rank order; in x itself only on ranks 0 and 1 (x's slice is read first)
    mine = own[lo:hi] if in_slot and w.rank < 2 else result[lo:hi]
    # with ``out``, a chunk at a time: each chunk of my slice is copied to out while it is
    # still in the cache, not read back from memory
    step = max(CHUNK // x.itemsize if out is not None else hi - lo, 1)
    for a in range(0, hi - lo, step):
        part = slice(a, a + step)
        # 16 bits: added in float32 and rounded once (a node of one rank: its vector is the sum)
        total = Accumulator(op, mine[part])
        for s in slots:
            total.add(s[part])
        total.done()
        if out is not None:
            out[lo:hi][part] = mine[part]
    if in_slot and w.rank >= 2:
        own[lo:hi] = mine
    w.sync(ranks)
    return result


def reduce_into(w, x, buf, op, tag, ranks, meet=None):
    """Steps 1 to 3 for an x outside the window: buf gets this rank's slice as it is reduced
    and the peers' slices out of R (a device buf: R staged back whole)."""
    if type(buf) is not np.ndarray:
        copy_out(node_reduce(w, x, op, tag, ranks, meet=meet), buf)
        return
    result = node_reduce(w, x, op, tag, ranks, meet=meet, out=buf)
    lo, hi = bounds(x.size, w.p)[w.rank:w.rank + 2]
    buf[:lo], buf[hi:] = result[:lo], result[hi:]


@algorithm("all_reduce", "shm", 5, lambda p, n, a, b, g: shm_cost(p, n, a, g))
def _all_reduce_shm(c, x, buf, op):
    """Copy in, reduce my 1/p reading the peers' slots in place (into R and out), copy the
    peers' slices of R out; a shared_array: reduce my 1/p into it, then copy the peers'
    slices out of theirs."""
    ranks, found, tag = tuple(c.world_ranks), owner(x, buf), c.tag
    one_node(c)
    # the window and its barriers are MPI's, where a peer inside another collective never
    # comes: the ranks meet by trading the call's fingerprint in empty messages instead, in
    # the first barrier's place (still one rendezvous a call), and before a window is made
    meet = functools.partial(agreement.exchange, c)
    if found is None:
        if c not in _windows:
            meet()
        reduce_into(window(c), x, buf, op, tag, ranks, meet)
        return
    w, offset = found
    node_reduce(w, x, op, tag, ranks, offset=offset, in_slot=True, meet=meet)
    edges = bounds(x.size, w.p)
    for j, slot in enumerate(w.slots):
        if j != w.rank:
            x[edges[j]:edges[j + 1]] = w.view(slot, x.dtype, x.size, offset)[edges[j]:edges[j + 1]]
    w.sync(ranks)
