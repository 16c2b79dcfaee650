"""Data parallelism with all-reduce: every rank holds the whole model, sees 1/N of the batch, and
the ranks average their gradients before each step (Li et al. 2020, "PyTorch Distributed").

    model = DistributedDataParallel(net, comm, bucket_cap_mb=1)   # algorithm="auto"
    loss = loss_fn(model(x_local), y_local)   # the mean over this rank's local batch
    loss.backward()                           # buckets are averaged while backward goes on
    optimizer.step()                          # every rank applies the same averaged gradient

Gradients are grouped in buckets, each all-reduced on the communicator's background thread as
soon as backward has filled it (``overlap``, decided by ``comm.node.choose_overlap``), or
handed to a communication hook (``model.register_comm_hook(state, hook)``, torch's: compressed
averaging, ``parallel/data/hooks``). Why averaging equals serial training, when overlap pays,
and the hooks: docs/data_parallel.md.
"""
import contextlib

from ... import backend
from ...autograd import Tensor, is_grad_enabled
from ...comm import node, world
from ...comm.nonblocking import JobThread
from ...flat import views
from ...nn.module import Module
from .buckets import (GradBucket, ReadyQueue, broadcast_parameters, bucket_buffers,
                      make_buckets)


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
        self.module = module
        self.comm = comm or world()
        self.overlap, self.overlap_reason = node.choose_overlap(self.comm, overlap)
        self.algorithm = algorithm
        self.find_unused_parameters, self.unused = find_unused_parameters, []
        # Start: the ranks first compare their parameters' and buffers' names, shapes and dtypes
        # (a model built differently on one rank is the same ValueError on every rank, naming the
        # first difference, instead of a hang), then rank 0's values are copied everywhere.
        # Values that differed are overwritten and named (a warning by default;
        # on_mismatch="raise" refuses instead, with the same error on every rank).
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in self.named]
        self.buckets = make_buckets(params, bucket_cap_mb * 2**20)
        self.grad_buffers = bucket_buffers(self.buckets, self.comm, algorithm)
        self.views = {id(p): view  # p.grad lives here once ready
                      for b, buf in zip(self.buckets, self.grad_buffers)
                      for p, view in zip(b, views(buf, b))}
        self.arrived = set()
        for p in params:  # registered before the queue's hook, so it runs first
            p.register_post_accumulate_grad_hook(self._arrive)
        self.works = [None] * len(self.buckets)
        self.queue = ReadyQueue(self.buckets, self._launch, self._finish)
        self.comm_hook, self.started = None, False  # (hook, state); a backward has run

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
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        if self.started:
            raise RuntimeError("register_comm_hook must be called before the first backward: "
                               "the gradients already in the buckets were divided by N for the "
                               "built-in all-reduce, and a hook expects them undivided")
        if getattr(hook, "__name__", None) == "bf16_compress_hook":
            # torch refuses this hook here where its backend has no bfloat16; CuPy has none:
            # a TypeError now, not at the first backward
            backend.check_dtype("bfloat16")
        self.comm_hook = (hook, state)
        self.grad_buckets = [GradBucket(i, buf, b, self.comm, self.algorithm,
                                        last=i == len(self.buckets) - 1)
                             for i, (b, buf) in enumerate(zip(self.buckets, self.grad_buffers))]
        self.hook_thread = JobThread("minipar-comm-hook") if self.overlap else None

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        # A parameter that gets no gradient in a step never fills its bucket: this rank would
        # wait for ever, or step on un-averaged gradients while the others wait. So each forward
        # that records a graph (outside no_sync) walks the output's graph once and lists the
        # parameters it never reaches: a ValueError naming them, or, with
        # find_unused_parameters=True (torch's name), a zero gradient for them once backward
        # delivers its first gradient (as torch's reducer does), so every bucket still launches,
        # in the same order on every rank (a rank may even leave out what another uses: its
        # share of that gradient is zero).
        if is_grad_enabled() and self.queue.enabled:
            reached = reached_nodes(out)
            unused = [(n, p) for n, p in self.named if id(p) not in reached]
            if unused and not self.find_unused_parameters:
                raise ValueError(
                    f"rank {self.comm.rank}: DistributedDataParallel: the forward's output does "
                    f"not depend on {len(unused)} parameter(s) that require grad: "
                    f"{', '.join(repr(n) for n, _ in unused)}; their buckets would never be "
                    f"averaged and the ranks would wait on each other. Pass "
                    f"find_unused_parameters=True (their gradient then counts as zero), or set "
                    f"requires_grad=False on them before wrapping")
            self.unused = [p for _, p in unused]
            if len(unused) == len(self.named):  # no gradient will come to mark them: now
                self._mark_unused()
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally, no communication (gradient
        accumulation); the first backward outside it averages the sums."""
        self.queue.enabled = False
        try:
            yield
        finally:
            self.queue.enabled = True

    def synchronize(self):
        """Finish averaging this step's gradients, a missing gradient counting as zero (a no-op
        when backward already finished the job). Needed only when some parameter got none that
        forward's walk did not foresee: it sees what the output depends on, not what the loss
        does (a loss built from part of a tuple output, or backward through the module called
        directly, escapes it); then call it before ``optimizer.step()``."""
        self.queue.flush()

    def _arrive(self, p):
        """Post-accumulate hook: g/N into p's slice of its bucket, which becomes ``p.grad``."""
        self.started = True
        if self.queue.enabled:
            self._mark_unused()
            self._into_bucket(p)

    def _mark_unused(self):
        """The parameters this step's forward left out: zero gradient, ready (their buckets may
        launch; p's own is not ready yet, so the order stays the bucket order)."""
        unused, self.unused = self.unused, []
        for q in unused:
            self._into_bucket(q)
            self.queue.ready(q)

    def _into_bucket(self, p):
        view = self.views[id(p)]
        if p.grad is None:
            view[...] = 0  # no gradient this step counts as zero
        elif self.comm_hook is not None:
            view[...] = p.grad  # a hook gets the gradient undivided (torch's rule) and divides
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
            backend.get_array_module(view).divide(p.grad, self.comm.size, out=view)
        p.grad = view  # gradient as bucket view: the fresh array is freed
        self.arrived.add(id(p))

    def _launch(self, i):
        for p in self.buckets[i]:
            if id(p) not in self.arrived:  # got no gradient this step (only via flush)
                self._into_bucket(p)
        if self.overlap and self.comm_hook is not None:
            # the hook's own thread, in bucket order: its collectives (on this model's
            # communicator, idle in the main thread until backward ends) go in the same order
            # on every rank
            self.works[i] = self.hook_thread.start(self._run_hook, i)
        elif self.overlap:
            # on the communicator's background thread while backward computes the next layers
            # (NumPy and MPI drop the GIL, so the two really run together, given a free core);
            # the queue launches strictly in bucket order, so every rank issues the same
            # collectives in the same order
            buf = self.grad_buffers[i]
            self.works[i] = self.comm.iall_reduce(buf, op="sum", algorithm=self.algorithm, out=buf)

    def _finish(self):
        # After the last bucket's launch: once loss.backward() returns, every p.grad holds the
        # average. Without overlap the buckets are reduced here, one after another (the
        # benchmark's baseline).
        self.arrived.clear()
        works, self.works = self.works, [None] * len(self.buckets)
        for i, buf in enumerate(self.grad_buffers):
            if self.overlap:
                # a hook's error is raised here at once: the hook thread goes on with the next
                # buckets, whose messages then meet a peer still in this one (a CommError there
                # too, rather than a hang)
                works[i].wait()
            elif self.comm_hook is not None:
                self._run_hook(i)
            else:
                self.comm.all_reduce(buf, op="sum", algorithm=self.algorithm, out=buf)

    def _run_hook(self, i):
        """Bucket i averaged by the registered hook, the result left in its buffer."""
        hook, state = self.comm_hook
        result = hook(state, self.grad_buckets[i])
        if hasattr(result, "wait"):  # a Future or a Work, as torch's hooks return
            result = result.wait()
        buf = self.grad_buffers[i]
        if result is not buf:
            if getattr(result, "shape", None) != buf.shape:
                raise ValueError(f"rank {self.comm.rank}: communication hook "
                                 f"{getattr(hook, '__qualname__', hook)!r} returned "
                                 f"{type(result).__name__} of shape "
                                 f"{getattr(result, 'shape', None)} for bucket {i}; expected "
                                 f"the bucket's flat gradient, shape {buf.shape}")
            buf[...] = result  # cast back to the bucket's dtype where the hook compressed

    def gradient_bytes(self):
        """Bytes of gradient memory on this rank: the bucket buffers the gradients live in."""
        return sum(int(b.nbytes) for b in self.grad_buffers)


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
