"""float16 and bfloat16 on the wire and in the reductions: 2-byte messages (half float32's bytes
by the counters), sums added in float32, the same bits on every rank, the rounding bound of
docs/comm.md, and MPI's own reduction refusing bfloat16 on every rank.

One mpiexec launch per rank count runs the whole table and returns the failing cases."""
import ml_dtypes
import numpy as np
import pytest

from minipar.testing import run_on_ranks

BF16 = ml_dtypes.bfloat16
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # unit roundoff: half an ulp, relative
MANTISSA = {"float16": 10, "bfloat16": 7}


def gamma(k, name):
    """Higham's gamma_k / u = k / (1 - k u): k roundings, in units of u sum |x_i|."""
    return k / (1 - k * UNIT[name])


def ulps(got, exact, dtype):
    """|got - exact| in units in the last place of dtype at |exact| (normal range)."""
    tiny = float(ml_dtypes.finfo(dtype).tiny)
    e = np.floor(np.log2(np.maximum(np.abs(exact), tiny)))
    return np.abs(got.astype(np.float64) - exact) / 2.0 ** (e - MANTISSA[np.dtype(dtype).name])


def error_of(results, inputs, dtype):
    """(max ulps from the exact sum rounded once, max |error| / (u * sum |x|)) of results."""
    exact = inputs.astype(np.float64).sum(0)
    once = exact.astype(np.float32).astype(dtype)  # the sum rounded (nearly) once
    bound = UNIT[np.dtype(dtype).name] * np.abs(inputs.astype(np.float64)).sum(0)
    err = np.abs(results.astype(np.float64) - exact)
    return (float(ulps(results, once.astype(np.float64), dtype).max()),
            float((err / np.maximum(bound, 1e-300)).max()))


def bits(x):
    return np.ascontiguousarray(x).view(np.uint16).tobytes()


def sixteen_body(n=4099):
    from minipar import comm
    from minipar.comm import ALGORITHMS, CommError, node

    world = comm.world()
    p, r = world.size, world.rank
    rng = np.random.default_rng(7 + r)
    failures, errors = [], {}
    one_node = node.span(world) == 1
    for dtype in (np.dtype(np.float16), np.dtype(BF16)):
        name = dtype.name
        x = (rng.standard_normal(n) * 4).astype(dtype)
        inputs = world.all_gather(x)  # every rank's vector, moved as 16-bit messages
        if bits(inputs[r]) != bits(x):
            failures.append(f"rank {r}: {name} all_gather changed the bits")
        for algo in ALGORITHMS["all_reduce"]:
            if algo == "mpi" or (algo in ("shm", "hierarchical") and not one_node):
                continue
            y = world.all_reduce(x, algorithm=algo)
            if y.dtype != dtype:
                failures.append(f"rank {r}: {name} {algo} returned {y.dtype}")
                continue
            if len(set(world.all_gather_object(bits(y)))) != 1:
                failures.append(f"rank {r}: {name} {algo}: ranks hold different bits")
            # every path of every algorithm rounds at most p - 1 partial sums: the error is
            # at most gamma(p - 1) sum |x_i| (docs/comm.md), in units of u sum |x_i| here
            most_ulps, rel = error_of(y, inputs, dtype)
            errors[f"{name} {algo}"] = most_ulps
            if rel > gamma(max(p - 1, 1), name) + p * 2.0 ** -16:
                failures.append(f"rank {r}: {name} {algo}: error {rel:.2f} u sum|x| exceeds "
                                f"{p - 1}")
        # one rounding: every vector reaches the rank that adds it exact, and it adds them in
        # float32 in rank order: the float32 sum rounded once, bit for bit
        once = inputs.astype(np.float32).cumsum(0)[-1].astype(dtype)
        # the server and each shm rank add in rank order too
        for algo in ("parallel", "parameter_server") + (("shm",) if one_node else ()):
            if bits(world.all_reduce(x, algorithm=algo)) != bits(once):
                failures.append(f"rank {r}: {name} {algo} is not the float32 sum rounded once")
        chunk = world.reduce_scatter(x, algorithm="pairwise")
        bounds = [j * (n // p) + min(j, n % p) for j in range(p + 1)]
        if bits(chunk) != bits(once[bounds[r]:bounds[r + 1]]):
            failures.append(f"rank {r}: {name} pairwise reduce_scatter is not rounded once")
        if p == 3:  # docs/comm.md's case: 1 + 2^-8 is a tie, rounded to 1 on its way round
            one = np.array([(1.0, 2.0 ** -8, 2.0 ** -8)[r]], dtype)
            ring, once = (float(world.all_reduce(one, algorithm=a)[0]) for a in ("ring",
                                                                                 "parallel"))
            want = 1.0 if name == "bfloat16" else 1.0 + 2.0 ** -7  # float16 holds 1 + 2^-8
            if (ring, once) != (want, 1.0 + 2.0 ** -7):
                failures.append(f"rank {r}: {name} ring {ring}, parallel {once} of 1, 2^-8, 2^-8")
        # a running 16-bit sum in rank order (the sequential chain) rounds after every add:
        # the same bits as adding in 16 bits, since a float32 add of two is correctly rounded
        naive = inputs[0].copy()
        for v in inputs[1:]:
            naive = naive + v
        if bits(world.all_reduce(x, algorithm="sequential")) != bits(naive):
            failures.append(f"rank {r}: {name} sequential differs from a 16-bit running sum")
        errors[f"{name} naive"] = error_of(naive, inputs, dtype)[0]
        root = world.reduce(x, root=p - 1)  # the binomial tree: each subtree's sum rounds once
        if r == p - 1 and error_of(root, inputs, dtype)[1] > gamma(max(p - 1, 1), name):
            failures.append(f"rank {r}: {name} reduce exceeds the bound")
        # half the bytes of the float32 all-reduce, by the counters
        world.counters.reset()
        world.all_reduce(x, algorithm="ring")
        half = world.counters.snapshot()
        world.counters.reset()
        world.all_reduce(x.astype(np.float32), algorithm="ring")
        full = world.counters.snapshot()
        if p > 1 and (2 * half["bytes_sent"] != full["bytes_sent"]
                      or 2 * half["bytes_received"] != full["bytes_received"]):
            failures.append(f"rank {r}: {name} ring sent {half['bytes_sent']} bytes, float32 "
                            f"{full['bytes_sent']}")
        # non-reducing calls move the raw bits, MPI's own ones too
        special = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-40, 3.0], np.float32).astype(dtype)
        for algo in ("binomial", "scatter_allgather", "mpi"):
            got = world.broadcast(special if r == 0 else np.zeros_like(special), algorithm=algo)
            if bits(got) != bits(special):
                failures.append(f"rank {r}: {name} broadcast {algo} changed the bits")
        for algo in ("ring", "recursive_doubling", "mpi"):
            got = world.all_gather(x, algorithm=algo)
            if bits(got) != bits(inputs):
                failures.append(f"rank {r}: {name} all_gather {algo} changed the bits")
        out = np.empty_like(special)
        world.sendrecv(special, (r + 1) % p, out, (r - 1) % p)
        if bits(out) != bits(special):
            failures.append(f"rank {r}: {name} sendrecv changed the bits")
        got = world.irecv(np.empty_like(special), (r - 1) % p)
        world.isend(special, (r + 1) % p).wait()
        if bits(got.wait()) != bits(special):
            failures.append(f"rank {r}: {name} isend/irecv changed the bits")
        rows = np.stack([special] * p)
        for algo in ("pairwise", "mpi"):
            if bits(world.all_to_all(rows, algorithm=algo)) != bits(rows):
                failures.append(f"rank {r}: {name} all_to_all {algo} changed the bits")
        for algo in ("linear", "mpi"):
            stack = world.gather(x, root=0, algorithm=algo)
            if r == 0 and bits(stack) != bits(inputs):
                failures.append(f"rank {r}: {name} gather {algo} changed the bits")
            if bits(world.scatter(inputs, root=0, algorithm=algo)) != bits(inputs[r]):
                failures.append(f"rank {r}: {name} scatter {algo} changed the bits")
        for algo in ("ring", "recursive_halving"):
            chunk = world.reduce_scatter(x, algorithm=algo)
            part = slice(bounds[r], bounds[r + 1])
            if error_of(chunk, inputs[:, part], dtype)[1] > gamma(max(p - 1, 1), name):
                failures.append(f"rank {r}: {name} reduce_scatter {algo} exceeds the bound")
        mean = world.iall_reduce(x, op="avg", algorithm="ring").wait()
        if bits(mean) != bits(world.all_reduce(x, op="avg", algorithm="ring")):
            failures.append(f"rank {r}: {name} iall_reduce differs from all_reduce")
        # MPI's own reduction: bfloat16 refused on every rank; float16 is MPI's (MPIX_C_FLOAT16)
        calls = {"all_reduce": lambda: world.all_reduce(x, algorithm="mpi"),
                 "reduce": lambda: world.reduce(x, algorithm="mpi"),
                 "reduce_scatter": lambda: world.reduce_scatter(x, algorithm="mpi"),
                 "iall_reduce": lambda: world.iall_reduce(x, algorithm="mpi").wait()}
        for what, call in calls.items():
            try:
                got = call()
            except CommError as error:
                if name == "float16" or "bfloat16" not in str(error):
                    failures.append(f"rank {r}: {name} {what} mpi raised {error}")
                continue
            if name == "bfloat16" and p > 1:
                failures.append(f"rank {r}: bfloat16 {what} mpi was not refused")
            elif what == "all_reduce" and error_of(got, inputs, dtype)[1] > gamma(p, name):
                failures.append(f"rank {r}: float16 mpi all_reduce is off")
    return failures, errors


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_16bit_collectives_round_within_the_bound_and_halve_the_bytes(nprocs):
    results = run_on_ranks(sixteen_body, nprocs, timeout=300)
    failures = sum((f for f, _ in results), [])
    assert not failures, "\n".join(failures)


def test_ulps_counts_units_in_the_last_place():
    one = np.array([1.0])
    assert ulps(np.array([1.0 + 2 ** -7], BF16), one, BF16)[0] == 1
    assert ulps(np.array([1.0 + 2 ** -10], np.float16), one, np.float16)[0] == 1


def test_a_16bit_reduction_adds_in_float32_and_rounds_once():
    from minipar.comm.buffers import Accumulator, reducer

    # 1 + 2^-8 + 2^-8 in bfloat16: each 16-bit add rounds the tie 1 + 2^-8 back to 1 (even),
    # while a float32 accumulator keeps both halves and rounds 1 + 2^-7 exactly once
    parts = [np.array([v], BF16) for v in (1.0, 2.0 ** -8, 2.0 ** -8)]
    out = np.empty(1, BF16)
    reduce = reducer("sum", out)
    reduce(parts[0], parts[1], out=out)
    reduce(out, parts[2], out=out)
    assert float(out[0]) == 1.0
    total = Accumulator("sum", out)
    for part in parts:
        total.add(part)
    assert float(total.done()[0]) == 1.0 + 2.0 ** -7
    # out may be the second operand (shm's rank 1 reduces into its own slot)
    for dtype in (np.float32, BF16):
        a, b = np.array([1.0, 2.0], dtype), np.array([3.0, 4.0], dtype)
        total = Accumulator("sum", b)
        total.add(a)
        total.add(b)
        assert total.done().tolist() == [4.0, 6.0]
    # other dtypes reduce in place, in the same order as before
    f32 = np.zeros(2, np.float32)
    total = Accumulator("max", f32)
    total.add(np.array([1.0, -3.0], np.float32))
    total.add(np.array([0.5, 2.0], np.float32))
    assert total.done() is f32 and f32.tolist() == [1.0, 2.0]
