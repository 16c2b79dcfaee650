"""This machine as a hardware profile (``here()``), beside the GPUs' (``gpus.PROFILES``).

A profile's links are ``comm.cost.Model``s (alpha, beta, gamma), so the planner prices a
collective with the library's own formula (``cost.predict``). ``here()`` is this machine: the
cost model fitted by ``minipar bench allreduce`` in this process (else ``MINIPAR_COST``, else
cost.py's guess), and minipar's own engine timed now (``Engine``: GEMMs at the model's shapes,
per-op and element-wise costs).

    mine = here()                       # about 0.3 s of timing
    profile("h100").peak("bf16")        # 989e12 FLOP/s, from gpus.PROFILES
"""
import dataclasses
import functools
import os
import statistics
import time

from minipar.comm import cost

from .gpus import PROFILES, Profile


def gemm_rate(n=256, repeats=5):
    """FLOP/s of this machine's NumPy matmul, an n x n float32 product timed now (best of
    ``repeats``): 2n³ FLOPs each."""
    import numpy as np
    a = np.ones((n, n), np.float32)
    return 2 * n**3 / best_of(lambda: a @ a, repeats)


# A GEMM above this many multiply-adds runs at the 256 x 256 product's rate (what ``gemm_rate``
# measures): large products reach the BLAS's full rate, and timing a 175B model's would take
# seconds each
LARGE_GEMM = 256**3


@functools.lru_cache(maxsize=None)
def gemm_seconds(batch, m, k, n, repeats=3):
    """Seconds of ``batch`` float32 (m x k) @ (k x n) products on this machine, timed at that
    shape (best of ``repeats``): at a small model's shapes NumPy reaches a fraction of the
    large-matrix rate, so the shape is what is timed."""
    import numpy as np
    if batch * m * k * n > LARGE_GEMM:
        return 2 * batch * m * k * n / large_gemm_rate()
    a, b = np.ones((batch, m, k), np.float32), np.ones((batch, k, n), np.float32)
    return best_of(lambda: a @ b, repeats)


@functools.lru_cache(maxsize=None)
def large_gemm_rate():
    return gemm_rate()


def best_of(run, repeats):
    """The least CPU time of ``repeats`` calls of ``run()``: the time the work itself takes on
    a core. Wall time would count the other jobs a loaded machine runs meanwhile (a call longer
    than a time slice is cut), CPU time does not; with one BLAS thread (each rank has one) it is
    the wall time of a quiet machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        run()
        best = min(best, time.process_time() - t0)
    return best


def gemms_seconds(gemms):
    """Forward and backward of the matmuls ``gemms`` [(batch, m, k, n)]: the forward's product,
    then dX (m, n, k) and dW (k, m, n) of the same FLOPs."""
    return sum(gemm_seconds(b, m, k, n) + gemm_seconds(b, m, n, k) + gemm_seconds(1, k, b * m, n)
               for b, m, k, n in gemms)


# A layer or a head of at most this many activation bytes / logits, and weights, is timed at
# its own sizes (a Block of them runs in about 20 ms); a larger one is priced per byte / logit
# at the moderate size ``measure_engine`` times (a 175B model's layer cannot be built here)
TIMED_BYTES, TIMED_LOGITS, TIMED_WEIGHTS = 1 << 23, 1 << 20, 1 << 22


@dataclasses.dataclass(frozen=True)
class Engine:
    """What minipar's NumPy engine spends beyond the GEMMs, measured by ``measure_engine``. At
    a small model's sizes most of a step is per-op Python and element-wise passes (LayerNorm,
    GeLU, softmax, residual adds, their backwards), which a FLOP count does not see; each term
    is a fixed cost (the ops' dispatch, timed at a tiny size) plus a cost per byte or per logit,
    timed at the planned model's own sizes when they are small (the cost per element is not
    the same at every size: caches, NumPy's per-call work), else at a moderate size."""
    layer: float       # seconds: one Block forward + backward at a tiny size, less its GEMMs
    activation: float  # seconds per byte of a layer's activations (Megatron's count), moderate
    rest: float        # seconds: embedding, final LayerNorm, head and loss at a tiny size
    logit: float       # seconds per logit (B·s·V) of the head's element-wise passes and loss
    tensor: float      # AdamW step, seconds per parameter tensor
    element: float     # AdamW step, seconds per parameter element
    cores: int         # the cores the ranks share
    fbw: tuple = (1.0, 1.0, 1.0)  # seconds of a Block's F, B and W (its backward split as a
    #                               zero-bubble pipeline splits it): a stage's time among them
    contention: float = None  # how many times longer a rank computes beside the layout's other
    #                           ranks than alone, measured on them (``contention``); None: unknown

    def share(self, ranks):
        """A rank's share of a core: ranks beyond the cores take turns (oversubscribed)."""
        return min(1.0, self.cores / ranks)

    def slowdown(self, ranks):
        """How many times longer a rank's compute takes among ``ranks`` than alone: measured
        (``contention``), else 1 / ``share``, the ranks taking turns and nothing else."""
        return self.contention if self.contention is not None else 1 / self.share(ranks)

    def layer_cost(self, b, s, h, heads, block="gpt", cp=1, experts=0, top_k=1):
        """(fixed seconds, seconds per activation byte) of a layer of these sizes (s: a rank's
        share of the sequence), of minipar's ``block`` kind (``BLOCKS``), its attention the ring
        over cp ranks when cp > 1, its MLP a mixture of ``experts`` when given."""
        kind = (block, cp, experts, top_k)
        fixed = (self.layer if kind == ("gpt", 1, 0, 1)
                 else layer_spent(*TINY, *kind, repeats=20)[0])
        weights = 12 * h * h * max(1, experts)
        if activation_bytes(b, s, h, heads) > TIMED_BYTES or weights > TIMED_WEIGHTS:
            return fixed, self.activation
        spent, nbytes = layer_spent(b, s, h, heads, *kind)
        return fixed, max(0.0, spent - fixed) / nbytes

    def ends_cost(self, b, s, h, vocab, block="gpt"):
        """(fixed seconds, seconds per logit) of a GPT's ends of these sizes, run by the model
        of ``block``'s kind."""
        fixed = self.rest if block == "gpt" else ends_spent(*TINY[:3], 8, block, repeats=20)[0]
        if b * s * vocab > TIMED_LOGITS or h * vocab > TIMED_WEIGHTS:
            return fixed, self.logit
        spent, logits = ends_spent(b, s, h, vocab, block)
        return fixed, max(0.0, spent - fixed) / logits

    def embedding_cost(self, b, s, h, vocab, block="gpt"):
        """Seconds of the embedding's part of ``ends_cost``, timed at these sizes; 0 for a
        model too large to build, whose ends are all priced on the last stage (its embedding
        is a gather and a scatter-add: little beside the head)."""
        if b * s * vocab > TIMED_LOGITS or h * vocab > TIMED_WEIGHTS:
            return 0.0
        return embedding_spent(b, s, h, vocab, block)

    def zero3_unit_cost(self, b, s, h, heads, vocab, layers):
        """Seconds of ZeRO-3's own work per unit in a micro-batch's step (``zero3_spent``): at
        this GPT's sizes when it is small enough to build, else at a moderate GPT's."""
        if (activation_bytes(b, s, h, heads) > TIMED_BYTES or b * s * vocab > TIMED_LOGITS
                or layers * 12 * h * h + h * vocab > TIMED_WEIGHTS):
            return zero3_spent(*MODERATE_ZERO3)
        return zero3_spent(b, s, h, heads, vocab, layers)


# the moderate GPT ZeRO-3's work per unit is timed on when the planned one is too large:
# b, s, h, heads, V, layers
MODERATE_ZERO3 = (4, 64, 64, 4, 512, 2)


def activation_bytes(b, s, h, heads):
    """Megatron's count for one layer, the unit of the element-wise passes' cost."""
    from .memory import megatron_activation_bytes
    return float(megatron_activation_bytes(s, b, h, heads, 1, False, "none"))


# The block minipar runs a layer with: nn.GPT's (serial, DP, ZeRO), or the 3D trainer's
# TensorParallelGPT block (tp and pp layouts), which adds the tensor group's ops to each layer
# (timed on a one-rank group), with sequence parallelism's when tp > 1
BLOCKS = ("gpt", "tensor", "sequence")
TINY = (1, 4, 8, 2)  # b, s, h, heads of the tiny Block: its fixed cost


@functools.lru_cache(maxsize=None)
def one_rank_group():
    """A tensor group of this process alone (MPI.COMM_SELF): the 3D trainer's model timed
    without its collectives (the planner prices those); one, as each Communicator duplicates
    its MPI communicator."""
    from mpi4py import MPI

    from minipar.comm.communicator import Communicator
    return Communicator(MPI.COMM_SELF)


class LoopbackRing:
    """A ring of ``size`` ranks that one process runs, to time ring attention's compute alone:
    what rank 0 sends to the next rank comes back as what it receives from the one before (a
    real ring's blocks hold other tokens; the blocks computed, skipped and folded are the same)."""

    def __init__(self, size):
        self.size, self.rank = size, 0

    def isend(self, a, dest, tag):
        self.sent = a
        return Arrived(None)

    def irecv(self, buf, source, tag):
        buf[...] = self.sent  # a receive's copy into its buffer
        return Arrived(buf)

    def all_gather_object(self, obj):
        return [obj] * self.size  # every rank of the ring is this one: they agree


@dataclasses.dataclass
class Arrived:
    """A request that is already done: ``wait()`` gives what it received."""
    value: object

    def wait(self):
        return self.value


def block_input(b, s, h):
    """A (b, s, h) input to a layer to time, needing its gradient, the random stream seeded for
    the layer built next. Normal values: a constant row would make LayerNorm's output zero and
    its gradients denormal, which the BLAS runs many times slower."""
    import numpy as np

    import minipar
    from minipar.backend import asarray
    minipar.manual_seed(0)
    return minipar.tensor(asarray(np.random.default_rng(0).standard_normal((b, s, h),
                                                                          np.float32)),
                          requires_grad=True)


@functools.lru_cache(maxsize=None)
def layer_spent(b, s, h, heads, block="gpt", cp=1, experts=0, top_k=1, repeats=5):
    """(seconds of a ``block`` forward + backward at these sizes less its GEMMs, its activation
    bytes), timed now; s is a rank's share of the sequence, which cp > 1 splits over a ring.
    With ``experts`` the block's MLP is minipar's mixture of experts, all of them on this
    process (an expert group of one rank)."""
    from minipar import nn

    from .flops import layer_gemms
    x = block_input(b, s, h)
    if block == "gpt":
        layer = nn.MoEBlock(h, heads, experts, top_k) if experts else nn.Block(h, heads)
    else:
        from minipar.parallel.tensor.gpt import ParallelBlock
        from minipar.parallel.tensor.moe import TensorExpertParallelMoE
        # the 4D trainer's experts: the tensor and expert groups both this process alone
        mlp = (TensorExpertParallelMoE(h, experts, top_k, group=one_rank_group(),
                                       tensor_group=one_rank_group()) if experts else None)
        # under cp the attention is the ring over cp ranks, its messages looped back
        layer = ParallelBlock(h, heads, one_rank_group(), sequence_parallel=block == "sequence",
                              mlp=mlp, context=LoopbackRing(cp) if cp > 1 else None)
    spent = best_of(lambda: layer(x).sum().backward(), repeats)
    # a rank's GEMMs under cp: its s queries against all s·cp keys
    gemms = layer_gemms(b, s * cp, h, heads, cp=cp, experts=experts, top_k=top_k)
    return spent - gemms_seconds(gemms), activation_bytes(b, s, h, heads)


def gpt_ends(b, s, h, vocab, block):
    """(a GPT of one Block whose ends are timed, its loss, ids of b x s sequences): nn.GPT's, or
    with another ``block`` the 3D trainer's TensorParallelGPT's (vocabulary-parallel head and
    loss)."""
    import numpy as np

    import minipar
    from minipar import nn
    from minipar.backend import asarray
    minipar.manual_seed(0)
    config = nn.GPTConfig(vocab_size=vocab, block_size=s, n_layer=1, n_head=1, n_embd=h)
    if block == "gpt":
        gpt = nn.GPT(config)
        from minipar.functional import cross_entropy as loss
    else:
        from minipar.parallel.tensor.gpt import TensorParallelGPT
        gpt = TensorParallelGPT(config, one_rank_group(), block == "sequence")
        loss = gpt.loss
    return gpt, loss, asarray(np.random.default_rng(0).integers(0, vocab, (b, s)))


@functools.lru_cache(maxsize=None)
def ends_spent(b, s, h, vocab, block="gpt", repeats=5):
    """(seconds of a GPT's embedding, final LayerNorm, head and loss, forward + backward, at
    these sizes less the head's GEMMs, its logits), timed now (``gpt_ends``)."""
    gpt, loss, ids = gpt_ends(b, s, h, vocab, block)

    def no_blocks():  # the GPT's forward without its one Block
        loss(gpt.lm_head(gpt.ln_f(gpt.embed(ids))), ids).backward()
    spent = best_of(no_blocks, repeats)
    return spent - gemms_seconds([(1, b * s, h, vocab)]), b * s * vocab


@functools.lru_cache(maxsize=None)
def embedding_spent(b, s, h, vocab, block="gpt", repeats=5):
    """Seconds of the ends' embedding alone, forward + backward, timed now: the first pipeline
    stage's part of ``ends_spent``, the rest is the last stage's."""
    gpt, _, ids = gpt_ends(b, s, h, vocab, block)
    return best_of(lambda: gpt.embed(ids).sum().backward(), repeats)


@functools.lru_cache(maxsize=None)
def zero3_spent(b, s, h, heads, vocab, layers=1, repeats=5):
    """Seconds ZeRO-3's own work adds to a step, per unit it gathers: a ``ZeRO3`` step of a
    GPT of these sizes on a one-rank group (its gathers into slots, hooks and flat gradients;
    the collectives themselves, priced by the planner, do nothing on one rank) less the plain
    step of the same GPT and AdamW, over its ``layer_units``; timed now."""
    import numpy as np

    import minipar
    from minipar import nn, optim
    from minipar.backend import asarray
    from minipar.parallel.data import ZeRO3
    from minipar.parallel.data.zero3_units import layer_units
    config = nn.GPTConfig(vocab_size=vocab, block_size=s, n_layer=layers, n_head=heads,
                          n_embd=h, dropout=0.0)
    ids = asarray(np.random.default_rng(0).integers(0, vocab, (b, s)))

    def step_of(sharded):
        minipar.manual_seed(0)
        gpt = nn.GPT(config)
        units = len(layer_units(gpt))
        opt = (ZeRO3(gpt, optim.AdamW, one_rank_group()) if sharded
               else optim.AdamW(gpt.parameters()))

        def step():
            opt.zero_grad()
            gpt(ids, ids)[1].backward()
            opt.step()
        step()  # the moments (and ZeRO-3's slots) are made on the first step
        return best_of(step, repeats), units
    (plain, _), (sharded, units) = step_of(False), step_of(True)
    return max(0.0, sharded - plain) / units


def adam_seconds(tensors, size, repeats=5):
    """Seconds of an AdamW step on ``tensors`` parameters of ``size`` elements, timed now."""
    import numpy as np

    import minipar
    from minipar import optim
    from minipar.backend import asarray
    params = [minipar.tensor(asarray(np.ones(size, np.float32)), requires_grad=True)
              for _ in range(tensors)]
    for p in params:
        p.grad = asarray(np.ones(size, np.float32))
    opt = optim.AdamW(params)
    opt.step()  # the moments are made on the first step
    return best_of(opt.step, repeats)


def sync_seconds(comm, iters=20, rounds=5):
    """Seconds a collective costs on ``comm``'s ranks beyond its back-to-back time when they
    come to it from computing: a tiny all-reduce after each burst of NumPy work (three 128 x 128
    products, about a layer's ops between two collectives here), less the bursts alone and the
    tight loop's all-reduce; the median of ``rounds``. The fitted alpha is timed back to back,
    the ranks in step; after work they arrive apart (a rank descheduled, another job's slice,
    ranks beyond the cores taking turns) and the first waits for the last, at every collective."""
    import numpy as np

    from minipar.comm import fit
    x = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    tiny = np.ones(16, np.float32)

    def burst():
        for _ in range(3):
            x @ x

    def each(run):
        return fit.timed(comm, lambda: [run() for _ in range(iters)], 3, warmup=1) / iters
    # the three side by side each round, the median round: a burst of other work spoils a
    # round, and a difference of each one's least would pair unlike rounds
    waits = [each(lambda: (burst(), comm.all_reduce(tiny))) - each(burst)
             - each(lambda: comm.all_reduce(tiny)) for _ in range(rounds)]
    return max(0.0, statistics.median(waits))


def contention(comm, rounds=7, iters=8, alone_clock=time.perf_counter):
    """How many times longer a rank computes when all of ``comm``'s ranks compute at once than
    when it computes alone, the same on every rank: the wall seconds of a moderate Block's
    forward + backward (b = 4, s = 64, h = 64: the engine's mix of GEMMs, per-op Python and
    element-wise passes), the slowest rank's mean over ``iters`` calls all at once over rank 0's
    alone, the median of ``rounds`` such pairs. Ranks that share the caches and the memory bus
    slow each other (two ranks on two cores: about 1.02-1.07 here); ranks beyond the cores take
    turns and evict each other's caches at every switch (four on two cores: 2.2-2.5, where turns
    alone give 2). ``alone_clock=time.process_time`` times rank 0 alone in CPU seconds, as the
    engine's costs are timed (``best_of``): the ratio then turns those into wall seconds among
    the ranks, other jobs' share of the cores included, which wall time alone would also see."""
    from minipar import nn
    x = block_input(4, 64, 64)
    layer = nn.Block(64, 4)

    def mean_call(clock=time.perf_counter):
        start = clock()
        for _ in range(iters):
            layer(x).sum().backward()
        return (clock() - start) / iters
    mean_call()  # warm-up: the first calls allocate
    ratios = []
    # alone and together side by side each round: the machine's pace drifts over seconds (other
    # tenants of its host), and a ratio of two moments apart would carry the drift
    for _ in range(rounds):
        alone = mean_call(alone_clock) if comm.rank == 0 else None
        # the others wait without spinning (a test every millisecond), so rank 0 has a core to
        # itself: a waiting MPI rank polls, and beyond the cores it would take rank 0's turns
        done = comm.mpi.Ibarrier()
        while not done.Test():
            time.sleep(0.001)
        comm.barrier()
        together = max(comm.all_gather_object(mean_call()))
        ratios.append(together / alone if comm.rank == 0 else None)
    return comm.broadcast_object(statistics.median(ratios) if comm.rank == 0 else None)


@functools.lru_cache(maxsize=None)
def pass_split(b, s, h, heads, repeats=5):
    """(F, B, W) seconds of a Block at these sizes, timed now (the least of ``repeats`` each):
    its forward; the backward down to its input with the weights' gradients deferred
    (``graph.WeightPass``), a zero-bubble pipeline's B; then those gradients, its W. Together B
    and W cost what one whole backward does; W is about half a forward here, not the textbook's
    equal third."""
    import numpy as np

    from minipar import nn
    from minipar.backend import asarray
    from minipar.graph import WeightPass, run_backward
    x = block_input(b, s, h)
    layer = nn.Block(h, heads)
    dy = asarray(np.ones((b, s, h), np.float32))
    forward = best_of(lambda: layer(x), repeats)

    def split():  # process-time of B, then of W, after an untimed forward
        y, weights = layer(x), WeightPass(layer.parameters())
        start = time.process_time()
        run_backward([y], [dy], defer=weights)
        middle = time.process_time()
        weights.run()
        return middle - start, time.process_time() - middle
    times = [split() for _ in range(repeats)]
    return forward, min(t[0] for t in times), min(t[1] for t in times)


def measure_engine():
    """Time minipar's own Block, GPT ends and AdamW at a tiny and a moderate size (about 0.3 s);
    the planned model's own sizes are timed when the planner first asks for them."""
    # the tiny sizes' calls take a fraction of a millisecond: more of them find a quiet moment
    # (the block, cp and experts passed by position: the cache keys are those layer_cost and
    # ends_cost use)
    (fixed, _), (big, nbytes) = layer_spent(*TINY, "gpt", 1, 0, 1, repeats=20), \
        layer_spent(4, 64, 64, 4, "gpt", 1, 0, 1)
    (rest, _), (head, logits) = (ends_spent(*TINY[:3], 8, "gpt", repeats=20),
                                 ends_spent(4, 64, 64, 512, "gpt"))
    per_tensor = adam_seconds(32, 1) / 32
    per_element = (adam_seconds(1, 1 << 18) - per_tensor) / (1 << 18)
    from minipar.comm.node import usable_cores
    cores = len(usable_cores())
    return Engine(fixed, max(0.0, big - fixed) / nbytes, rest, max(0.0, head - rest) / logits,
                  per_tensor, max(0.0, per_element), cores, pass_split(4, 64, 64, 4))


def here(comm=None):
    """This machine: ranks are processes on one node, so both links are the cost model
    ``comm.cost.default_model()`` gives; the peak is the measured GEMM rate, reached in full
    (efficiency 1: it was measured, not read off a sheet); memory is the host's RAM; the
    compute is priced by minipar's own costs (``Engine``, ``measure_engine``).

    With ``comm`` (every one of its ranks calls this) the engine also holds what only the
    ranks themselves can measure, as scripts/bench_plan.py measures it: how much slower they
    compute side by side than the CPU time one needs alone (``contention``, rank 0 alone timed
    in CPU seconds as the engine's costs are): ranks beyond the cores evict each other's
    caches at every turn, so four on two cores take 2.2-2.5x, not the 2x of turns alone, and
    other jobs on a loaded machine take their share of the cores (without it lesson 16's DP
    on 4 ranks computed 1.3x its prediction). ``sync`` stays 0: ``sync_seconds`` times a
    collective after every burst of work, which prices ZeRO-3's and tensor parallelism's
    back-to-back collectives at 2-3x what they measure."""
    model = cost.default_model()
    rate = large_gemm_rate()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bandwidth = 1 / model.beta(1 << 20)  # shown in the table; the link is the model itself
    engine = measure_engine()
    if comm is not None and comm.size > 1:
        engine = dataclasses.replace(
            engine, contention=contention(comm, alone_clock=time.process_time))
    return Profile("here", {p: rate for p in ("fp32", "bf16", "fp16")}, ram,
                   3 / model.gamma(1 << 20), bandwidth, bandwidth, model.alpha, model.alpha,
                   efficiency=1.0, fitted=model, engine=engine)


def profile(name):
    """The named profile (``h100``, ``a100``), or ``here()``."""
    if name == "here":
        return here()
    if name not in PROFILES:
        raise ValueError(f"--profile {name}: no such hardware profile; known: "
                         f"{', '.join(PROFILES)}, here")
    return PROFILES[name]
