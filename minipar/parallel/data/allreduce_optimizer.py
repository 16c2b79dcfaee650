"""Data parallelism as an optimizer: average the gradients over the data group with one
all-reduce, then step. It is the data-parallel reduction of the 3D trainer (Megatron-LM,
Narayanan et al. 2021), done once the pipeline has flushed.

Why one all-reduce after backward and not DDP's buckets during it: in a pipeline a stage's
gradients are complete only after the backward of its last micro-batch, so there is no backward
left to overlap with. The gradients are laid end to end in one flat buffer (``flatten_grads``;
missing ones count as zero) and all-reduced with op="avg", so every rank of the data group of
size D steps with

    g = (1/D) · sum_d g_d,

the gradient of the mean loss over the D shards of the batch. The buffer is allocated once and
after ``step`` every ``p.grad`` is a view of it (valid until the next step).

The same shape as ZeRO and ParameterServer, over a list of parameters (one pipeline stage's) or
a module:

    opt = AllReduceOptimizer(params, lambda ps: optim.AdamW(ps, lr=1e-3), data_comm)
    loss.backward(); opt.step(); opt.zero_grad()

Parameters are not broadcast: every rank of the data group builds them from the same seed, as
the 3D trainer does. With a data group of one rank it is just the optimizer.
"""
from ... import backend
from ...comm import world
from .buckets import flatten_grads, gradient_bytes, offsets


class AllReduceOptimizer:
    """``make_optimizer(params)``'s optimizer, stepping with the gradients averaged over ``comm``
    by all-reduce ``algorithm``; ``step()`` after ``backward()`` replaces optimizer.step()."""

    def __init__(self, params, make_optimizer, comm=None, algorithm="ring"):
        if hasattr(params, "parameters"):  # a module
            params = [p for p in params.parameters() if p.requires_grad]
        self.params, self.comm, self.algorithm = list(params), comm or world(), algorithm
        self.optimizer = make_optimizer(self.params)
        self.starts, total = offsets(self.params)
        self.flat = None  # the all-reduce buffer; none needed on a data group of one rank
        if self.comm.size > 1 and self.params:
            xp = backend.get_array_module(self.params[0].data)
            self.flat = xp.zeros(total, self.params[0].dtype)

    def step(self):
        """Average the gradients over the data group (one all-reduce), then step."""
        if self.flat is not None:
            flatten_grads(self.params, self.flat)
            self.comm.all_reduce(self.flat, op="avg", algorithm=self.algorithm, out=self.flat)
            for p, o in zip(self.params, self.starts):
                p.grad = self.flat[o:o + p.size].reshape(p.shape)
        self.optimizer.step()

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def memory_bytes(self):
        """Bytes this rank holds now: parameters, gradients (the flat buffer included) and
        optimizer state: every one of them whole on every rank, unlike ZeRO."""
        return {"parameters": sum(int(p.data.nbytes) for p in self.params),
                "gradients": gradient_bytes(self.params, [] if self.flat is None else [self.flat]),
                "optimizer_state": self.optimizer.state_bytes()}
