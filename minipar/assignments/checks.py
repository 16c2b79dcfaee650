"""The checks that grade the assignment tasks (``TASKS`` in __init__.py), one or two per task.

Each test exercises its own task's marked region and as little else as it can, so that stripping
one task fails only that task's tests. A test's name contains its task's id (dashes as
underscores); multi-rank checks go through ``run_on_ranks`` with a short timeout. Students run
them with ``python -m pytest minipar/assignments/checks.py -k ring_all_reduce``; ``minipar
assignment grade`` runs the grader's copy.

A multi-rank check runs its collective below and above MPI's eager limit, on rank counts that
are not powers of two, once with every send synchronous (``MINIPAR_SYNC_SENDS=1``: an ordering
bug deadlocks at every size), counts the idea's messages and checks what each one carries, and
fails any call of MPI's own collectives from the task's file. A failed check says first, in one
block, the task, the check, the ranks and size, and expected against got.
"""
import numpy as np
import pytest

# The harness comes from the grader when it grades: its sitecustomize (assignments/sandbox.py)
# makes minipar.testing, minipar.gradcheck and minipar.assignments.feedback (the failure
# messages), wherever they are imported (here, in a check, on a rank), the grader's own copies,
# while every other minipar module is the tree's, the code under test; a tree's copy made to pass
# everything never grades it. The names stay the library's: a student runs these checks as is.
from minipar.assignments.feedback import (_attempt, _doing, _expect,  # noqa: F401
                                          _expect_partial_sums, _expect_traffic, _gradcheck,
                                          _on_ranks, _Watch, _watch_stuck)
rng = np.random.default_rng(0)
# elements: below MPI's eager limit, and 1 MiB of float64 (a ring step sends 256-350 KiB) above
# it; 1 and 7 leave some of p chunks empty or short, 100 splits evenly in 4 or 5
SIZES = (1, 7, 100, 131075)
FORMS = ("out of place", "in place (out=x)", "into out=")


def _runs(odd, power_of_two):
    """A multi-rank check's runs: a rank count that is not a power of two with synchronous sends,
    first (a hang shows at once), then a power of two with MPI's usual sends."""
    return [pytest.param(odd, "synchronous", id=f"{odd}-ranks-synchronous-sends"),
            pytest.param(power_of_two, "eager", id=f"{power_of_two}-ranks")]


# --- the checks ---------------------------------------------------------------------------------
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


def _all_reduce_body(task, algorithm):
    """Every form and op of ``all_reduce`` and of ``reduce_scatter`` with ``algorithm`` at every
    size, none of MPI's own collectives called from the task's file; the counters of one
    all-reduce per size, and what each of its messages carries, against the idea's."""
    from minipar import comm
    from minipar.comm.buffers import chunk_bounds
    world = comm.world()
    p, r = world.size, world.rank
    files = ("minipar/comm/patterns.py",)
    _watch_stuck(files)
    inputs = "rank r holds 1000 (r + 1) + i % 997 at index i"
    with _Watch(files, world) as watch:
        for n in SIZES:
            i = np.arange(n)
            mine = 1000.0 * (r + 1) + i % 997  # every rank and every index adds something else
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
                    watch.expect_no_mpi_collective(task, check)
                    _expect(task, f"{check}: rank {r}'s result", got, want[op], inputs)
                    if out is not None and got is not out:
                        raise AssertionError(f"Task {task}: {check}\n  the result is not in out")
                    if form != FORMS[1]:
                        _expect(task, f"{check}: rank {r}'s input stays as it was", x, mine,
                                inputs)
                    if op == "sum" and form == FORMS[0]:
                        _expect_traffic(task, check, world, algorithm, n, counted)
                if op == "sum" and n >= p:  # every chunk holds elements: each message a sum
                    check = (f"{algorithm} all-reduce (sum) of {n} float64 on {p} ranks, rank "
                             f"q's input 2**q everywhere")
                    _doing[0], _ = check, watch.sent.clear()
                    got = _attempt(task, check, lambda: world.all_reduce(
                        np.full(n, 2.0 ** r), algorithm=algorithm), files)
                    watch.expect_no_mpi_collective(task, check)
                    _expect(task, f"{check}: rank {r}'s result", got, np.full(n, 2.0 ** p - 1))
                    _expect_partial_sums(task, check, world, algorithm, watch.sent)
                # the reduce-scatter runs the region in place (its input copied into one buffer)
                check = f"{algorithm} reduce-scatter ({op}) of {n} float64 on {p} ranks"
                _doing[0] = check
                lo, hi = chunk_bounds(n, p)[r:r + 2]
                got = _attempt(task, check, lambda: world.reduce_scatter(
                    mine, op=op, algorithm=algorithm), files)
                watch.expect_no_mpi_collective(task, check)
                _expect(task, f"{check}: rank {r}'s chunk, elements {lo}..{hi - 1}", got,
                        want[op][lo:hi], inputs)


@pytest.mark.parametrize("nprocs, sends", _runs(3, 4))
def test_ring_all_reduce_equals_the_sum(nprocs, sends):
    _on_ranks("ring-all-reduce", "the ring all-reduce equals the sum", _all_reduce_body,
              nprocs, sends, "ring")


@pytest.mark.parametrize("nprocs, sends", _runs(5, 4))
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
    hint = "f: identity forward, one all-reduce of the gradient backward; g: the reverse"
    for n in (3, 40000):  # 40000 float64: above MPI's eager limit
        where = f"on {p} ranks, {n} elements; rank r's x is r + 1 everywhere"
        one = [("all_reduce", "sum", n)]
        _doing[0] = f"f and g {where}"
        with _Watch(files, world) as watch:
            x = minipar.Tensor(np.full(n, r + 1.0), requires_grad=True)
            y = _attempt(task, f"f(x) {where}", lambda: copy_to_tensor_region(x, world), files)
            watch.expect_collectives(task, f"f's forward {where}", [], hint)
            _expect(task, f"f's forward is the identity, {where}", y.data, x.data)
            _attempt(task, f"backward through f {where}", (y * (r + 1.0)).sum().backward, files)
            watch.expect_collectives(task, f"f's backward {where}", one, hint)
            _expect(task, f"f's backward all-reduces the gradient (r + 1 on rank r), {where}",
                    x.grad, np.full(n, total))
            x2 = minipar.Tensor(np.full(n, r + 1.0), requires_grad=True)
            z = _attempt(task, f"g(x) {where}", lambda: reduce_from_tensor_region(x2, world),
                         files)
            watch.expect_collectives(task, f"g's forward {where}", one, hint)
            _expect(task, f"g's forward all-reduces, {where}", z.data, np.full(n, total))
            _attempt(task, f"backward through g {where}", (z * 2.0).sum().backward, files)
            watch.expect_collectives(task, f"g's backward {where}", [], hint)
            _expect(task, f"g's backward is the identity (gradient 2), {where}", x2.grad,
                    np.full(n, 2.0))


@pytest.mark.parametrize("nprocs, sends", _runs(3, 2))
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
    for g, name, rank, want in [(grid, made, 0, {"tp": 0, "cp": 0, "dp": 0, "pp": 0}),
                                (grid, made, 5, {"tp": 1, "cp": 0, "dp": 2, "pp": 0}),
                                (grid, made, 13, {"tp": 1, "cp": 0, "dp": 2, "pp": 1}),
                                (other, 'RankGrid(8, tp=2, pp=2, order="pp-tp-dp")', 5,
                                 {"pp": 1, "tp": 0, "cp": 0, "dp": 1})]:
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


def _zero_body(task, stage):
    """ZeRO's parameters after two steps of Adam equal a plain Adam's on the averaged gradient:
    each rank updates only its shard, then the shards are all-gathered."""
    import minipar
    from minipar import comm, nn
    from minipar.optim import Adam
    from minipar.parallel.data import ZeRO
    world, files = comm.world(), ("minipar/parallel/data/zero.py",)
    p, r, _ = world.size, world.rank, _watch_stuck(files)

    def model():
        minipar.manual_seed(5)  # the same start on every rank; 40000 float64 above MPI's eager
        return nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 5000 * p + 1)).double()
    data = np.random.default_rng(1).standard_normal((2, p, 3, 6))  # step, rank, batch, features
    (sharded, plain), check = (model(), model()), f"ZeRO-{stage}'s step of Adam on {p} ranks"
    zero, reference = ZeRO(sharded, lambda ps: Adam(ps, lr=0.05), world, stage=stage), Adam(
        plain.parameters(), lr=0.05)
    for step in range(2):
        _doing[0] = f"{check}, step {step}"
        zero.zero_grad()  # rank r's batch its own
        (sharded(minipar.Tensor(data[step, r])) ** 2).mean().backward()
        with _Watch(files, world) as watch:
            _attempt(task, f"{check}, step {step}", zero.step, files)
        watch.collectives[:] = [c for c in watch.collectives if c[0] != "reduce_scatter"]
        watch.expect_collectives(
            task, f"{check}, step {step}", [("all_gather", None, s.data.size) for s in zero.shards],
            "after the gradients' reduce-scatter, each rank updates its own shard and the "
            "shards are all-gathered, one all-gather per flat buffer: no all-reduce")
        reference.zero_grad()  # the plain step: every rank's batch, the loss averaged over ranks
        losses = [(plain(minipar.Tensor(data[step, q])) ** 2).mean() for q in range(p)]
        (sum(losses[1:], losses[0]) * (1.0 / p)).backward()
        reference.step()
        for i, (got, want) in enumerate(zip(sharded.parameters(), plain.parameters())):
            _expect(task, f"{check}: after step {step}, rank {r}'s parameter {i} equals a plain "
                    "Adam step's on the averaged gradient", got.data, want.data,
                    "is every rank's updated shard all-gathered into the parameters?")


@pytest.mark.parametrize("nprocs, sends, stage", [
    pytest.param(3, "synchronous", 1, id="3-ranks-synchronous-sends-stage-1"),
    pytest.param(2, "eager", 2, id="2-ranks-stage-2")])
def test_zero_sharded_step_equals_a_plain_step(nprocs, sends, stage):
    _on_ranks("zero-sharded-step", "ZeRO's sharded step equals a plain step", _zero_body,
              nprocs, sends, stage)


def test_zero_bubble_w_gives_the_plain_gradients():
    """B (run_backward with defer) then W (WeightPass.run) per micro-batch, two micro-batches
    accumulated: the input's and every weight's gradient as two plain backwards give them."""
    import minipar
    from minipar import nn
    from minipar.graph import WeightPass, run_backward
    task, _ = "zero-bubble-w", minipar.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3)).double()
    xs = [np.random.default_rng(k).standard_normal((5, 4)) for k in range(2)]
    grads = {}
    for split in (False, True):
        model.zero_grad()
        inputs = [minipar.Tensor(x, requires_grad=True) for x in xs]
        for k, x in enumerate(inputs):
            loss = (model(x) ** 2).sum()
            if not split:
                loss.backward()
                continue
            w = WeightPass(model.parameters())
            run_backward([loss], [np.ones(())], defer=w)
            _attempt(task, f"WeightPass.run() after the B of micro-batch {k}", w.run,
                     "minipar/graph.py")
        grads[split] = [x.grad for x in inputs] + [q.grad for q in model.parameters()]
    names = [f"micro-batch {k}'s input" for k in range(2)] + [f"parameter {i}" for i in range(9)]
    for name, got, want in zip(names, grads[True], grads[False]):
        _expect(task, f"B then W for 2 micro-batches of Linear, LayerNorm, GELU, Linear: {name}'s "
                f"gradient equals two plain backwards'", got, want,
                "are W's gradients added to those of earlier micro-batches (and hooks called)?")


def _vocab_body(task):
    """The loss and its gradient on each rank's slice of the vocabulary against
    functional.cross_entropy on the whole logits, ignored targets included."""
    import minipar
    import minipar.functional as F
    from minipar import comm
    from minipar.parallel.tensor import vocab_parallel_cross_entropy
    world, files = comm.world(), ("minipar/parallel/tensor/embedding.py",)
    p, r, _ = world.size, world.rank, _watch_stuck(files)
    for tokens, v in ((6, 3), (7000, 2)):  # 7000 float64 per all-reduce: above the eager limit
        where = _doing[0] = f"{tokens} tokens, vocabulary {v * p} on {p} ranks ({v} each)"
        data = np.random.default_rng(tokens)
        # token 0's logits large: they overflow unless the max is taken first
        logits = data.standard_normal((tokens, v * p)) * 3 + 50.0 * (np.arange(tokens) < 1)[:, None]
        targets = data.integers(0, v * p, tokens)
        targets[1] = -100  # ignored
        full = minipar.Tensor(logits.copy(), requires_grad=True)
        want = F.cross_entropy(full, targets)
        want.backward()
        mine = minipar.Tensor(logits[:, r * v:(r + 1) * v].copy(), requires_grad=True)
        with _Watch(files, world) as watch:
            got = _attempt(task, f"vocab_parallel_cross_entropy, {where}",
                           lambda: vocab_parallel_cross_entropy(mine, targets, world), files)
            watch.expect_collectives(
                task, f"vocab_parallel_cross_entropy, {where}",
                [("all_reduce", "max", tokens)] + [("all_reduce", "sum", tokens)] * 2,
                "one all-reduce each of the rows' max, their sums of exp, and the target "
                "logits: numbers per token, never the logits themselves")
        _expect(task, f"vocab_parallel_cross_entropy equals the loss on the whole logits, {where}",
                got.data, want.data, "rank r holds columns r*v..(r+1)*v-1 of the logits")
        got.backward()
        _expect(task, f"the gradient of rank {r}'s logit slice, {where}", mine.grad,
                full.grad[:, r * v:(r + 1) * v])


@pytest.mark.parametrize("nprocs, sends", _runs(3, 2))
def test_vocab_cross_entropy_equals_the_full_loss(nprocs, sends):
    _on_ranks("vocab-cross-entropy", "the vocab-parallel loss equals the full one", _vocab_body,
              nprocs, sends)


def test_moe_top_k_gates_and_capacity_drops():
    """MoE.gate against the rule written plainly: softmax, the k largest (ties to the lower
    expert), gates renormalised when k > 1, and each expert's slots given in token order, those
    at or past the capacity dropped."""
    import minipar
    from minipar.nn.moe import MoE
    task = "moe-top-k"
    for experts, k, factor in ((4, 1, 1.0), (4, 2, 0.5), (5, 2, None), (3, 3, 1.0)):
        minipar.manual_seed(7)
        moe = MoE(n_embd=4, n_experts=experts, top_k=k, capacity_factor=factor).double()
        x = minipar.Tensor(np.random.default_rng(experts + k).standard_normal((12, 4)) * 2)
        call = f"MoE(n_experts={experts}, top_k={k}, capacity_factor={factor}).gate of 12 tokens"
        probs, gates, routing = _attempt(task, call, lambda: moe.gate(x), "minipar/nn/moe.py")
        want_p = np.exp(moe.router(x).data)  # small logits: no max needed
        want_p /= want_p.sum(1, keepdims=True)
        expert = np.argsort(-want_p, axis=1, kind="stable")[:, :k]
        want_g = np.take_along_axis(want_p, expert, 1)
        want_g = want_g / want_g.sum(1, keepdims=True) if k > 1 else want_g
        cap = 12 * k if factor is None else int(np.ceil(factor * 12 * k / experts))
        flat = expert.reshape(-1)  # token 0's choices, then token 1's, ...
        slot = np.array([(flat[:i] == e).sum() for i, e in enumerate(flat)]).reshape(12, k)
        for what, got, want in [("the probabilities (softmax of the router)", probs.data, want_p),
                                ("the chosen experts", routing.expert, expert),
                                ("the gates", gates.data, want_g),
                                ("each choice's slot in its expert, in token order",
                                 routing.slot, slot),
                                (f"which choices are kept (slot < capacity {cap})", routing.kept,
                                 slot < cap)]:
            _expect(task, f"{call}: {what}", np.asarray(got, float), np.asarray(want, float))
        assert getattr(gates, "requires_grad", False), (
            f"Task {task}: {call}: the gates\n  expected a Tensor the router's gradient reaches")




# the loss scaler's rule worked out by hand (tests/test_assignments.py replays each case on
# torch.amp.GradScaler): the settings; found_inf at each step (how many optimizers found an inf
# or NaN); after it, the scale as a power of two and the growth tracker. From 2**127 a growth by
# 4 overflows float32: the scale stays.
LOSS_SCALE_CASES = {
    "growth-interval-3": (dict(init_scale=2.0**10, growth_interval=3),
                          [0, 0, 0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0],
                          [10, 10, 11, 11, 10, 10, 10, 9, 9, 8, 7, 7, 7, 8],
                          [1, 2, 0, 1, 0, 1, 2, 0, 1, 0, 0, 1, 2, 0]),
    "factors-4-and-0.125-to-float32s-top": (
        dict(init_scale=2.0**125, growth_factor=4.0, backoff_factor=0.125, growth_interval=1),
        [0, 1, 2, 0, 0, 0, 0, 1], [127, 124, 121, 123, 125, 127, 127, 124], [0] * 8),
}


@pytest.mark.parametrize("case", list(LOSS_SCALE_CASES))
def test_loss_scale_update_follows_the_rule(case):
    """GradScaler._update_scale(found_inf), the rule update() applies, step by step: the scale
    and the growth tracker after each step against LOSS_SCALE_CASES."""
    from minipar.amp import GradScaler
    task, (settings, found, powers, want_trackers) = "loss-scale-update", LOSS_SCALE_CASES[case]
    scaler, scales, trackers = GradScaler(**settings), [], []
    call = f"GradScaler({', '.join(f'{k}={v!r}' for k, v in settings.items())})._update_scale"
    for k, inf in enumerate(found):
        _attempt(task, f"{call}({inf}) at step {k}", lambda: scaler._update_scale(float(inf)),
                 "minipar/amp/grad_scaler.py")
        scales.append(scaler.get_scale())
        trackers.append(scaler.state_dict()["_growth_tracker"])
    steps = f"{call}(found_inf), found_inf = {found} at steps 0, 1, ..."
    _expect(task, f"{steps}: the scale after each step", scales, [2.0**e for e in powers],
            "backoff_factor after an inf or NaN; growth_factor after growth_interval clean steps "
            "in a row, unless that overflows float32")
    _expect(task, f"{steps}: the growth tracker after each step", trackers, want_trackers,
            "one more per clean step; 0 after a backoff or a growth")


def test_online_softmax_merge_equals_softmax_at_once():
    """_fold of the key blocks one at a time, then acc / l and m + log l: the softmax(s) v and the
    log-sum-exp of all keys at once, in float64 (2 heads, 4 queries, 9 keys)."""
    from minipar.parallel.context.ring import _fold
    task, data = "online-softmax-merge", np.random.default_rng(14)
    s, v = data.standard_normal((2, 4, 9)), data.standard_normal((2, 9, 3))
    s[:, 0, :3] = s[:, 3, 4:] = -np.inf  # a block of row 0 (the first) and of row 3 all masked
    s[:, 1, :3] += 1000.0  # exp overflows unless taken from the running max
    s[:, 2, 4:] += 9.0  # the max grows a lot in a later block
    e = np.exp(s - s.max(-1, keepdims=True))
    want, lse = e @ v / e.sum(-1)[..., None], s.max(-1) + np.log(e.sum(-1))
    hint = ("m, l and acc change in place; when the max grows, both l and acc are multiplied by "
            "exp(m_old − m_new); acc stays unnormalised (divided by l once, after the last "
            "block); a row that has seen only −inf keys has no max to subtract (exp(−inf − "
            "(−inf)) is NaN)")
    for cuts in ((0, 9), (0, 3, 4, 9), (0, 3, 5, 6, 9)):
        m, l, acc = np.full((2, 4), -np.inf), np.zeros((2, 4)), np.zeros((2, 4, 3))
        call = f"_fold of the scores' key columns {list(zip(cuts, cuts[1:]))}, one at a time"
        for lo, hi in zip(cuts, cuts[1:]):
            _attempt(task, f"{call}: columns {lo}..{hi - 1}", lambda: _fold(
                s[..., lo:hi], v[..., lo:hi, :], m, l, acc), "minipar/parallel/context/ring.py")
        _expect(task, f"{call}: acc / l equals softmax(s) v of all keys at once",
                acc / l[..., None], want, hint)
        _expect(task, f"{call}: m + log l equals the log-sum-exp of all keys at once",
                m + np.log(l), lse, hint)


def _ulysses_body(task):
    """ulysses_attention on this rank's shard of q, k, v (both layouts, causal and not): the
    rows and the gradients of causal_self_attention on the whole sequence, by four all-to-alls
    each way (q, k, v and the output) of this rank's whole shard."""
    import minipar
    from minipar import comm
    from minipar.attention import causal_self_attention
    from minipar.parallel.context import split_sequence, ulysses_attention
    from minipar.parallel.context.ulysses import _full_attention
    world, files = comm.world(), ("minipar/parallel/context/ulysses.py",)
    p, _ = world.size, _watch_stuck(files)
    hint = ("row j of the all-to-all holds heads j·H/P .. (j+1)·H/P − 1 of this rank's tokens; "
            "rank s sends its two chunks in its layout (_placement): chunk i goes to position i "
            "of the whole sequence, and _heads_to_seq undoes exactly that")
    # n = 256 tokens of 2 heads of 16 float64 on each rank: a row of 128 KiB, above the eager limit
    for n, layout, causal in ((4, "balanced", True), (4, "contiguous", True),
                              (4, "balanced", False), (256, "balanced", True)):
        shape = (2, 2 * p, n * p, 16 if n > 4 else 3)  # B = 2: the batch stays in its place
        where = _doing[0] = (f"B, H, N, d = {shape} on {p} ranks, the {layout} layout, "
                             f"causal={causal}")
        data = np.random.default_rng(n)
        full = [minipar.Tensor(data.standard_normal(shape), requires_grad=True) for _ in "qkv"]
        seed = data.standard_normal(shape)  # the output's gradient
        want = (causal_self_attention if causal else _full_attention)(*full)
        (want * minipar.Tensor(seed)).sum().backward()
        mine = [minipar.Tensor(split_sequence(t.data, world, 2, layout), requires_grad=True)
                for t in full]
        size, four = int(np.prod(shape)) // p, f"four all-to-alls of {int(np.prod(shape)) // p}"
        # _check agrees the ranks' shapes with MPI's allgather: outside the task
        with _Watch(files, world, exempt=("_check",)) as watch:
            out = _attempt(task, f"ulysses_attention, {where}", lambda: ulysses_attention(
                *mine, world, causal=causal, layout=layout), files)
            watch.expect_collectives(task, f"ulysses_attention's forward, {where}",
                                     [("all_to_all", None, size)] * 4, f"{four}: q, k, v, out")
            _expect(task, f"ulysses_attention equals attention over the whole sequence, {where}",
                    out.data, split_sequence(want.data, world, 2, layout), hint)
            g = minipar.Tensor(split_sequence(seed, world, 2, layout))
            _attempt(task, f"backward through ulysses_attention, {where}",
                     (out * g).sum().backward, files)
            watch.expect_collectives(task, f"ulysses_attention's backward, {where}",
                                     [("all_to_all", None, size)] * 4,
                                     f"{four}: the output's gradient, then q's, k's and v's")
        for name, t, m in zip("qkv", full, mine):
            _expect(task, f"the gradient of this rank's {name}, {where}", m.grad,
                    split_sequence(t.grad, world, 2, layout), hint)


@pytest.mark.parametrize("nprocs, sends", _runs(3, 4))
def test_ulysses_all_to_all_equals_attention_over_the_whole_sequence(nprocs, sends):
    _on_ranks("ulysses-all-to-all", "Ulysses' attention equals the whole sequence's",
              _ulysses_body, nprocs, sends)


def _deepseek_reference(x, fmax, block):
    """DeepSeek-V3 §3.3 written out block by block: amax = max(max |x| of the block, 1e-4),
    data = x · fmax / amax cast (±fmax saturated), scale = amax / fmax, float32 throughout."""
    counts = [-(-n // b) for n, b in zip(x.shape, block)]
    amax, data = np.zeros(counts, np.float32), np.zeros(x.shape, np.float32)
    for i in np.ndindex(*counts):
        part = tuple(slice(k * b, (k + 1) * b) for k, b in zip(i, block))
        amax[i] = np.abs(x[part]).max()
        floor = np.maximum(amax[i], np.float32(1e-4))
        data[part] = np.clip(x[part] * (fmax / floor), -fmax, fmax)
    return data, np.maximum(amax, np.float32(1e-4)) / fmax, amax


def test_fp8_tile_scale_equals_deepseeks_definition():
    """quantize_tiles (1x128 along the last axis) and quantize_blocks (128x128) against the
    definition: the same FP8 bits and float32 scales, partial tiles, a zero tile, a negative
    outlier, an inf's tile NaN and the others untouched, e4m3 and e5m2."""
    from minipar import backend
    from minipar.amp.float8_recipes import _block_amax, quantize_blocks, quantize_tiles
    task, data, files = "fp8-tile-scale", np.random.default_rng(17), "minipar/amp/float8_recipes.py"
    hint = ("amax per block of max |x| (partial blocks padded with zeros), at least 1e-4; "
            "data = x · fmax / amax saturated to ±fmax; scale = amax / fmax, so x ≈ data · scale")
    x = (data.standard_normal((5, 300)) * 0.01).astype(np.float32)
    x[1, 5], x[2, :128], x[3, 140] = -900.0, 0.0, np.inf  # an outlier, a zero tile, an inf
    w = data.standard_normal((200, 300)).astype(np.float32)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        fmax, d = np.float32(backend.finfo(name).max), backend.dtype(name)
        for what, a, block, call in (
                ("quantize_tiles of a (5, 300) activation", x, (1, 128), quantize_tiles),
                ("quantize_blocks of a (200, 300) weight", w, (128, 128), quantize_blocks)):
            with np.errstate(invalid="ignore", over="ignore"):
                want, scale, amax = _deepseek_reference(a, fmax, block)
            _expect(task, f"_block_amax, {what}: max |x| of each {block[0]}x{block[1]} block",
                    _attempt(task, f"_block_amax, {what}", lambda: _block_amax(a, block), files),
                    amax, hint)
            q = _attempt(task, f"{what} in {name}", lambda: call(a, name), files)
            _expect(task, f"{what} in {name}: the scales, one per {block[0]}x{block[1]} block",
                    np.asarray(q.scale), scale, hint)
            _expect(task, f"{what} in {name}: the FP8 data", np.asarray(q.data).astype(
                np.float32), backend.cast(want, d).astype(np.float32), hint)
