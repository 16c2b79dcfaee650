"""The pieces every data-parallel wrapper shares: rank 0's parameters everywhere, parameters cut
into buckets, each bucket's flat gradient buffer (Li et al. 2020), and ZeRO stage 2's queue that
fires a bucket's collective as soon as backward has produced all of its gradients (DDP's hook
counts them itself, in ddp.py).

``make_buckets`` cuts the parameters, last layer first (the order backward produces gradients
in), into groups of about ``cap_bytes``; ``bucket_buffers`` gives each bucket its buffer in the
flat layout of ``minipar.flat``.

    buckets = make_buckets(params, 25 * 2**20)
    buffers = bucket_buffers(buckets, comm)
    queue = ReadyQueue(buckets, launch=lambda i: ..., finish=lambda: ...)

``GradBucket``: what a communication hook sees of a bucket (torch's; averaging.py runs hooks).
"""
import warnings

from ... import backend
from ...comm import node, shm
from ...comm.agreement import same_everywhere
from ...comm.mpi import refuse_bfloat16
from ...flat import flatten_grads, offsets, views


def broadcast_parameters(module, comm, on_mismatch="warn"):
    """Give every rank rank 0's parameters and buffers (in place); return the names that differed
    on this rank. ``on_mismatch``: "warn" (overwrite and warn), "ignore", or "raise" (every rank
    raises the same ValueError naming the ranks and parameters that differed)."""
    if on_mismatch not in ("warn", "ignore", "raise"):
        raise ValueError(f"on_mismatch must be 'warn', 'ignore' or 'raise', got {on_mismatch!r}")
    check_same_layout(module, comm)
    tensors = [(name, p.data) for name, p in module.named_parameters()]
    differed = []
    for name, array in tensors + list(module.named_buffers()):
        theirs = comm.broadcast(array, root=0)
        if not backend.get_array_module(array).array_equal(theirs, array):
            differed.append(name)
        array[...] = theirs
    everyone = comm.all_gather_object(differed)  # a small check, not part of the algorithm
    summary = "; ".join(f"rank {r}: {', '.join(names)}"
                        for r, names in enumerate(everyone) if names)
    if summary and on_mismatch == "raise":
        raise ValueError(f"parameters differ from rank 0's at wrap time ({summary}); seed every "
                         f"rank alike (minipar.manual_seed) or pass on_mismatch='warn'")
    if differed and on_mismatch == "warn":
        warnings.warn(f"rank {comm.rank}: {len(differed)} parameters/buffers differed from rank "
                      f"0's and were overwritten by the broadcast: {', '.join(differed)}")
    return differed


def check_same_layout(module, comm):
    """Every rank must hold the same parameters and buffers (names, order, shapes, dtypes,
    requires_grad): otherwise the broadcast and the buckets pair different arrays, and a rank
    with an extra layer waits for ever. Compared by ``same_everywhere``: a difference raises on
    every rank the same ValueError naming the first one."""
    mine = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
            for name, p in module.named_parameters()]
    mine += [("buffer", name, tuple(a.shape), str(a.dtype), False)
             for name, a in module.named_buffers()]
    same_everywhere(comm, "the model differs across ranks", mine, describe=_layouts_differ,
                    error=ValueError)


def _layouts_differ(everyone):
    """The first difference from rank 0's list, of the first rank that differs, and which
    others do, in words."""
    differ = [r for r in range(1, len(everyone)) if everyone[r] != everyone[0]]
    more = f" (ranks {', '.join(map(str, differ))} differ)" if len(differ) > 1 else ""
    return (f"{_first_difference(everyone[0], everyone[differ[0]], differ[0])}{more}; build "
            f"the same model on every rank before wrapping it")


def _first_difference(first, other, r):
    """The first entry where rank r's list differs from rank 0's, in words."""
    def what(e):
        return f"{e[0]} {e[1]!r} {e[2]} {e[3]}"
    names0, names_r = {e[1] for e in first}, {e[1] for e in other}
    for i in range(max(len(first), len(other))):
        a = first[i] if i < len(first) else None
        b = other[i] if i < len(other) else None
        if a == b:
            continue
        if b is not None and b[1] not in names0:
            return f"rank {r} has an extra {what(b)} that rank 0 lacks"
        if a is not None and a[1] not in names_r:
            return f"rank {r} lacks the {what(a)} that rank 0 has"
        if a[1] != b[1]:
            return (f"they come in a different order: at position {i} rank 0 has {what(a)}, "
                    f"rank {r} has {what(b)}")
        if a[2:4] != b[2:4]:
            return f"{a[0]} {a[1]!r} is {a[2]} {a[3]} on rank 0 but {b[2]} {b[3]} on rank {r}"
        return (f"{a[0]} {a[1]!r} has requires_grad={a[4]} on rank 0 but requires_grad={b[4]} "
                f"on rank {r}")


def make_buckets(params, cap_bytes):
    """Parameters in reverse order, cut into consecutive groups; a bucket is closed once it holds
    ``cap_bytes`` or more (PyTorch's rule: a parameter is never split, and a layer's bias shares
    its weight's bucket rather than costing a collective of its own); a change of dtype starts
    a new bucket."""
    ### BEGIN SOLUTION ddp-buckets
    buckets, size = [], 0
    for p in reversed(params):
        if not buckets or size >= cap_bytes or p.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.data.nbytes
    return buckets
    ### END SOLUTION


def bucket_buffers(buckets, comm, algorithm="auto"):
    """One zeroed flat buffer per bucket, of its parameters' dtype, for all-reduces by
    ``algorithm``. For ``shm`` and ``auto`` with every rank of ``comm`` on one node (host
    arrays) they lie in one shared-memory window (``shm.shared_array``, collective): an
    in-place all-reduce by ``shm`` (or ``auto``'s choice of it) then reduces straight out of the
    peers' buffers, where backward wrote the gradients, and copies nothing in."""
    shared = (algorithm in ("auto", "shm") and comm.size > 1 and backend.device() == "cpu"
              and node.span(comm) == 1)
    sizes = [offsets(b)[1] * b[0].data.dtype.itemsize for b in buckets]
    if algorithm == "mpi":  # no bfloat16 in MPI: refused now, not at the first backward
        for b in buckets:
            refuse_bfloat16("DistributedDataParallel's all_reduce", b[0].data)
    if not shared:
        return [backend.get_array_module(b[0].data).zeros(offsets(b)[1], b[0].dtype)
                for b in buckets]
    starts = [0]  # each bucket on a 64-byte boundary of one shared window
    for nbytes in sizes:
        starts.append(starts[-1] + -(-nbytes // 64) * 64)
    flat = shm.shared_array(comm, starts[-1])
    return [flat[o:o + nbytes].view(b[0].data.dtype)
            for b, o, nbytes in zip(buckets, starts, sizes)]


def gradient_bytes(params, buffers=()):
    """Bytes of the arrays the params' gradients live in, plus ``buffers``: an array shared by
    several gradients (a bucket buffer) counts once."""
    bases = {id(b): b.nbytes for b in buffers}
    for p in params:
        if p.grad is not None:
            base = p.grad if p.grad.base is None else p.grad.base
            bases[id(base)] = base.nbytes
    return sum(bases.values())


class ReadyQueue:
    """Calls ``launch(i)`` for bucket i once every parameter of it has its gradient, in bucket
    order (so all ranks issue the same collectives in the same order), then ``finish()`` after
    the last bucket. ``enabled = False`` (no_sync) makes the hooks do nothing."""

    def __init__(self, buckets, launch, finish):
        self.sizes = [len(b) for b in buckets]
        self.bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self.launch, self.finish, self.enabled = launch, finish, True
        self.reset()
        for b in buckets:
            for p in b:
                p.register_post_accumulate_grad_hook(self.ready)

    def reset(self):
        self.missing, self.next, self.active = list(self.sizes), 0, False

    def ready(self, p):
        if not self.enabled:
            return
        self.active = True
        self.missing[self.bucket_of[id(p)]] -= 1
        while self.next < len(self.sizes) and self.missing[self.next] == 0:
            self.launch(self.next)
            self.next += 1
        if self.next == len(self.sizes):
            self.flush()

    def flush(self):
        """Launch the buckets still waiting (a missing gradient counts as zero), then finish."""
        if not self.active:
            return
        while self.next < len(self.sizes):
            self.launch(self.next)
            self.next += 1
        self.finish()
        self.reset()


class GradBucket:
    """One bucket as a communication hook sees it, with torch's methods: ``buffer()`` (this
    rank's flat gradient, not yet reduced), ``index()``, ``parameters()``, ``gradients()`` (views
    of the buffer, one per parameter, in its shape) and ``is_last()``. Two attributes are
    minipar's own: ``comm``, the DDP's communicator (a hook whose state names none uses it), and
    ``algorithm``, the DDP's all-reduce algorithm."""

    def __init__(self, index, buffer, params, comm, algorithm="auto", last=True):
        self._index, self._buffer, self._params, self._last = index, buffer, list(params), last
        self.comm, self.algorithm = comm, algorithm

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def parameters(self):
        return list(self._params)

    def gradients(self):
        return views(self._buffer, self._params)

    def is_last(self):
        return self._last

    def __repr__(self):
        return (f"GradBucket(index={self._index}, {len(self._params)} parameters, "
                f"{self._buffer.size} {self._buffer.dtype} elements)")
