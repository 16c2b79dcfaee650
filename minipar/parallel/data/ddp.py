"""Data parallelism with all-reduce: every rank holds the whole model, sees 1/N of the batch, and
the ranks average their gradients before each step (Li et al. 2020, "PyTorch Distributed").

    model = DistributedDataParallel(net, comm, bucket_cap_mb=1)   # algorithm="auto"
    loss = loss_fn(model(x_local), y_local)   # the mean over this rank's local batch
    loss.backward()                           # buckets are averaged while backward goes on
    optimizer.step()                          # every rank applies the same averaged gradient

Why averaging is right. With equal local batches of b samples, the gradient of the global mean
loss (1/Nb) sum_i l_i is (1/N) sum_r [(1/b) sum_{i in r} l_i]': the average over ranks of each
rank's local-mean gradient. So N ranks take exactly the steps serial training takes on the
global batch (up to rounding); unequal local batches would need weights b_r / B instead, which
is why ``sampler.local_batch_size`` refuses a global batch that does not divide.

Start. ``broadcast_parameters`` copies rank 0's parameters and buffers to every rank: values
that differ elsewhere are OVERWRITTEN, and they are also detected: the names that differed are
kept in ``model.mismatched`` and, by default, a warning names them (``on_mismatch="raise"``
refuses instead, with the same error on every rank).

Buckets (the overlap). Gradients become ready roughly in reverse parameter order (the last layer
first), so parameters are grouped in reverse order into buckets of about ``bucket_cap_mb``, each
with one contiguous buffer. A parameter's post-accumulate-grad hook writes g/N into its slice of
the bucket (the copy and the averaging in one pass, as PyTorch DDP pre-divides) and makes that
slice ``p.grad`` (gradient as bucket view: the fresh array is freed). When a bucket is full it is
handed to ``comm.iall_reduce`` (sum), which runs on the communicator's background thread while
backward computes the next layers (NumPy and MPI drop the GIL, so the two really run together,
given a free core: with as many busy ranks as cores the copies take compute's CPU time, overlapped
or not; see scripts/bench_dp.py). Buckets are launched strictly in bucket order, so every rank
issues the same collectives in the same order. When the last bucket has been launched, the hook
waits for all of them: once ``loss.backward()`` returns, every ``p.grad`` holds sum_r g_r/N (the
average, exactly so when N is a power of two, to rounding otherwise). ``overlap=False``
keeps the buckets but reduces them one after another once backward has ended (the benchmark's
baseline).

When overlap pays. The background all-reduce is CPU work (copies, adds, MPI polling for the
peer), so it hides behind backward only on a core that backward does not use. The default,
``overlap="auto"``, decides per configuration with ``overlap_default``: on when every node has
more usable cores than ranks on it, off when some node has none idle (then overlap takes
compute's core and costs more than it hides). ``model.overlap`` is the choice and
``model.overlap_reason`` says why, in numbers; scripts/bench_dp.py and lesson 05 measure the
step with overlap on against off in the configuration they run in.

Inside ``with model.no_sync():`` gradients only accumulate locally (gradient accumulation); the
first backward outside it averages the sums.

Agreement. Before the broadcast the ranks compare their parameters' and buffers' names, shapes
and dtypes (``check_same_layout``): a model built differently on one rank is the same ValueError
on every rank, naming the first difference, instead of a hang.

Unused parameters. A parameter that gets no gradient in a step never fills its bucket: this rank
would wait for ever, or step on un-averaged gradients while the others wait. So each forward
(when it records a graph, outside ``no_sync``) walks the output's graph once, from every Tensor
in it, and lists the parameters it never reaches. By default that is a ValueError naming them;
with ``find_unused_parameters=True`` (torch's name) they are marked ready with a zero gradient
when backward delivers its first gradient (as torch's reducer does), so every bucket still
launches, in the same order on every rank (a rank may even leave out what another uses: its
share of that gradient is zero). The walk sees what the output depends on, not what the loss
does: a loss built from part of a tuple output, or backward through the module called directly,
escapes it; then call ``model.synchronize()`` before ``optimizer.step()``: it launches what is
left, counting missing gradients as zero (a no-op when backward already finished the job).
"""
import contextlib
import os
import socket

from ... import backend
from ...autograd import Tensor, is_grad_enabled
from ...comm import world
from ...nn.module import Module
from .buckets import ReadyQueue, broadcast_parameters, bucket_buffers, make_buckets, offsets


class DistributedDataParallel(Module):
    """Wrap ``module``: rank 0's parameters everywhere, gradients averaged over ``comm`` in
    buckets of ``bucket_cap_mb`` with all-reduce ``algorithm`` (any of ``comm.ALGORITHMS``;
    ``"auto"``, the default, lets the cost model pick per bucket: on one node the shared-memory
    all-reduce, which reduces the buckets where backward wrote them),
    overlapping backward when ``overlap`` (``"auto"``: where a core is idle, see
    ``overlap_default``); ``find_unused_parameters`` lets a forward leave some
    parameters out (zero gradient). See the module docstring for the contract."""

    def __init__(self, module, comm=None, bucket_cap_mb=25.0, algorithm="auto", overlap="auto",
                 on_mismatch="warn", find_unused_parameters=False):
        super().__init__()
        self.module = module
        self.comm = comm or world()
        if overlap not in (True, False, "auto"):
            raise ValueError(f"rank {self.comm.rank}: DistributedDataParallel: overlap must be "
                             f"True, False or 'auto', got {overlap!r}")
        self.overlap, self.overlap_reason = overlap_default(self.comm) if overlap == "auto" else (
            overlap, f"overlap={overlap} given")
        self.algorithm = algorithm
        self.find_unused_parameters, self.unused = find_unused_parameters, []
        self.mismatched = broadcast_parameters(module, self.comm, on_mismatch)
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in self.named]
        self.buckets = make_buckets(params, bucket_cap_mb * 2**20)
        # in shared memory on one node, for the algorithms that read buckets there
        self.grad_buffers = bucket_buffers(
            self.buckets, self.comm, shared=None if algorithm in ("auto", "shm") else False)
        self.views = {id(p): buf[o:o + p.size].reshape(p.shape)  # p.grad lives here once ready
                      for b, buf in zip(self.buckets, self.grad_buffers)
                      for p, o in zip(b, offsets(b)[0])}
        self.arrived = set()
        for p in params:  # registered before the queue's hook, so it runs first
            p.register_post_accumulate_grad_hook(self._arrive)
        self.works = [None] * len(self.buckets)
        self.queue = ReadyQueue(self.buckets, self._launch, self._finish)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
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
        """Backward inside accumulates gradients locally; no communication."""
        self.queue.enabled = False
        try:
            yield
        finally:
            self.queue.enabled = True

    def synchronize(self):
        """Finish averaging this step's gradients (needed only when some parameter got none)."""
        self.queue.flush()

    def _arrive(self, p):
        """Post-accumulate hook: g/N into p's slice of its bucket, which becomes ``p.grad``."""
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
        else:
            backend.get_array_module(view).divide(p.grad, self.comm.size, out=view)
        p.grad = view
        self.arrived.add(id(p))

    def _launch(self, i):
        for p in self.buckets[i]:
            if id(p) not in self.arrived:  # got no gradient this step (only via flush)
                self._into_bucket(p)
        if self.overlap:
            buf = self.grad_buffers[i]
            self.works[i] = self.comm.iall_reduce(buf, op="sum", algorithm=self.algorithm, out=buf)

    def _finish(self):
        for i, buf in enumerate(self.grad_buffers):
            if self.overlap:
                self.works[i].wait()
                self.works[i] = None
            else:
                self.comm.all_reduce(buf, op="sum", algorithm=self.algorithm, out=buf)
        self.arrived.clear()

    def gradient_bytes(self):
        """Bytes of gradient memory on this rank: the bucket buffers the gradients live in."""
        return sum(int(b.nbytes) for b in self.grad_buffers)


LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")  # the job's ranks on this node


def overlap_default(comm):
    """(overlap, why) for ``overlap="auto"``: on when every node has a usable core that none of
    the job's ranks uses (for the background all-reduce), else off. Usable cores are the CPU
    affinity masks of ``comm``'s ranks on the node together (``os.sched_getaffinity``, else
    ``os.cpu_count``); the ranks are the job's on the node as the launcher tells them (MPICH's
    MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE: a DDP over a sub-group shares the
    node with the other groups), else ``comm``'s. One ``all_gather_object``, so every rank takes
    the same decision (blocking and non-blocking collectives must not meet)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(
        os.cpu_count() or 1)
    job = max([int(os.environ[v]) for v in LOCAL_SIZE if os.environ.get(v, "").isdigit()] or [0])
    nodes = {}
    for host, mask, local in comm.all_gather_object((socket.gethostname(), sorted(cores), job)):
        ranks, usable, most = nodes.get(host, (0, set(), 0))
        nodes[host] = ranks + 1, usable | set(mask), max(most, local)
    nodes = [(max(ranks, most), usable) for ranks, usable, most in nodes.values()]
    ranks, usable = max(nodes, key=lambda node: node[0] - len(node[1]))
    idle = len(usable) - ranks
    if idle > 0:
        return True, (f"overlap on: {ranks} rank(s) on {len(usable)} usable cores leave {idle} "
                      f"idle for the background all-reduce")
    return False, (f"overlap off: {ranks} rank(s) on {len(usable)} usable cores leave no core "
                   f"idle, so the background all-reduce would take compute's core (overlap=True "
                   f"forces it; scripts/bench_dp.py measures both)")


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
