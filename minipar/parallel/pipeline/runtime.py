"""The pipeline runtime: one executor runs any schedule, each rank walking its own list of actions.

    pipe = Pipeline(model, build("1f1b", p, m), comm, loss_fn, optimizer=lambda ps: SGD(ps, 0.1))
    loss = pipe.step(x, y)        # one training step: m micro-batches through the p ranks

``model`` is a ``Sequential`` built the same way on every rank (same seed), cut into S = p*v
stages (``bounds``: partition.py); rank r keeps the stages the schedule places there as its
chunks 0, 1, .... ``step`` is a dispatch loop, as ShallowSpeed's ``Worker.execute``: each
action's kind names its method in ``action_table``, which runs it on the step's ``StepState``.
The tracer, the waiting kernel (``delay``), the watchdog's note and the memory counters wrap
every action from one place, ``_bookkeeping``. PipeDream's schedule names the subclass it runs
on (``Schedule.runtime``, pipedream.py). The theory (bubbles, the B/W split): docs/pipeline.md.
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

from .actions import B, BW, F, OPT_STEP, R, RECV_B, RECV_F, SEND_B, SEND_F, W, message_tag
from .agreement import agreed_bounds, check_targets, split_batch
from .partition import split_layers
from .timeline import Tracer
from .validate import validate

HEADER = 8  # int64 words before an activation: dtype character, ndim, up to 6 dimensions


class StepState:
    """What one step holds, made fresh by ``Pipeline.step``; the dicts are keyed by (stage, mb)."""

    def __init__(self, x=None, y=None, scale=None):
        self.x = x          # this step's micro-batches of inputs (where stage 0 lives)
        self.y = y          # and of targets (where the last stage lives)
        self.scale = scale  # each micro-batch's loss factor
        # Values on their way from one action to another, each where its consumer looks for it.
        # When two consecutive stages share a rank (p = 1; stages p-1 and p of ZB-V), F puts y
        # straight into the next stage's x_in and B puts dL/dx into the previous stage's dy_in.
        self.x_in = {}         # the activation an F waits for: from RECV_F, or the local F before
        self.dy_in = {}        # the output gradient dL/dy a B waits for: RECV_B's, or a local B's
        self.dx_out = {}       # the input gradient dL/dx a B computed, waiting for its SEND_B
        self.weight_pass = {}  # what a split B left for its W (graph.WeightPass)
        # What F leaves for R, SEND_F, B and W.
        self.inputs = {}   # the leaf x
        self.outputs = {}  # y; at the last stage, the micro-batch's scaled loss
        self.rng = {}      # the random state F began with, for R to replay
        self.sends, self.losses = [], []
        self.live = self.peak_live = 0

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

    def __new__(cls, model, schedule, *args, **kwargs):
        # PipeDream updates the weights between a micro-batch's F and its B, and each B must see
        # its F's weights again: its schedule names the subclass that keeps them (pipedream.py)
        if schedule.runtime and not issubclass(cls, schedule.runtime):
            cls = schedule.runtime
        return super().__new__(cls)

    def __init__(self, model, schedule, comm, loss_fn, optimizer=None, bounds=None, delay=None,
                 trace=False, memory=False, scaler=None):
        layers = list(model)  # every rank: the same schedule, bounds, layers (agreement.py)
        self.bounds = agreed_bounds(comm, schedule, layers, bounds)
        # Sends are posted (isend) and completed at the OPT_STEP, receives block: validate proves
        # no receive then waits forever. A broken schedule stops here, on every rank.
        self.schedule = validate(schedule)
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
        # mixed precision: a GradScaler scales the last stage's loss and steps the optimizer at
        # OPT_STEP; its group (the pipeline's, or the world) lets every stage skip the same steps
        self.scaler = scaler
        # delay(a): the least seconds action a takes, slept out by the waiting kernel, so p ranks
        # run side by side on fewer cores; trace: each action a timeline Event (self.events);
        # memory: the activation bytes' peak (ActivationMemory, stats["peak_bytes"])
        self.delay, self.trace, self.memory = delay, trace, memory
        self.events, self.stats, self.state = [], {}, StepState()
        # The action table: each kind of action and the method that runs it.
        self.action_table = {
            RECV_F: self._recv_f,      # a header (dtype, shape), then the activation, into x_in
            F: self._forward,          # y = stage(x); at the last stage, the micro-batch's loss
            R: self._recompute,        # F again, with its graph, from the kept input
            SEND_F: self._send_f,      # isend the header and y
            RECV_B: self._recv_b,      # dL/dy into dy_in, shaped as the y this rank computed
            B: self._backward,         # dL/dx (into dx_out) and, unless W is separate, dL/dW
            BW: self._backward,        # DualPipeV: dL/dx and dL/dW where W is otherwise separate
            W: self._weight_grad,      # zero bubble: dL/dW alone, from what B kept
            SEND_B: self._send_b,      # isend dL/dx
            OPT_STEP: self._opt_step,  # complete the pending sends, then optimizer.step()
        }

    def parameters(self):
        return list(self.params)

    # --- one step -------------------------------------------------------------------------------
    def step(self, x=None, y=None):
        """Run this rank's actions for one batch; ``x`` is needed where stage 0 lives, ``y`` where
        the last stage lives. Returns the batch loss there (PipeDream: the mean micro-batch loss),
        None elsewhere: a 0-d float64 array on the device, summed there with no host read per
        micro-batch (``float(loss)`` reads it; on NumPy it already is a float)."""
        m = self.schedule.microbatches
        first, last = 0 in self.stages, self.n_stages - 1 in self.stages
        xs, ys = split_batch(x, y, m, self.rank, first, last)  # agreement.py: clear errors
        s = self.state = StepState(xs, ys, self.loss_scales(ys, y))
        scale = self.scaler.get_scale() if self.scaler else 1.0  # the OPT_STEP may update it
        for q in self.params:
            q.grad = None
        with self._bookkeeping(s) as around:
            for a in self.schedule.actions[self.rank]:
                # a DualPipeV F&B pair runs its F, then its B: the receives of both came before it
                for part in a.parts:
                    with around(part):
                        self.action_table[part.kind](part, s)
            s.complete_sends()
        return sum(s.losses) / scale if last else None  # the losses were scaled by it

    def loss_scales(self, ys, y):
        """Micro-batch k holds n_k of the N samples, so its loss counts n_k / N: ``loss_fn`` being
        a mean over samples, the gradients summed over the m micro-batches (applied once, at
        OPT_STEP) are the full batch's, the serial model's, whatever m is."""
        if y is None:
            return [1.0] * self.schedule.microbatches
        return [len(t) / len(y) for t in ys]

    @contextlib.contextmanager
    def _bookkeeping(self, s):
        """Everything the step does around its actions, in one place: the activation memory and
        the tracer around the whole step; ``around(a)``, which it yields, around each action."""
        tracer = None
        if self.trace:
            self.comm.barrier()  # every rank's tracer starts here: one origin for all the events
            tracer = Tracer(self.rank)
        # Micro-batches whose activations this rank holds (stats["peak_live"]): from the start of F
        # to the end of B; with re-materialisation F keeps only its input, so during F and from R.
        live = {F: (+1, -1 if self.schedule.remat else 0), R: (+1, 0), B: (0, -1), BW: (0, -1)}

        @contextlib.contextmanager
        def around(a):
            with tracer.record(a.kind, a.mb, a.chunk) if tracer else contextlib.nullcontext():
                watched["action"] = f"pipeline action {a}"
                start = time.perf_counter()
                before, after = live.get(a.kind, (0, 0))
                s.count(before)
                yield
                s.count(after)
                rest = self.delay(a) - (time.perf_counter() - start) if self.delay else 0
                if rest > 0:  # the waiting kernel: sleep out the rest of the action's cost
                    time.sleep(rest)

        with (ActivationMemory() if self.memory else contextlib.nullcontext()) as mem:
            yield around
        watched["action"] = None
        self.events = tracer.events if tracer else []
        self.stats = {"peak_live": s.peak_live, "peak_bytes": mem.peak_bytes if mem else None}

    # --- compute --------------------------------------------------------------------------------
    def _run_stage(self, a, x, s):
        y = self.stages[a.stage](x)
        if a.stage == self.n_stages - 1:
            check_targets(y, s.y[a.mb], a.stage, a.mb, self.rank)
            y = self.loss_fn(y, Tensor(s.y[a.mb])) * s.scale[a.mb]
            if self.scaler:  # GradScaler.scale: a 16-bit loss goes to float32 first
                y = self.scaler.scale(y)
        return y

    def _forward(self, a, s):
        key = (a.stage, a.mb)
        x = Tensor(s.x[a.mb] if a.stage == 0 else s.x_in.pop(key))
        if a.stage > 0:
            x.requires_grad_(True)
        s.inputs[key], s.rng[key] = x, random.get_rng_state()
        # re-materialisation: no graph now (only x is kept); R builds it again just before B
        with set_grad_enabled(not self.schedule.remat):
            y = s.outputs[key] = self._run_stage(a, x, s)
        if a.stage == self.n_stages - 1:
            s.losses.append(y.data.astype("float64"))  # stays on the device
        elif self.schedule.rank_of(a.stage + 1) == self.rank:  # the next stage is here (p = 1)
            s.x_in[(a.stage + 1, a.mb)] = y.data

    def _recompute(self, a, s):
        """Re-materialise: the forward again, with its graph, from the kept input."""
        key = (a.stage, a.mb)
        with recomputing(s.rng[key]):  # dropout's masks again; BatchNorm's statistics once
            s.outputs[key] = self._run_stage(a, s.inputs[key], s)

    def _backward(self, a, s):
        key = (a.stage, a.mb)
        y, x = s.outputs[key], s.inputs[key]
        last = a.stage == self.n_stages - 1
        dy = backend.xp().ones_like(y.data) if last else s.dy_in.pop(key)
        weights = None
        # Zero bubble: B runs the chain rule down to dL/dx with the stage's parameters deferred;
        # each op a parameter feeds keeps its output gradient and saved input for W, the rest of
        # the graph is freed (graph.WeightPass).
        if self.schedule.split_backward and a.kind == B:  # a BW does both at once
            weights = s.weight_pass[key] = WeightPass(self.stages[a.stage].parameters())
        run_backward([y], [dy], defer=weights)
        del s.outputs[key], s.inputs[key]
        if a.stage > 0 and self.schedule.rank_of(a.stage - 1) == self.rank:
            s.dy_in[(a.stage - 1, a.mb)] = x.grad  # the previous stage is here (p = 1)
        elif a.stage > 0:
            s.dx_out[key] = x.grad

    def _weight_grad(self, a, s):
        # only the deferred ops' weight gradients (dW = g^T x, db = sum g): B + W is one backward
        s.weight_pass.pop((a.stage, a.mb)).run()

    def _opt_step(self, a, s):
        s.complete_sends()
        if self.optimizer and self.scaler:  # skipped on every rank of its group on an overflow
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.optimizer:
            self.optimizer.step()

    # --- messages -------------------------------------------------------------------------------
    def _tag(self, a):
        # a send and its receive share the tag, as a header and its activation do: MPI keeps the
        # messages of one sender and tag in order
        return message_tag(a, self.n_stages)

    def _recv_f(self, a, s):
        host = backend.get_array_module()
        header = self.comm.recv(host.empty(HEADER, dtype="int64"), a.peer, self._tag(a))
        # the activation's own dtype, 16-bit ones included (half the bytes of float32)
        dtype = backend.dtype(chr(header[0]))
        out = backend.xp().empty(tuple(int(n) for n in header[2:2 + header[1]]), dtype=dtype)
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
        # no header: dL/dy has the shape of the y this rank computed
        y = s.outputs[(a.stage, a.mb)]
        out = backend.xp().empty(y.shape, dtype=y.dtype)
        s.dy_in[(a.stage, a.mb)] = self.comm.recv(out, a.peer, self._tag(a))

    def _send_b(self, a, s):
        s.sends.append(self.comm.isend(s.dx_out.pop((a.stage, a.mb)), a.peer, self._tag(a)))
