"""Data parallelism with all-reduce: every rank holds the whole model, sees 1/N of the batch, and
the ranks average their gradients before each step (Li et al. 2020, "PyTorch Distributed").

    model = DistributedDataParallel(net, comm, bucket_cap_mb=1)   # algorithm="auto"
    loss = loss_fn(model(x_local), y_local)   # the mean over this rank's local batch
    loss.backward()                           # buckets are averaged while backward goes on
    optimizer.step()                          # every rank applies the same averaged gradient

One post-accumulate hook per parameter (``_ready``) writes its gradient into its bucket and
launches each complete bucket's averaging, in bucket order; the last one waits. ``AllReduce``
(below) averages a bucket with one all-reduce; beside it, averaging.py's overlap on a
background thread (``overlap``, decided by ``comm.node.choose_overlap``) and communication hooks
(``model.register_comm_hook(state, hook)``, torch's: compressed averaging, hooks/). Why
averaging equals serial training, when overlap pays, and the hooks: docs/data_parallel.md.
"""
import contextlib

from ... import backend
from ...autograd import Tensor, is_grad_enabled
from ...comm import node, world
from ...flat import views
from ...nn.module import Module
from .averaging import CommHook, Overlapped, OverlappedCommHook
from .buckets import broadcast_parameters, bucket_buffers, make_buckets


class DistributedDataParallel(Module):
    """Wrap ``module``: rank 0's parameters everywhere, gradients averaged over ``comm`` in
    buckets of ``bucket_cap_mb`` with all-reduce ``algorithm`` (any of ``comm.ALGORITHMS``;
    ``"auto"``, the default, lets the cost model pick per bucket: on one node the shared-memory
    all-reduce, which reduces the buckets where backward wrote them),
    overlapping backward when ``overlap`` (``"auto"``: where a core is idle, see
    ``comm.node.overlap_default``); ``find_unused_parameters`` lets a forward leave some
    parameters out (zero gradient). ``model.overlap`` is the choice, ``model.overlap_reason``
    says why, in numbers; ``model.mismatched`` the names that differed from rank 0's."""

    def __init__(self, module, comm=None, bucket_cap_mb=25.0, algorithm="auto", overlap="auto",
                 on_mismatch="warn", find_unused_parameters=False):
        super().__init__()
        self.module, self.comm, self.algorithm = module, comm or world(), algorithm
        self.overlap, self.overlap_reason = node.choose_overlap(self.comm, overlap)
        self.find_unused_parameters, self.unused = find_unused_parameters, []
        # Start: the ranks first compare their parameters' and buffers' names, shapes and dtypes
        # (a model built differently on one rank is the same ValueError on every rank, naming the
        # first difference, instead of a hang), then rank 0's values are copied everywhere.
        # Values that differed are overwritten and named (a warning by default;
        # on_mismatch="raise" refuses instead, with the same error on every rank).
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.buckets = make_buckets([p for _, p in self.named], bucket_cap_mb * 2**20)
        self.grad_buffers = bucket_buffers(self.buckets, self.comm, algorithm)
        self.views = {id(p): view  # p.grad lives here once ready
                      for b, buf in zip(self.buckets, self.grad_buffers)
                      for p, view in zip(b, views(buf, b))}
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.averaging = (Overlapped if self.overlap else AllReduce)(self.comm, algorithm,
                                                                     self.grad_buffers)
        self.divisor = self.comm.size  # g/N into the bucket, then the all-reduce sums
        self.syncing, self.started = True, False  # (off inside no_sync); a backward has run
        self._reset()
        for _, p in self.named:
            p.register_post_accumulate_grad_hook(self._ready)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        # A parameter that gets no gradient in a step never fills its bucket: this rank would
        # wait for ever, or step on un-averaged gradients while the others wait. So each forward
        # that records a graph (outside no_sync) lists the parameters its output never reaches
        # (``unused_parameters``), which then count as zero once backward delivers its first
        # gradient (as torch's reducer does), so every bucket still launches, in the same order
        # on every rank (a rank may even leave out what another uses: its share is zero).
        if is_grad_enabled() and self.syncing:
            self.unused = unused_parameters(out, self.named, self.find_unused_parameters,
                                            self.comm.rank)
            if len(self.unused) == len(self.named):  # no gradient will come to count them: now
                self._flush()
        return out

    def _ready(self, p):
        """Post-accumulate hook: p's gradient into its bucket, then every complete bucket is
        averaged, strictly in bucket order (so every rank issues the same collectives in the
        same order); after the last one, the wait."""
        self.started = True
        if not self.syncing:
            return
        self._take_unused()
        self._into_bucket(p)
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self.averaging.launch(self.next)
            self.next += 1
        if self.next == len(self.buckets):
            self._finish()

    def _into_bucket(self, p):
        view = self.views[id(p)]
        if p.grad is None:
            view[...] = 0  # no gradient this step counts as zero
        else:
            # Why averaging is right: with equal local batches, the gradient of the global mean
            # loss is the average over ranks of each rank's local-mean gradient, so N ranks take
            # the steps serial training takes on the global batch (docs/data_parallel.md). g/N
            # is written straight into the bucket (the copy and the averaging in one pass, as
            # PyTorch DDP pre-divides) and the all-reduce sums: sum_r g_r/N, exact when N is a
            # power of two, to rounding otherwise. In 16 bits dividing first matters: float16
            # ends at 65504, and a sum of N gradients can overflow where their mean would not
            # (torch's fp16 compression hook divides first for this reason); the bucket stays
            # 16-bit, so it travels as 2-byte messages, added in float32 (docs/comm.md).
            backend.get_array_module(view).divide(p.grad, self.divisor, out=view)
        p.grad = view  # gradient as bucket view: the fresh array is freed
        self.arrived.add(id(p))
        self.missing[self.bucket_of[id(p)]] -= 1

    def _finish(self):
        """After the last bucket's launch: once loss.backward() returns, every p.grad holds the
        average."""
        self._reset()
        self.averaging.wait()

    def _reset(self):
        self.missing, self.next, self.arrived = [len(b) for b in self.buckets], 0, set()

    def _take_unused(self):
        """The parameters this step's forward left out: zero gradient, in their buckets."""
        unused, self.unused = self.unused, []
        for q in unused:
            self._into_bucket(q)

    def _flush(self):
        """Every bucket still waiting launched, a missing gradient counting as zero; the wait."""
        self._take_unused()
        for _, p in self.named:
            if id(p) not in self.arrived:
                self._into_bucket(p)
        while self.next < len(self.buckets):
            self.averaging.launch(self.next)
            self.next += 1
        self._finish()

    def synchronize(self):
        """Finish averaging this step's gradients, a missing gradient counting as zero (a no-op
        when backward already finished the job). Needed only when some parameter got none that
        forward's walk did not foresee: it sees what the output depends on, not what the loss
        does (a loss built from part of a tuple output, or backward through the module called
        directly, escapes it); then call it before ``optimizer.step()``."""
        if self.arrived:
            self._flush()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally, no communication (gradient
        accumulation); the first backward outside it averages the sums."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def register_comm_hook(self, state, hook):
        """Average each bucket with ``hook(state, bucket)`` instead of the all-reduce (torch's
        interface): ``bucket`` is a ``GradBucket`` whose ``buffer()`` holds this rank's gradient
        *not* divided by N (the hook divides, as torch's do); the hook returns the averaged flat
        gradient, or an object whose ``wait()`` gives it. ``state`` is the hook's own (a
        Communicator or None for the default hooks: None means ``bucket.comm``, this model's).
        Once, before the first backward. The hooks run in bucket order, on a background thread
        when ``overlap``, so every rank calls the same collectives in the same order."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        # torch's two rules, with its message for the first (a second hook would silently
        # replace the first one's state, its error feedback with it)
        if isinstance(self.averaging, CommHook):
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        if self.started:
            raise RuntimeError("register_comm_hook must be called before the first backward: "
                               "the gradients already in the buckets were divided by N for the "
                               "built-in all-reduce, and a hook expects them undivided")
        self.averaging = (OverlappedCommHook if self.overlap else CommHook)(
            hook, state, self.comm, self.algorithm, self.buckets, self.grad_buffers)
        self.divisor = 1  # a hook gets the gradient undivided (torch's rule) and divides

    def gradient_bytes(self):
        """Bytes of gradient memory on this rank: the bucket buffers the gradients live in."""
        return sum(int(b.nbytes) for b in self.grad_buffers)


class AllReduce:
    """A complete bucket averaged at once: one all-reduce of its g/N, a sum, while backward
    waits (no overlap). averaging.py holds the others, with these two methods."""

    def __init__(self, comm, algorithm, buffers):
        self.comm, self.algorithm, self.buffers = comm, algorithm, buffers

    def launch(self, i):
        buf = self.buffers[i]
        self.comm.all_reduce(buf, op="sum", algorithm=self.algorithm, out=buf)

    def wait(self):
        """Nothing left: each bucket was averaged at its launch."""


def unused_parameters(out, named, allowed, rank):
    """The parameters of ``named`` (name, parameter) that ``out`` does not depend on; a
    ValueError naming them unless ``allowed`` (``find_unused_parameters``)."""
    reached = reached_nodes(out)
    unused = [(n, p) for n, p in named if id(p) not in reached]
    if unused and not allowed:
        raise ValueError(
            f"rank {rank}: DistributedDataParallel: the forward's output does not depend on "
            f"{len(unused)} parameter(s) that require grad: "
            f"{', '.join(repr(n) for n, _ in unused)}; their buckets would never be averaged and "
            f"the ranks would wait on each other. Pass find_unused_parameters=True (their "
            f"gradient then counts as zero), or set requires_grad=False on them before wrapping")
    return [p for _, p in unused]


def reached_nodes(out):
    """ids of every graph node that the Tensors in ``out`` (a Tensor, or a tuple, list or dict of
    them, nested) depend on, their leaves included: one pass over the graph."""
    stack, seen, outputs = [], set(), [out]
    while outputs:
        o = outputs.pop()
        if isinstance(o, Tensor):
            stack.append(o)
        elif isinstance(o, (tuple, list)):
            outputs.extend(o)
        elif isinstance(o, dict):
            outputs.extend(o.values())
    while stack:
        node = stack.pop()
        if node.requires_grad and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node._parents)
    return seen
