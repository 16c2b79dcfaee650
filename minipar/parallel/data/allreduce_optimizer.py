"""Data parallelism as an optimizer: average the gradients over the data group with one
all-reduce, then step: the data-parallel reduction of the 3D trainer (Megatron-LM, Narayanan et
al. 2021), done once the pipeline has flushed. Theory: docs/data_parallel.md.

    opt = AllReduceOptimizer(params, lambda ps: optim.AdamW(ps, lr=1e-3), data_comm)
    loss.backward(); opt.step(); opt.zero_grad()

The same shape as ZeRO and ParameterServer, over a list of parameters (one pipeline stage's) or
a module. Parameters are not broadcast: every rank of the data group builds them from the same
seed, as the 3D trainer does. With a data group of one rank it is just the optimizer.
"""
from ... import backend
from ...comm import world
from ...flat import flatten_grads, offsets, views
from .buckets import gradient_bytes


def mean_op(grad, comm):
    """The reduction op that averages ``grad`` over ``comm``: "avg", or for a 16-bit
    gradient "sum" after dividing it in place, as DDP does: float16 ends at 65504 and a sum of N
    gradients can overflow where their mean does not (the reduction adds in float32, rounds to
    16 bits once per hop: docs/zero.md)."""
    if not backend.is_low_precision(grad.dtype):
        return "avg"
    grad /= comm.size
    return "sum"


def average_grads(params, flat, comm, algorithm, scale=1.0):
    """Lay the params' gradients end to end in ``flat`` (a missing one counts as zero), average
    them over ``comm`` with one all-reduce, times ``scale``; every ``p.grad`` is then a view of
    ``flat`` (valid until the next call)."""
    flatten_grads(params, flat)
    if comm.size > 1:
        # g = (1/D) · sum_d g_d over the D ranks of the data group: the gradient of the mean
        # loss over their D shards of the batch
        comm.all_reduce(flat, op=mean_op(flat, comm), algorithm=algorithm, out=flat)
    if scale != 1.0:
        flat *= scale
    for p, grad in zip(params, views(flat, params)):
        p.grad = grad


def optimizer_memory(optimizer):
    """The bytes of the optimizer's own arrays by kind: "master" (float32 copies of 16-bit
    parameters) and "moments" (every other state array); None holds none. Not its "params"
    and "grads": a wrapper's are the parameters and gradients the optimizer steps (or views
    of them), counted by the wrapper once."""
    held = optimizer.memory_bytes() if optimizer is not None else {"master": 0, "moments": 0}
    return {"master": held["master"], "moments": held["moments"]}


class AllReduceOptimizer:
    """``make_optimizer(params)``'s optimizer, stepping with the gradients averaged over ``comm``
    by all-reduce ``algorithm``; ``step()`` after ``backward()`` replaces optimizer.step()."""

    def __init__(self, params, make_optimizer, comm=None, algorithm="ring"):
        if hasattr(params, "parameters"):  # a module
            params = [p for p in params.parameters() if p.requires_grad]
        self.params, self.comm, self.algorithm = list(params), comm or world(), algorithm
        self.optimizer = make_optimizer(self.params)
        self.flat = None  # the all-reduce buffer, allocated once; none on a group of one rank
        if self.comm.size > 1 and self.params:
            xp = backend.get_array_module(self.params[0].data)
            self.flat = xp.zeros(offsets(self.params)[1], self.params[0].dtype)

    def step(self):
        """Average the gradients over the data group (one all-reduce), then step."""
        # One all-reduce after backward, not DDP's buckets during it: in a pipeline a stage's
        # gradients are complete only after the backward of its last micro-batch, so there is
        # no backward left to overlap with.
        if self.flat is not None:
            average_grads(self.params, self.flat, self.comm, self.algorithm)
        self.optimizer.step()

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def memory_bytes(self):
        """Bytes this rank holds now, by kind as ZeRO's ``memory_bytes``: parameters, gradients
        (the flat buffer included) and optimizer state (master, moments): every one of them
        whole on every rank, unlike ZeRO."""
        return {"parameters": sum(int(p.data.nbytes) for p in self.params),
                "gradients": gradient_bytes(self.params, [] if self.flat is None else [self.flat]),
                **optimizer_memory(self.optimizer)}
