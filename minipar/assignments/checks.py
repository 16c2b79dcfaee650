"""The checks that grade the assignment tasks (``TASKS`` in __init__.py), one or two per task.

Each test exercises its own task's marked region and as little else as it can, so that stripping
one task fails only that task's tests. A test's name contains its task's id (dashes as
underscores); multi-rank checks go through ``run_on_ranks`` with a short timeout. Students run
them with ``python -m pytest minipar/assignments/checks.py -k ring_all_reduce``; ``minipar
assignment grade`` runs the grader's copy.

A multi-rank check runs its collective below and above MPI's eager limit, on rank counts that
are not powers of two, once with every send synchronous (``MINIPAR_SYNC_SENDS=1``: an ordering
bug deadlocks at every size), and counts the idea's messages. A failed check says first, in one
block, the task, the check, the ranks and size, and expected against got.
"""
import numpy as np
import pytest

# The harness comes from the grader when it grades: its sitecustomize (assignments/sandbox.py)
# makes minipar.testing and minipar.gradcheck, wherever they are imported (here, in a check, on
# a rank), the grader's own copies, while every other minipar module is the tree's, the code
# under test; a tree's testing.py or gradcheck.py made to pass everything never grades it. The
# names stay the library's so that a student runs these checks in the tree unchanged.
from minipar.testing import run_on_ranks

TIMEOUT = 40  # seconds per multi-rank job: a stub that hangs is reported, not waited on
rng = np.random.default_rng(0)
# elements: below MPI's eager limit, and 1 MiB of float64 (a ring step sends 256-350 KiB) above
# it; 1 and 7 leave some of p chunks empty or short, 100 splits evenly in 4 or 5
SIZES = (1, 7, 100, 131075)
FORMS = ("out of place", "in place (out=x)", "into out=")


# --- what a failed check says -------------------------------------------------------------------
def _difference(got, want):
    """'' when got equals want, else where they first differ, in words."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"expected shape {want.shape}, got shape {got.shape}"
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-10, atol=1e-12).reshape(-1))
    if bad.size == 0:
        return ""
    i = int(bad[0])
    at = tuple(int(k) for k in np.unravel_index(i, want.shape)) if want.ndim > 1 else i
    return (f"expected {want.reshape(-1)[i].item()!r} at index {at}, got "
            f"{got.reshape(-1)[i].item()!r} (the first of {bad.size} differing elements of "
            f"{want.size})")


def _expect(task, check, got, want, note=""):
    """An AssertionError whose first lines are the block a student acts on."""
    difference = _difference(got, want)
    if difference:
        note = f"\n  {note}" if note else ""
        raise AssertionError(f"Task {task}: {check}\n  {difference}{note}")


def _attempt(task, check, call, files):
    """call(); an exception it raises (a CommError, the stub's NotImplementedError) becomes the
    block, with the line of the task's own file it came from."""
    import traceback
    try:
        return call()
    except AssertionError:
        raise
    except Exception as error:
        lines = [f"  at {_shown(f.filename)}:{f.lineno} in {f.name}: {f.line}"
                 for f in traceback.extract_tb(error.__traceback__)
                 if f.filename.replace("\\", "/").endswith(files)]
        raise AssertionError(f"Task {task}: {check}\n  raised {type(error).__name__}: {error}"
                             + "".join("\n" + line for line in lines[-1:])) from error


def _shown(path):
    """A path as the student knows it: relative to the tree (the folder the checks run in)."""
    import os
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


_doing = [""]  # the check a rank is in, for _watch_stuck


def _watch_stuck(files):
    """A thread printing, once, the line of the task's own file where this rank's main thread
    waits when its minipar call has made no progress for most of the watchdog's time (the
    watchdog names the call and the peers, not the line)."""
    import os
    import sys
    import threading
    import time
    import traceback

    from minipar.comm import watch
    after = 0.6 * float(os.environ.get("MINIPAR_TIMEOUT") or 20)
    main = threading.main_thread().ident

    def look():
        while True:
            time.sleep(0.2)
            call = watch.state["call"]
            if call is None or time.monotonic() - call.since < after:
                continue
            frames = [f for f in traceback.extract_stack(sys._current_frames()[main])
                      if f.filename.replace("\\", "/").endswith(files)]
            where = (f" at {_shown(frames[-1].filename)}:{frames[-1].lineno} in "
                     f"{frames[-1].name}: {frames[-1].line}" if frames else "")
            # one write per line: the ranks' lines reach mpiexec's output whole
            sys.stderr.write(f"minipar check: rank {watch.world_rank()} stuck in "
                             f"{_doing[0]}{where}\n")
            sys.stderr.flush()
            return
    threading.Thread(target=look, daemon=True).start()


def _on_ranks(task, check, body, nprocs, sends, *args):
    """run_on_ranks(body, nprocs, args=(task, *args)), its sends ``synchronous`` (every send
    waits for its receive) or ``eager`` (MPI's usual); a failure is re-raised as the block a rank
    wrote (or, for a hang, who waits on whom and where), the details trimmed after it."""
    import os
    env = {"MINIPAR_SYNC_SENDS": "1" if sends == "synchronous" else "0",
           "MINIPAR_TIMEOUT": os.environ.get("MINIPAR_TIMEOUT") or "10"}
    try:
        return run_on_ranks(body, nprocs, timeout=TIMEOUT, args=(task, *args), env=env)
    except AssertionError as error:
        raise AssertionError(_feedback(task, check, nprocs, sends, str(error))) from None


def _feedback(task, check, nprocs, sends, text):
    import re
    detail = [line for line in text.strip().splitlines() if line.strip(" ^~")]
    blocks = re.findall(r"^AssertionError: (Task .*?)(?=\n--- |\nranks \[|\Z)", text, re.S | re.M)
    if blocks:  # a rank's own block, the same on every failing rank as a rule: the first
        ranks = re.findall(r"^--- rank (\d+) ---", text, re.M)
        head = (blocks[0].strip() + f"\n  (failed on rank{'s' * (len(ranks) > 1)} "
                f"{', '.join(ranks)} of {nprocs}, {sends} sends)")
        return head + "\n--- details ---\n" + "\n".join(detail[:20] + ["..."] * (len(detail) > 20))
    # a hang: where each rank waits in the task's files (_watch_stuck), then the watchdog's
    # who-waits-on-whom (or, past run_on_ranks' timeout, the call each rank is blocked in)
    where = {}
    for rank, case, at in re.findall(r"minipar check: rank (\d+) stuck in (.*?)(?: at (.*))?$",
                                     text, re.M):
        where.setdefault((case, at), []).append(int(rank))
    lines = [f"ranks {sorted(ranks)} stuck in {case}" + (f"\n    at {at}" if at else "")
             for (case, at), ranks in where.items()]
    lines += list(dict.fromkeys(line.strip() for line in detail if re.search(
        r"minipar watchdog|^\[rank \d+\]   |blocked in", line)))[:12]
    said = ("hung (does a send wait for a receive never posted?):\n  " + "\n  ".join(lines)
            if lines else "failed")
    return (f"Task {task}: {check}, on {nprocs} ranks with {sends} sends: the ranks {said}"
            + "\n--- details ---\n" + "\n".join(detail[:3 if lines else 20]))


# --- the checks ---------------------------------------------------------------------------------
def _gradcheck(task, what, fn, *arrays):
    from minipar.gradcheck import gradcheck
    shapes = " and ".join(str(a.shape) for a in arrays)
    try:
        gradcheck(fn, *arrays)
    except AssertionError as error:
        raise AssertionError(f"Task {task}: {what}, inputs of shapes {shapes}, against finite "
                             f"differences\n  {error}") from None


def test_op_backward_matmul_matches_finite_differences():
    for a, b in [((2, 3, 4), (4, 5)), (4, (4, 3)), ((3, 4), 4)]:
        _gradcheck("op-backward", "the gradients of a @ b", lambda a, b: a @ b,
                   rng.standard_normal(a), rng.standard_normal(b))


def test_layer_norm_backward_matches_finite_differences():
    import minipar.functional as F
    _gradcheck("layer-norm", "the gradients of layer_norm(x, weight, bias)",
               lambda x, w, b: F.layer_norm(x, weight=w, bias=b), rng.standard_normal((2, 3, 6)),
               rng.standard_normal(6), rng.standard_normal(6))
    _gradcheck("layer-norm", "the gradient of layer_norm(x)", lambda x: F.layer_norm(x),
               rng.standard_normal((4, 6)))


@pytest.mark.parametrize("segments", [1, 2, 3, 4])
def test_checkpoint_sequential_same_gradients_as_plain_run(segments):
    """Output and gradients as a plain run's; with 4 segments of 16 modules the idea too: about
    3 segment inputs and one segment's activations held at a time (minipar.memory's counters),
    where a run that keeps every activation holds all 16."""
    import minipar
    from minipar import nn
    from minipar.checkpoint import checkpoint_sequential
    from minipar.memory import ActivationMemory
    if segments < 4:
        model = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(),
                              nn.Linear(8, 2))
        x = minipar.Tensor(rng.standard_normal((4, 5)))
    else:
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.GELU())])
        x = minipar.Tensor(rng.standard_normal((64, 32)))
    task = "checkpoint-sequential"
    call = f"checkpoint_sequential({len(list(model))} modules, {segments})"

    def peak(run, plain=None):
        """The output of run() and the peak activation bytes of it and its backward."""
        model.zero_grad()
        with ActivationMemory() as memory:
            out = _attempt(task, call, run, "minipar/checkpoint.py")
            if plain is not None:  # checked before backward: a wrong output may have no graph
                _expect(task, f"{call} gives the plain run's output", out.data, plain.data)
            _attempt(task, f"backward through {call}", out.sum().backward,
                     "minipar/checkpoint.py")
        return out, memory.peak_bytes
    plain, plain_peak = peak(lambda: model(x))
    grads = [p.grad.copy() for p in model.parameters()]
    _, got_peak = peak(lambda: checkpoint_sequential(model, segments, x), plain)
    for i, (got, want) in enumerate(zip((p.grad for p in model.parameters()), grads)):
        _expect(task, f"{call}: parameter {i}'s gradient equals the plain run's", got, want)
    if segments == 4 and got_peak > plain_peak // 2:
        raise AssertionError(
            f"Task {task}: {call} keeps only each segment's input for backward\n  expected a "
            f"peak activation memory of at most {plain_peak // 2} bytes (half the plain run's "
            f"{plain_peak}), got {got_peak} ({got_peak / plain_peak:.0%} of it): are the "
            f"activations of every segment kept rather than recomputed?")


def _traffic(algorithm, p, n):
    """(messages each rank sends, elements all ranks send together) in one all-reduce of n
    elements: the idea's own count, which a call to MPI's own all-reduce does not make."""
    if algorithm == "ring":  # p-1 steps of the reduce-scatter and p-1 of the all-gather, n/p each
        return [2 * (p - 1)] * p, 2 * (p - 1) * n
    # recursive halving: log2 pof2 steps of halving and as many of doubling among the ranks left
    # after the fold; a folded pair (2i, 2i+1 below 2 rem) passes one whole vector each way
    pof2 = 1 << (p.bit_length() - 1)
    rem, steps = p - pof2, pof2.bit_length() - 1
    sends = [1 if r < 2 * rem and r % 2 == 0 else (r < 2 * rem) + 2 * steps for r in range(p)]
    return sends, 2 * (pof2 - 1) * n + 2 * rem * n


def _all_reduce_body(task, algorithm):
    """Every form and op of ``all_reduce`` and of ``reduce_scatter`` with ``algorithm`` at every
    size; the counters of one all-reduce per size against the idea's."""
    from minipar import comm
    from minipar.comm.buffers import chunk_bounds
    world = comm.world()
    p, r = world.size, world.rank
    files = ("minipar/comm/patterns.py",)
    _watch_stuck(files)
    inputs = "rank r holds 1000 (r + 1) + i % 997 at index i"
    for n in SIZES:
        i = np.arange(n)
        mine = 1000.0 * (r + 1) + i % 997  # every rank and every index adds something different
        want = {"sum": 1000.0 * p * (p + 1) / 2 + p * (i % 997), "max": 1000.0 * p + i % 997}
        for op in ("sum", "max"):
            for form in FORMS:
                check = f"{algorithm} all-reduce ({op}, {form}) of {n} float64 on {p} ranks"
                _doing[0] = check
                x = mine.copy()
                out = {FORMS[0]: None, FORMS[1]: x, FORMS[2]: np.empty(n)}[form]
                world.counters.reset()
                got = _attempt(task, check, lambda: world.all_reduce(
                    x, op=op, algorithm=algorithm, out=out), files)
                counted = world.counters.snapshot()
                _expect(task, f"{check}: rank {r}'s result", got, want[op], inputs)
                if out is not None and got is not out:
                    raise AssertionError(f"Task {task}: {check}\n  the result is not in out")
                if form != FORMS[1]:
                    _expect(task, f"{check}: rank {r}'s input stays as it was", x, mine, inputs)
                if op == "sum" and form == FORMS[0]:
                    _expect_traffic(task, check, world, algorithm, n, counted)
            # the reduce-scatter runs the region in place (its input copied into one buffer)
            check = f"{algorithm} reduce-scatter ({op}) of {n} float64 on {p} ranks"
            _doing[0] = check
            lo, hi = chunk_bounds(n, p)[r:r + 2]
            got = _attempt(task, check, lambda: world.reduce_scatter(
                mine, op=op, algorithm=algorithm), files)
            _expect(task, f"{check}: rank {r}'s chunk, elements {lo}..{hi - 1}", got,
                    want[op][lo:hi], inputs)


def _expect_traffic(task, check, world, algorithm, n, counted):
    """Every rank's messages and bytes sent, by the communicator's counters, against the idea."""
    seen = world.all_gather_object((counted["messages_sent"], counted["bytes_sent"]))
    messages, elements = _traffic(algorithm, world.size, n)
    got = [m for m, _ in seen]
    total = sum(b for _, b in seen)
    if got != messages or total != 8 * elements:
        raise AssertionError(
            f"Task {task}: {check}: the messages the idea sends, by the communicator's "
            f"counters\n  expected {messages} messages sent by ranks 0..{world.size - 1} and "
            f"{8 * elements} bytes in all, got {got} messages and {total} bytes"
            + ("\n  too few: is part of the work done by MPI's own collective, which sends "
               "no message the counters see?" if sum(got) < sum(messages) else ""))


# a rank count that is not a power of two with synchronous sends, first (a hang shows at once),
# then a power of two with MPI's usual sends
@pytest.mark.parametrize("nprocs, sends", [pytest.param(3, "synchronous",
                                                        id="3-ranks-synchronous-sends"),
                                           pytest.param(4, "eager", id="4-ranks")])
def test_ring_all_reduce_equals_the_sum(nprocs, sends):
    _on_ranks("ring-all-reduce", "the ring all-reduce equals the sum", _all_reduce_body,
              nprocs, sends, "ring")


@pytest.mark.parametrize("nprocs, sends", [pytest.param(5, "synchronous",
                                                        id="5-ranks-synchronous-sends"),
                                           pytest.param(4, "eager", id="4-ranks")])
def test_recursive_halving_all_reduce_equals_the_sum(nprocs, sends):
    _on_ranks("recursive-halving", "the recursive-halving all-reduce equals the sum",
              _all_reduce_body, nprocs, sends, "recursive_halving")


def test_ddp_buckets_follow_pytorchs_rule():
    from minipar import Tensor
    from minipar.parallel.data.buckets import make_buckets
    f32, f64 = np.float32, np.float64
    params = [Tensor(np.zeros(n, dtype)) for n, dtype in
              [(10, f32), (2, f32), (30, f32), (4, f64), (4, f64)]]
    names = {id(p): i for i, p in enumerate(params)}
    cases = [(params, 40, [[4, 3], [2], [1, 0]]), (params[:3], 10 ** 6, [[2, 1, 0]])]
    for given, cap, want in cases:
        check = (f"make_buckets of parameters {list(range(len(given)))} (float32 10, 2, 30; "
                 f"float64 4, 4) capped at {cap} bytes")
        got = [[names[id(p)] for p in b] for b in
               _attempt("ddp-buckets", check, lambda: make_buckets(given, cap_bytes=cap),
                        "minipar/parallel/data/buckets.py")]
        assert got == want, (f"Task ddp-buckets: {check}: reversed, a dtype change cuts, a bucket "
                             f"closes at >= cap\n  expected {want}, got {got}")


def _megatron_body(task):
    import minipar
    from minipar import comm
    from minipar.parallel.tensor.mappings import copy_to_tensor_region, reduce_from_tensor_region
    world = comm.world()
    p, r = world.size, world.rank
    files = ("minipar/parallel/tensor/mappings.py",)
    _watch_stuck(files)
    total = p * (p + 1) / 2
    for n in (3, 40000):  # 40000 float64: above MPI's eager limit
        where = f"on {p} ranks, {n} elements; rank r's x is r + 1 everywhere"
        _doing[0] = f"f and g {where}"
        x = minipar.Tensor(np.full(n, r + 1.0), requires_grad=True)
        y = _attempt(task, f"f(x) {where}", lambda: copy_to_tensor_region(x, world), files)
        _expect(task, f"f's forward is the identity, {where}", y.data, x.data)
        _attempt(task, f"backward through f {where}", (y * (r + 1.0)).sum().backward, files)
        _expect(task, f"f's backward all-reduces the gradient (r + 1 on rank r), {where}",
                x.grad, np.full(n, total))
        x2 = minipar.Tensor(np.full(n, r + 1.0), requires_grad=True)
        z = _attempt(task, f"g(x) {where}", lambda: reduce_from_tensor_region(x2, world), files)
        _expect(task, f"g's forward all-reduces, {where}", z.data, np.full(n, total))
        _attempt(task, f"backward through g {where}", (z * 2.0).sum().backward, files)
        _expect(task, f"g's backward is the identity (gradient 2), {where}", x2.grad,
                np.full(n, 2.0))


@pytest.mark.parametrize("nprocs, sends", [pytest.param(3, "synchronous",
                                                        id="3-ranks-synchronous-sends"),
                                           pytest.param(2, "eager", id="2-ranks")])
def test_megatron_f_g_are_conjugate(nprocs, sends):
    _on_ranks("megatron-f-g", "f and g are conjugate", _megatron_body, nprocs, sends)


def test_one_f_one_b_order_and_in_flight():
    from minipar.parallel.pipeline import build, validate
    from minipar.parallel.pipeline.schedules import B, F, _one_f_one_b
    cases = [((4, 6, 1), [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (F, 4), (B, 2), (F, 5),
                          (B, 3), (B, 4), (B, 5)]),
             ((4, 2, 0), [(F, 0), (F, 1), (B, 0), (B, 1)]),
             ((4, 6, 3), [pair for k in range(6) for pair in ((F, k), (B, k))])]
    for (p, m, r), want in cases:
        check = f"_one_f_one_b(p={p}, m={m}, rank={r}): warm-up, steady 1F1B, drain"
        got = _attempt("one-f-one-b", check, lambda: _one_f_one_b(p, m, r),
                       "minipar/parallel/pipeline/schedules.py")
        if got != want:
            first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            raise AssertionError(f"Task one-f-one-b: {check}\n  expected {want}\n  got      "
                                 f"{got}\n  (first difference at position {first})")
    validate(build("1f1b", 4, 8))


def test_rank_grid_coords_and_rank_are_inverse():
    from minipar.parallel.groups import RankGrid
    task = "rank-grid"
    grid, made = RankGrid(16, tp=2, pp=2), "RankGrid(16, tp=2, pp=2)"
    other = RankGrid(8, tp=2, pp=2, order="pp-tp-dp")
    for g, name, rank, want in [(grid, made, 0, {"tp": 0, "dp": 0, "pp": 0}),
                                (grid, made, 5, {"tp": 1, "dp": 2, "pp": 0}),
                                (grid, made, 13, {"tp": 1, "dp": 2, "pp": 1}),
                                (other, 'RankGrid(8, tp=2, pp=2, order="pp-tp-dp")', 5,
                                 {"pp": 1, "tp": 0, "dp": 1})]:
        check = f"{name}.coords({rank})"
        got = _attempt(task, check, lambda: g.coords(rank), "minipar/parallel/groups.py")
        assert got == want, f"Task {task}: {check}\n  expected {want}, got {got}"
    for rank in range(16):
        back = _attempt(task, f"{made}.rank(**coords({rank}))",
                        lambda: grid.rank(**grid.coords(rank)), "minipar/parallel/groups.py")
        assert back == rank, (f"Task {task}: {made}.rank(**coords({rank})) gives the rank "
                              f"back\n  expected {rank}, got {back}")
    with pytest.raises(ValueError):
        grid.coords(16)
