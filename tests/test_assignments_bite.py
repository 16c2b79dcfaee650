"""Checks that bite: wrong solutions, written as a student would write them, each score 0 with
a message naming what differs, and the reference keeps its points (issue 21).

Each wrong solution goes into a student tree made with ``assignments.make`` (the task's region
stubbed, then overwritten with the wrong code) and is graded by ``assignments.grade_task``, a
pytest run of the grader's checks. Hangs are caught by the watchdog (``MINIPAR_TIMEOUT``, the
grader's 15 s) under synchronous sends, so they cost a grade about 20 s.
"""
import textwrap

import pytest

from minipar import assignments

pytestmark = pytest.mark.mpi

RING_SEND_FIRST = """
send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
lo, hi = bounds[recv], bounds[recv + 1]
got = tmp[:hi - lo]
c.Send((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right)  # both send first
c.Recv(got, left)
reduce(src[lo:hi], got, out=buf[lo:hi])
"""
RING_OFF_BY_ONE = """
send, recv = (r + shift - s) % p, (r + shift - s) % p  # recv: one chunk too far
lo, hi = bounds[recv], bounds[recv + 1]
got = tmp[:hi - lo]
c.Sendrecv((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right, got, left)
reduce(src[lo:hi], got, out=buf[lo:hi])
"""
RING_MISSING_OWN_CHUNK = """
send, recv = (r + shift - s) % p, (r + shift - s - 1) % p
lo, hi = bounds[recv], bounds[recv + 1]
c.Sendrecv((src if s == 0 else buf)[bounds[send]:bounds[send + 1]], right, buf[lo:hi], left)
"""
RING_ON_MPI_ALLREDUCE = """
if s == 0:  # the whole vector reduced by MPI at once: the all-gather after it changes nothing
    from mpi4py import MPI
    from minipar.comm.mpi import MPI_OP
    c.mpi.Allreduce(MPI.IN_PLACE if src is buf else src, buf, op=MPI_OP[op])
"""
HALVING_SEND_FIRST = """
while mask:
    mid = (lo + hi) // 2
    (k0, k1), (g0, g1) = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
    got = tmp[:nb[k1] - nb[k0]]
    c.Send(src[nb[g0]:nb[g1]], real(me ^ mask))  # both partners send first
    c.Recv(got, real(me ^ mask))
    reduce(src[nb[k0]:nb[k1]], got, out=buf[nb[k0]:nb[k1]])
    lo, hi, mask, src = k0, k1, mask >> 1, buf
"""
HALVING_RECV_FIRST = """
while mask:
    mid = (lo + hi) // 2
    (k0, k1), (g0, g1) = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
    got = tmp[:nb[k1] - nb[k0]]
    c.Recv(got, real(me ^ mask))  # both partners receive first
    c.Send(src[nb[g0]:nb[g1]], real(me ^ mask))
    reduce(src[nb[k0]:nb[k1]], got, out=buf[nb[k0]:nb[k1]])
    lo, hi, mask, src = k0, k1, mask >> 1, buf
"""
CHECKPOINT_KEEPS_ALL = """
bounds = [round(i * len(modules) / segments) for i in range(segments + 1)]
for lo, hi in zip(bounds, bounds[1:]):
    x = _run_segment(modules[lo:hi])(x)  # every segment run plainly: nothing recomputed
return x
"""
CHECKPOINT_RETURNS_INPUT = "return x\n"
ZERO_NEVER_GATHERS = """
self.optimizer.step()  # each rank updates its shard; the others' shards never arrive
"""
W_OVERWRITES = """
for node, g, only in work:
    weight_grads = node._backward(g, only)  # only the weights' gradients
    for parent, pg, w in zip(node._parents, weight_grads, only):
        if w and pg is not None:
            _accumulate(pending, parent, pg)
    release(node)
for i, g in pending.items():
    self.weights[i].grad = g  # replaces the gradient of the earlier micro-batches
"""
VOCAB_EVERY_RANK_ADDS_A_TARGET = """
z = z - group.all_reduce(z.max(axis=-1), op="max")[:, None]
e = xp.exp(z)
total = group.all_reduce(e.sum(axis=-1))
z_target = group.all_reduce(z[rows, local_t])  # not only the owner's logit
"""
MOE_ROUTE = """
flat = expert.reshape(-1)
by_expert = host.argsort(flat, kind="stable")
assigned = host.bincount(flat, minlength=n_experts)
starts = host.concatenate([[0], host.cumsum(assigned)[:-1]])
slot = host.empty(N * k, dtype=host.int64)
slot[by_expert] = host.arange(N * k) - host.repeat(starts, assigned)
kept = slot < cap
"""
MOE_GATES_NOT_RENORMALISED = """
probs = F.softmax(self.router(x), axis=-1)
p = backend.to_numpy(probs.data)
expert = backend.numpy.argsort(-p, axis=1, kind="stable")[:, :self.top_k]
cap = capacity(len(p), self.n_experts, self.top_k, self.capacity_factor)
routing = route(expert, self.n_experts, cap)
gates = probs.gather(1, expert)  # the raw probabilities also for k >= 2
"""
BACK_OFF = """
if found_inf:
    self._scale = numpy.float32(float(self._scale) * self._backoff_factor)
    self._growth_tracker = 0
    return
"""
SCALE_NEVER_GROWS = BACK_OFF + "self._growth_tracker += 1  # counted, but the scale never grows\n"
SCALE_GROWS_EVERY_STEP = BACK_OFF + """
self._scale = numpy.float32(float(self._scale) * self._growth_factor)  # no growth_interval
"""
GROW_AT_INTERVAL = """
self._growth_tracker += 1
if self._growth_tracker == self._growth_interval:
    grown = numpy.float32(float(self._scale) * self._growth_factor)
    self._scale = grown if numpy.isfinite(grown) else self._scale
    self._growth_tracker = 0
"""
BACKOFF_KEEPS_THE_TRACKER = """
if found_inf:
    self._scale = numpy.float32(float(self._scale) * self._backoff_factor)  # the tracker kept
    return
""" + GROW_AT_INTERVAL
GROWTH_KEEPS_THE_TRACKER = BACK_OFF + """
self._growth_tracker += 1
if self._growth_tracker == self._growth_interval:  # the tracker not reset: it counts on
    self._scale = numpy.float32(float(self._scale) * self._growth_factor)
"""
SCALE_A_PYTHON_FLOAT = BACK_OFF + """
self._growth_tracker += 1
if self._growth_tracker == self._growth_interval:
    self._scale = float(self._scale) * self._growth_factor  # float64: grows past float32's top
    self._growth_tracker = 0
"""
MERGE_STEP = """
m_new = xp.maximum(m, s.max(axis=-1))
shift = xp.where(m_new == -xp.inf, 0.0, m_new)
alpha = xp.exp(m - shift)
p = xp.exp(s - shift[..., None])
"""
MERGE_UPDATE = """
l *= alpha
l += p.sum(axis=-1)
acc *= alpha[..., None]
acc += p @ v
m[...] = m_new
"""
MERGE_NO_RESCALE = MERGE_STEP + """
l += p.sum(axis=-1)  # the old sum and output stay under the old max
acc += p @ v
m[...] = m_new
"""
MERGE_SUM_NOT_OUTPUT = MERGE_STEP + """
l *= alpha
l += p.sum(axis=-1)
acc += p @ v  # the output not rescaled
m[...] = m_new
"""
MERGE_BLOCK_MAX_ONLY = """
m_new = s.max(axis=-1)  # the new block's max, not the running one
alpha = xp.exp(m - m_new)
p = xp.exp(s - m_new[..., None])
""" + MERGE_UPDATE
MERGE_DIVIDES_EACH_STEP = MERGE_STEP + MERGE_UPDATE + """
acc /= l[..., None]  # normalised at every block, and again at the end
"""
MERGE_MASKED_ROW_NAN = """
m_new = xp.maximum(m, s.max(axis=-1))
alpha = xp.exp(m - m_new)  # -inf - (-inf): NaN for a row that has seen only masked keys
p = xp.exp(s - m_new[..., None])
""" + MERGE_UPDATE

HANG = ["the ranks hung", "minipar watchdog: no progress", "waits in"]
ULYSSES_BACK = """
chunks = y.reshape(B, h, 2 * P, n // 2, d)[:, :, _placement(P, layout)]
rows = xp.ascontiguousarray(chunks.reshape(B, h, P, n, d).transpose(2, 0, 1, 3, 4))
got = group.all_to_all(rows)
return got.transpose(1, 0, 2, 3, 4).reshape(B, P * h, n, d)
"""
ULYSSES_NO_TRANSPOSE = ("""
rows = xp.ascontiguousarray(x.reshape(P, B, H // P, n, d))  # the batch axis not moved aside
got = group.all_to_all(rows)
chunks = got.transpose(1, 2, 0, 3, 4).reshape(B, H // P, 2 * P, n // 2, d)
placement = _placement(P, layout)
order = [placement.index(i) for i in range(2 * P)]
return chunks[:, :, order].reshape(B, H // P, P * n, d)
""", ULYSSES_BACK)
ULYSSES_ARRIVAL_ORDER = ("""
rows = xp.ascontiguousarray(x.reshape(B, P, H // P, n, d).transpose(1, 0, 2, 3, 4))
got = group.all_to_all(rows)
return got.transpose(1, 2, 0, 3, 4).reshape(B, H // P, P * n, d)  # in the order they came
""", """
rows = xp.ascontiguousarray(y.reshape(B, h, P, n, d).transpose(2, 0, 1, 3, 4))
got = group.all_to_all(rows)
return got.transpose(1, 0, 2, 3, 4).reshape(B, P * h, n, d)
""")
ULYSSES_ALL_GATHER = ("""
whole = group.all_gather(xp.ascontiguousarray(x))  # everyone's tokens of every head
r, h = group.rank, H // P
mine = whole[:, :, r * h:(r + 1) * h].transpose(1, 2, 0, 3, 4).reshape(B, h, 2 * P, n // 2, d)
placement = _placement(P, layout)
return mine[:, :, [placement.index(i) for i in range(2 * P)]].reshape(B, h, P * n, d)
""", ULYSSES_BACK)
ULYSSES_MPI_ALLTOALL = ("""
rows = xp.ascontiguousarray(x.reshape(B, P, H // P, n, d).transpose(1, 0, 2, 3, 4))
got = xp.empty_like(rows)
group.mpi.Alltoall(rows, got)  # MPI's own all-to-all
chunks = got.transpose(1, 2, 0, 3, 4).reshape(B, H // P, 2 * P, n // 2, d)
placement = _placement(P, layout)
return chunks[:, :, [placement.index(i) for i in range(2 * P)]].reshape(B, H // P, P * n, d)
""", ULYSSES_BACK)
FP8_AMAX = """
counts = [-(-n // b) for n, b in zip(x.shape, block)]
pad = [(0, c * b - n) for n, b, c in zip(x.shape, block, counts)]
a = xp.pad(xp.abs(x), pad)
return a.reshape([v for c, b in zip(counts, block) for v in (c, b)]).max(
    axis=tuple(range(1, 2 * x.ndim, 2)))
"""
FP8_CAST = """
fmax = FLOAT32.type(float(dtypes.finfo(d).max))
amax = backend.get_array_module(x).maximum(_block_amax(x, block), FLOAT32.type(1e-4))
data = saturate(x * expand(fmax / amax, block, x.shape), d)
return Quantized(data, amax / fmax, block)
"""
FP8_NO_FLOOR = (FP8_AMAX, """
fmax = FLOAT32.type(float(dtypes.finfo(d).max))
amax = _block_amax(x, block)  # a zero tile: amax 0
data = saturate(x * expand(fmax / amax, block, x.shape), d)
return Quantized(data, amax / fmax, block)
""")
FP8_INVERTED = (FP8_AMAX, """
fmax = FLOAT32.type(float(dtypes.finfo(d).max))
amax = backend.get_array_module(x).maximum(_block_amax(x, block), FLOAT32.type(1e-4))
data = saturate(x * expand(fmax / amax, block, x.shape), d)
return Quantized(data, fmax / amax, block)  # the multiplier, not the scale x = data · scale
""")
FP8_ROW_AMAX = ("""
return xp.abs(x).max(axis=-1, keepdims=True)  # one scale per row (per token), not per tile
""", FP8_CAST)
FP8_NO_ABS = ("""
counts = [-(-n // b) for n, b in zip(x.shape, block)]
pad = [(0, c * b - n) for n, b, c in zip(x.shape, block, counts)]
a = xp.pad(x, pad)  # the largest value, not the largest magnitude
return a.reshape([v for c, b in zip(counts, block) for v in (c, b)]).max(
    axis=tuple(range(1, 2 * x.ndim, 2)))
""", FP8_CAST)
FP8_PARTIAL_DROPPED = ("""
counts = [n // b for n, b in zip(x.shape, block)]  # the partial last tile left out
a = xp.abs(x)[tuple(slice(0, c * b) for c, b in zip(counts, block))]
return a.reshape([v for c, b in zip(counts, block) for v in (c, b)]).max(
    axis=tuple(range(1, 2 * x.ndim, 2)))
""", FP8_CAST)
WRONG = {  # name: (task, code for its region, words its grade's output must contain)
    "ring: both partners send first": ("ring-all-reduce", RING_SEND_FIRST, HANG + [
        "at minipar/comm/patterns.py:", "in ring_reduce_scatter: c.Send("]),
    "ring: off-by-one chunk index": ("ring-all-reduce", RING_OFF_BY_ONE, [
        "ring all-reduce (sum, out of place) of 1 float64 on 3 ranks",
        "lengths or dtypes differ across ranks",
        "at minipar/comm/patterns.py:"]),
    "ring: own chunk missing": ("ring-all-reduce", RING_MISSING_OWN_CHUNK, [
        "'s result", "expected 6000.0 at index 0, got"]),
    "ring: MPI's own all-reduce": ("ring-all-reduce", RING_ON_MPI_ALLREDUCE, [
        "MPI's own collectives do the work the task is to write",
        "the task's code called MPI.Intracomm.Allreduce at minipar/comm/patterns.py:"]),
    "halving: both partners send first": ("recursive-halving", HALVING_SEND_FIRST, HANG + [
        "in halving_reduce_scatter: c.Send("]),
    "halving: both partners receive first": ("recursive-halving", HALVING_RECV_FIRST, HANG + [
        "in halving_reduce_scatter: c.Recv("]),
    "checkpoint: every activation kept": ("checkpoint-sequential", CHECKPOINT_KEEPS_ALL, [
        "checkpoint_sequential(16 modules, 4) keeps only each segment's input",
        "peak activation memory of at most", "(100% of it)"]),
    "checkpoint: returns its input unchanged": ("checkpoint-sequential",
                                                CHECKPOINT_RETURNS_INPUT, [
        "checkpoint_sequential(5 modules, 1) gives the plain run's output",
        "expected shape (4, 2), got shape (4, 5)"]),
    "zero: the updated shards never all-gathered": ("zero-sharded-step", ZERO_NEVER_GATHERS, [
        "ZeRO-1's step of Adam on 3 ranks", "the collectives it calls",
        "expected [('all_gather', None, 40019)]", "all-gathered", "synchronous sends"]),
    "zero bubble: W overwrites the accumulated gradient": ("zero-bubble-w", W_OVERWRITES, [
        "B then W for 2 micro-batches", "parameter 0", "equals two plain backwards'",
        "added to those of earlier micro-batches"]),
    "vocab: every rank adds a target logit": ("vocab-cross-entropy",
                                              VOCAB_EVERY_RANK_ADDS_A_TARGET, [
        "vocab_parallel_cross_entropy equals the loss on the whole logits, 6 tokens",
        "expected", "synchronous sends"]),
    "moe: top-2 gates not renormalised": ("moe-top-k", (MOE_ROUTE, MOE_GATES_NOT_RENORMALISED), [
        "MoE(n_experts=4, top_k=2, capacity_factor=0.5).gate of 12 tokens: the gates",
        "expected"]),
    "loss scale: never grows": ("loss-scale-update", SCALE_NEVER_GROWS, [
        "the scale after each step", "expected 2048.0 at index 2, got 1024.0",
        "growth_factor after growth_interval clean steps"]),
    "loss scale: grows at every clean step": ("loss-scale-update", SCALE_GROWS_EVERY_STEP, [
        "the scale after each step", "expected 1024.0 at index 0, got 2048.0"]),
    "loss scale: a backoff keeps the growth tracker": ("loss-scale-update",
                                                       BACKOFF_KEEPS_THE_TRACKER, [
        "the scale after each step", "expected 1024.0 at index 6, got 2048.0"]),
    "loss scale: a growth keeps the growth tracker": ("loss-scale-update",
                                                      GROWTH_KEEPS_THE_TRACKER, [
        "the growth tracker after each step", "expected 0 at index 2, got 3",
        "0 after a backoff or a growth"]),
    "loss scale: a Python float grows past float32's top": ("loss-scale-update",
                                                            SCALE_A_PYTHON_FLOAT, [
        "growth_factor=4.0", "the scale after each step",
        f"expected {2.0**127!r} at index 6, got {2.0**129!r}"]),
    "merge: nothing rescaled by exp(m_old - m_new)": ("online-softmax-merge", MERGE_NO_RESCALE, [
        "key columns [(0, 3), (3, 4), (4, 9)], one at a time: acc / l equals softmax(s) v",
        "expected -0.38428930109", "both l and acc are multiplied by exp(m_old − m_new)"]),
    "merge: the sum rescaled, not the output": ("online-softmax-merge", MERGE_SUM_NOT_OUTPUT, [
        "key columns [(0, 3), (3, 4), (4, 9)]", "acc / l equals softmax(s) v",
        "expected -0.38428930109"]),
    "merge: the new block's max only": ("online-softmax-merge", MERGE_BLOCK_MAX_ONLY, [
        "key columns [(0, 3), (3, 4), (4, 9)]", "got nan"]),
    "merge: divides by l at every block": ("online-softmax-merge", MERGE_DIVIDES_EACH_STEP, [
        "key columns [(0, 9)], one at a time: acc / l", "divided by l once"]),
    "merge: a masked row's NaN": ("online-softmax-merge", MERGE_MASKED_ROW_NAN, [
        "key columns [(0, 3), (3, 4), (4, 9)]", "got nan (the first of 6 differing",
        "exp(−inf − (−inf)) is NaN"]),
    "ulysses: the batch axis sent as the rank axis": ("ulysses-all-to-all", ULYSSES_NO_TRANSPOSE, [
        "ulysses_attention equals attention over the whole sequence", "B, H, N, d = (2, 6, 12, 3)",
        "row j of the all-to-all holds heads j·H/P", "synchronous sends"]),
    "ulysses: the chunks kept in the order they arrived": ("ulysses-all-to-all",
                                                           ULYSSES_ARRIVAL_ORDER, [
        "ulysses_attention equals attention over the whole sequence", "the balanced layout",
        "chunk i goes to position i"]),
    "ulysses: an all-gather of every head": ("ulysses-all-to-all", ULYSSES_ALL_GATHER, [
        "ulysses_attention's forward", "the collectives it calls", "expected [('all_to_all'",
        "four all-to-alls of 144"]),
    "ulysses: MPI's own all-to-all": ("ulysses-all-to-all", ULYSSES_MPI_ALLTOALL, [
        "MPI's own collectives do the work", "MPI.Intracomm.Alltoall at "
        "minipar/parallel/context/ulysses.py"]),
    "fp8: no 1e-4 floor under amax": ("fp8-tile-scale", FP8_NO_FLOOR, [
        "quantize_tiles of a (5, 300) activation in float8_e4m3fn: the scales",
        "got 0.0", "at least 1e-4"]),
    "fp8: the multiplier kept as the scale": ("fp8-tile-scale", FP8_INVERTED, [
        "the scales, one per 1x128 block", "scale = amax / fmax, so x ≈ data · scale"]),
    "fp8: one amax per row": ("fp8-tile-scale", FP8_ROW_AMAX, [
        "_block_amax, quantize_tiles of a (5, 300) activation: max |x| of each 1x128 block",
        "expected shape (5, 3), got shape (5, 1)"]),
    "fp8: the largest value, not magnitude": ("fp8-tile-scale", FP8_NO_ABS, [
        "_block_amax, quantize_tiles", "at index (0, 2), got 0.0242", "max |x|"]),
    "fp8: the partial tile dropped": ("fp8-tile-scale", FP8_PARTIAL_DROPPED, [
        "_block_amax", "expected shape (5, 3), got shape (5, 2)", "padded with zeros"]),
}
NEW_TASKS = ["zero-sharded-step", "zero-bubble-w", "vocab-cross-entropy", "moe-top-k",
             "ulysses-all-to-all", "fp8-tile-scale"]


def student_tree(folder, task, code):
    """A tree made for ``task`` whose stub is replaced by ``code`` at the stub's indentation;
    a tuple of codes for a task of several regions, one per stub in the file's order."""
    assignments.make(folder, [task])
    stub = assignments.BY_ID[task].stub()
    path = folder / assignments.BY_ID[task].files[0]
    lines = path.read_text().split("\n")
    codes = code if isinstance(code, tuple) else (code,)
    at = [i for i, line in enumerate(lines) if line.strip() == stub]
    assert len(at) == len(codes), f"{path}: {len(at)} stubs of {task}"
    for i, piece in reversed(list(zip(at, codes))):
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        lines[i:i + 1] = [indent + line for line in textwrap.dedent(piece).strip().split("\n")]
    path.write_text("\n".join(lines))
    return folder


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_solution_scores_zero_saying_what_differs(case, tmp_path):
    task, code, words = WRONG[case]
    result = assignments.grade_task(assignments.BY_ID[task], student_tree(tmp_path, task, code))
    output = result["output"]
    print(f"\n{case}: {result['score']} in {result['seconds']} s\n{output[:1500]}")
    assert result["score"] == 0 and not result["passed"], f"{case}:\n{output}"
    missing = [w for w in words if w not in output]
    assert not missing, f"{case}: {missing} not in the output:\n{output}"
    assert f"Task {task}:" in output.split("\n--- details ---")[0], output  # the block first
    assert result["seconds"] < assignments.TASK_TIMEOUT, result


def test_the_reference_keeps_full_points_on_those_tasks():
    results = assignments.grade(assignments.ROOT, ["checkpoint-sequential", "ring-all-reduce",
                                                   "recursive-halving", "megatron-f-g"])
    for result in results:
        assert result["score"] == result["max_score"] > 0, result


def test_the_reference_keeps_full_points_on_the_new_tasks():
    for result in assignments.grade(assignments.ROOT, NEW_TASKS):
        assert result["score"] == result["max_score"] > 0, result


def test_the_new_tasks_stripped_score_zero_and_cost_only_their_points(tmp_path):
    """A tree with the new tasks stripped: each scores 0 with its stub's message first,
    and a task left in (rank-grid, ddp-buckets) keeps its points."""
    assignments.make(tmp_path, NEW_TASKS)
    results = assignments.grade(tmp_path, NEW_TASKS + ["rank-grid", "ddp-buckets"])
    assert len(results) == len(NEW_TASKS) + 2
    for result in results:  # in the table's order
        task = result["task"]
        full = assignments.BY_ID[task].points
        assert result["score"] == (0 if task in NEW_TASKS else full), result
        if task in NEW_TASKS:
            head = result["output"].split("\n--- details ---")[0]
            assert f"Task {task}:" in head and "NotImplementedError" in result["output"], result
