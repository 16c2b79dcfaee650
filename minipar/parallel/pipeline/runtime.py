"""The pipeline runtime: one executor runs any schedule, each rank walking its own list of actions.

    pipe = Pipeline(model, build("1f1b", p, m), comm, loss_fn, optimizer=lambda ps: SGD(ps, 0.1))
    loss = pipe.step(x, y)        # one training step: m micro-batches through the p ranks

Stages. ``model`` is a ``Sequential`` built the same way on every rank (same seed); it is cut into
S = p*v contiguous stages (``bounds``, default equal layer counts, see partition.py) and rank r
keeps the stages the schedule places there (r, r+p, ...; ZB-V's r and 2p-1-r: actions.py) as its
chunks 0, 1, .... ``Pipeline.action_table`` gives
each kind of action the method that runs it on the step's ``StepState`` (x_in, dy_in, ...):

    RECV_F  receive a header (dtype, shape), then the activation of (stage, mb) into x_in
    F       y = stage(x) on a fresh leaf x (from x_in; stage 0: the micro-batch); at the last
            stage y is the micro-batch's loss (with re-materialisation under no_grad: only x is kept)
    R       re-run F with its graph from the kept x, the random stream rewound (dropout)
    SEND_F  isend the header and y
    RECV_B  receive dL/dy into dy_in: the shape of the y this rank computed, so no header is needed
    B       backward from (y, dL/dy) to dL/dx (into dx_out) and, unless W is separate, dL/dW
    W       zero bubble: dL/dW alone, from what B kept (see below)
    SEND_B  isend dL/dx from dx_out
    OPT_STEP   complete the pending sends, then optimizer.step()

When two consecutive stages share a rank (p = 1; stages p-1 and p of ZB-V), F puts y straight
into the next stage's x_in and B puts dL/dx into the previous stage's dy_in: no message.

Sends are posted with ``isend`` and completed at the OPT_STEP (or the end of the step), receives
block: the contract of schedules.py, which ``validate`` (run before anything else, once the
ranks have checked they share the schedule, bounds and layers: agreement.py) proves
deadlock-free. Messages carry the tag ``message_tag``, a header and its activation share it
(MPI keeps messages of one sender and tag in order).

Loss scaling. Synchronous schedules: micro-batch k holds n_k of the N samples and its loss is
``loss_fn(y_k, t_k) * n_k / N``, so, ``loss_fn`` being a mean over samples, the gradients summed
over the m micro-batches are the full batch's: the serial model's, whatever m is. They are
applied once, at OPT_STEP, and kept until the next step (for inspection).

Splitting B and W (Zero Bubble, Qi et al. 2023; graph.py's ``WeightPass``). B runs the chain
rule with the stage's parameters deferred: every gradient but theirs, down to dL/dx; each op that
a parameter feeds (a Linear: y = x W^T + b) keeps its output gradient g and its saved input,
and the rest of the graph is freed. W calls only those ops' weight-gradient functions
(dW = g^T x, db = sum g) and frees them: B + W is one backward's arithmetic, not two, and
between B and W a micro-batch holds only the layer inputs and output gradients W needs.

PipeDream (asynchronous). Each micro-batch is its own SGD step (loss unscaled) and OPT_STEP
follows every B. Weight stashing: an update writes into a fresh copy of the weights, so the
arrays a micro-batch's forward used stay alive, and its B runs with them swapped back in
(``Action.version``, weight_stash.py); a version is dropped after its last backward. ``versions_used``
records, per (stage, mb), the version F found live and the one B swapped in.

Counters, per step in ``stats``: ``peak_live`` (most micro-batches whose activations this rank
holds: from the start of F to the end of B, or during F and from R to B with
re-materialisation), ``peak_bytes`` (``ActivationMemory``, when ``memory=True``). With
``trace=True`` every action is recorded as a timeline Event (``events``), after a
barrier; ``delay(action)`` seconds, if given, is the least time an action takes: a waiting
kernel that sleeps the rest, so p ranks can run side by side on fewer cores.
"""
import contextlib
import time

from minipar import backend, random
from minipar.autograd import Tensor, set_grad_enabled, run_backward
from minipar.graph import WeightPass
from minipar.checkpoint import recomputing
from minipar.comm.watch import state as watched  # a hang names the action and micro-batch
from minipar.memory import ActivationMemory
from minipar.nn import Sequential

from .agreement import agreed_bounds, check_targets, split_batch
from .partition import split_layers
from .schedules import B, F, OPT_STEP, R, RECV_B, RECV_F, SEND_B, SEND_F, W, message_tag
from .timeline import Tracer, gather_events  # noqa: F401 (gather_events was defined here)
from .validate import validate
from .weight_stash import WeightStash

HEADER = 8  # int64 words before an activation: dtype character, ndim, up to 6 dimensions


class StepState:
    """What one step holds, made fresh by ``Pipeline.step``; the dicts are keyed by (stage, mb).

    Values on their way from one action to another, each where its consumer looks for it:
        x_in      the activation an F waits for: received by RECV_F, or handed over by the
                  previous stage's F when that stage lives on this rank too (p = 1)
        dy_in     the output gradient dL/dy a B waits for: received by RECV_B, or handed over by
                  the next stage's B on this rank
        dx_out    the input gradient dL/dx a B computed, waiting for its SEND_B
        weight_pass   what a split B left for its W (graph.WeightPass)
    What F leaves for R, SEND_F, B and W: ``inputs`` (the leaf x), ``outputs`` (y, at the last
    stage the scaled loss) and ``rng`` (the random state F began with). PipeDream's stashed
    weight versions: ``weight_stash`` (weight_stash.py).
    """

    def __init__(self, x=None, y=None, scale=None, weight_stash=None):
        self.x, self.y, self.scale = x, y, scale  # this step's micro-batches, each loss's factor
        self.x_in, self.dy_in, self.dx_out, self.weight_pass = {}, {}, {}, {}
        self.inputs, self.outputs, self.rng = {}, {}, {}
        self.sends, self.losses, self.live, self.peak_live = [], [], 0, 0
        self.weight_stash = weight_stash or WeightStash()

    def count(self, change):
        """Micro-batches whose activations are held: +1 when F (or R) starts, -1 after B."""
        self.live += change
        self.peak_live = max(self.peak_live, self.live)

    def complete_sends(self):
        for request in self.sends:
            request.wait()
        self.sends = []


class Pipeline:
    """This rank's stages of ``model`` and an executor for ``schedule`` (module docstring)."""

    def __init__(self, model, schedule, comm, loss_fn, optimizer=None, bounds=None, delay=None,
                 trace=False, memory=False):
        layers = list(model)  # every rank: the same schedule, bounds, layers (agreement.py)
        self.bounds = agreed_bounds(comm, schedule, layers, bounds)
        self.schedule = validate(schedule)  # a broken schedule stops here, on every rank
        if comm.size != schedule.ranks:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} ranks but the "
                             f"communicator has {comm.size}")
        self.comm, self.rank, self.loss_fn = comm, comm.rank, loss_fn
        self.n_stages = schedule.n_stages
        if len(self.bounds) != self.n_stages:
            raise ValueError(f"{len(self.bounds)} stage bounds for {self.n_stages} stages")
        stages = split_layers(layers, self.bounds)
        mine = schedule.stages_of(self.rank)  # stage s % p, or in a V r and 2p-1-r
        self.stages = {s: Sequential(*stages[s]) for s in mine}
        self.params = [q for stage in self.stages.values() for q in stage.parameters()]
        self.optimizer = optimizer(self.params) if optimizer and self.params else None
        self.delay, self.trace, self.memory = delay, trace, memory
        self.events, self.stats, self.state = [], {}, StepState()
        # The action table: each kind of action and the method that runs it (module docstring).
        self.action_table = {RECV_F: self._recv_f, F: self._forward, R: self._recompute,
                             SEND_F: self._send_f, RECV_B: self._recv_b, B: self._backward,
                             W: self._weight_grad, SEND_B: self._send_b, OPT_STEP: self._opt_step}

    def parameters(self):
        return list(self.params)

    @property
    def versions_used(self):
        """PipeDream, last step: (stage, mb) -> (the version F found live, the one B swapped in)."""
        return self.state.weight_stash.versions_used

    @property
    def stash(self):
        """PipeDream, last step: weight versions still stashed (none once every B has run)."""
        return self.state.weight_stash.kept

    # --- one step -------------------------------------------------------------------------------
    def step(self, x=None, y=None):
        """Run this rank's actions for one batch; ``x`` is needed where stage 0 lives, ``y`` where
        the last stage lives. Returns the batch loss there (PipeDream: the mean micro-batch loss),
        None elsewhere: a 0-d float64 array on the device, summed there with no host read per
        micro-batch (``float(loss)`` reads it; on NumPy it already is a float)."""
        m = self.schedule.microbatches
        first, last = 0 in self.stages, self.n_stages - 1 in self.stages
        xs, ys = split_batch(x, y, m, self.rank, first, last)  # agreement.py: clear errors
        scale = [1.0] * m if self.schedule.asynchronous or y is None else [len(t) / len(y) for t in ys]
        s = self.state = StepState(xs, ys, scale, WeightStash(self.params, self.rank))
        for q in self.params:
            q.grad = None
        tracer = None
        if self.trace:
            self.comm.barrier()
            tracer = Tracer(self.rank)
        with (ActivationMemory() if self.memory else contextlib.nullcontext()) as mem:
            for a in self.schedule.actions[self.rank]:
                with tracer.record(a.kind, a.mb, a.chunk) if tracer else contextlib.nullcontext():
                    start, watched["action"] = time.perf_counter(), f"pipeline action {a}"
                    self.action_table[a.kind](a, s)
                    rest = self.delay(a) - (time.perf_counter() - start) if self.delay else 0
                    if rest > 0:  # the waiting kernel: sleep out the rest of the action's cost
                        time.sleep(rest)
        s.complete_sends()
        watched["action"] = None
        self.events = tracer.events if tracer else []
        self.stats = {"peak_live": s.peak_live, "peak_bytes": mem.peak_bytes if mem else None}
        if self.n_stages - 1 not in self.stages:
            return None
        return sum(s.losses) / (m if self.schedule.asynchronous else 1)

    # --- compute --------------------------------------------------------------------------------
    def _run_stage(self, a, x, s):
        y = self.stages[a.stage](x)
        if a.stage == self.n_stages - 1:
            check_targets(y, s.y[a.mb], a.stage, a.mb, self.rank)
            y = self.loss_fn(y, Tensor(s.y[a.mb])) * s.scale[a.mb]
        return y

    def _forward(self, a, s):
        key = (a.stage, a.mb)
        x = Tensor(s.x[a.mb] if a.stage == 0 else s.x_in.pop(key))
        if a.stage > 0:
            x.requires_grad_(True)
        s.inputs[key], s.rng[key] = x, random.get_rng_state()
        s.weight_stash.note(a)
        s.count(+1)
        with set_grad_enabled(not self.schedule.remat):
            y = s.outputs[key] = self._run_stage(a, x, s)
        if self.schedule.remat:
            s.count(-1)
        if a.stage == self.n_stages - 1:
            s.losses.append(y.data.astype("float64"))  # stays on the device
        elif self.schedule.rank_of(a.stage + 1) == self.rank:  # the next stage is here (p = 1)
            s.x_in[(a.stage + 1, a.mb)] = y.data

    def _recompute(self, a, s):
        """Re-materialise: the forward again, with its graph, from the kept input."""
        key = (a.stage, a.mb)
        with recomputing(s.rng[key]):  # dropout's masks again; BatchNorm's statistics once
            s.count(+1)
            s.outputs[key] = self._run_stage(a, s.inputs[key], s)

    def _backward(self, a, s):
        key = (a.stage, a.mb)
        y, x = s.outputs[key], s.inputs[key]
        last = a.stage == self.n_stages - 1
        dy = backend.xp().ones_like(y.data) if last else s.dy_in.pop(key)
        weights = None
        if self.schedule.split_backward:  # dL/dW deferred to W (the module docstring)
            weights = s.weight_pass[key] = WeightPass(self.stages[a.stage].parameters())
        with s.weight_stash.swapped_in(a):
            run_backward([y], [dy], defer=weights)
        del s.outputs[key], s.inputs[key]
        s.count(-1)
        if a.stage > 0 and self.schedule.rank_of(a.stage - 1) == self.rank:
            s.dy_in[(a.stage - 1, a.mb)] = x.grad  # the previous stage is here (p = 1)
        elif a.stage > 0:
            s.dx_out[key] = x.grad

    def _weight_grad(self, a, s):
        s.weight_pass.pop((a.stage, a.mb)).run()

    def _opt_step(self, a, s):
        if not self.schedule.asynchronous:
            s.complete_sends()
            if self.optimizer:
                self.optimizer.step()
            return
        # PipeDream: the update writes into fresh arrays; the old ones stay stashed if needed
        for q in self.params:
            q.data = q.data.copy()
        if self.optimizer:
            self.optimizer.step()
            self.optimizer.zero_grad()
        s.weight_stash.version = a.version

    # --- messages -------------------------------------------------------------------------------
    def _tag(self, a):
        return message_tag(a, self.n_stages)

    def _recv_f(self, a, s):
        host = backend.get_array_module()
        header = self.comm.recv(host.empty(HEADER, dtype="int64"), a.peer, self._tag(a))
        dtype, shape = host.dtype(chr(header[0])), tuple(int(n) for n in header[2:2 + header[1]])
        out = backend.xp().empty(shape, dtype=dtype)
        s.x_in[(a.stage, a.mb)] = self.comm.recv(out, a.peer, self._tag(a))

    def _send_f(self, a, s):
        y = s.outputs[(a.stage, a.mb)].data
        if y.ndim > HEADER - 2:
            raise ValueError(f"activations of {y.ndim} dimensions do not fit the message header")
        header = backend.get_array_module().zeros(HEADER, dtype="int64")
        header[:2 + y.ndim] = [ord(y.dtype.char), y.ndim, *y.shape]
        s.sends += [self.comm.isend(header, a.peer, self._tag(a)),
                    self.comm.isend(y, a.peer, self._tag(a))]

    def _recv_b(self, a, s):
        y = s.outputs[(a.stage, a.mb)]
        out = backend.xp().empty(y.shape, dtype=y.dtype)
        s.dy_in[(a.stage, a.mb)] = self.comm.recv(out, a.peer, self._tag(a))

    def _send_b(self, a, s):
        s.sends.append(self.comm.isend(s.dx_out.pop((a.stage, a.mb)), a.peer, self._tag(a)))
