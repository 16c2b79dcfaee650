"""Wrappers check that ranks agree (issue 10, item 4): each mistake a clear error, the job ends.

One launch of 2 ranks runs every case whose check is global or whose input every rank shares:
each rank records the error it got and the seconds it took, and all ranks must report the same
text (no rank left waiting). Mistakes made on one rank only (a parameter unused there, a batch
that does not fit) raise on that rank, and the job ends: one launch each, timed whole.

    DDP / ZeRO / parameter server   a model built differently on one rank (extra or missing
                                    layer, other shape, dtype, order, requires_grad)
    DDP                             a parameter the forward leaves out, on every rank or one
    vocab_parallel_cross_entropy    targets -1, V, -100, with and without ignore_index: the
                                    serial loss's error (its value: test_tensor_parallel.py)
    Pipeline, Trainer3D             another schedule, m, stage bounds, layer or layer count on one
                                    rank; a batch that does not cut into m micro-batches on one
                                    rank; targets of another size than the inputs
"""
import time

import pytest

from minipar.testing import run_on_ranks

BOUND = 10.0  # seconds a job may take to end: generous, the machine is shared


def _model(kind="base"):
    """A small float32 MLP, the same on every rank unless ``kind`` says how this rank's differs."""
    import minipar
    from minipar import nn

    minipar.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.Linear(4, 4)]
    if kind == "extra":
        layers.append(nn.Linear(4, 4))
    elif kind == "lacks":
        layers = layers[:1]
    elif kind == "shape":
        layers[1] = nn.Linear(4, 5)
    elif kind == "frozen":
        layers[1].bias.requires_grad = False
    elif kind in ("named", "order"):  # "order": the same parameters, declared the other way
        model = nn.Module()
        if kind == "named":
            model.first, model.second = layers
        else:
            model.second, model.first = layers[1], layers[0]
        return model
    model = nn.Sequential(*layers)
    return model.double() if kind == "dtype" else model


def _timed(fn):
    """(the error's type and text, or "no error", seconds)"""
    start = time.perf_counter()
    try:
        fn()
        said = "no error"
    except Exception as error:  # noqa: BLE001 (the case table says which type it expects)
        said = f"{type(error).__name__}: {error}"
    return said, time.perf_counter() - start


def agreement_body():
    import numpy as np

    from minipar import comm, functional, nn, optim
    from minipar.parallel.data import DistributedDataParallel, ParameterServer, ZeRO
    from minipar.parallel.groups import ParallelGroups
    from minipar.parallel.hybrid import Trainer3D
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline
    from minipar.parallel.tensor import vocab_parallel_cross_entropy

    world = comm.world()
    one = world.rank == 1

    def ddp(kind):
        return lambda: DistributedDataParallel(_model(kind if one else "base"), world)

    def unused_everywhere():
        DistributedDataParallel(_skip_model(), world)(np.ones((2, 3), "float32"))

    def pipe(schedule=("gpipe", 2, 4), width=4, n=6, bounds=None):
        def make():
            layers = [nn.Linear(3, 4)] + [nn.Linear(4, 4) for _ in range(n - 2)]
            Pipeline(nn.Sequential(*layers, nn.Linear(4, width)), build(*schedule), world,
                     lambda out, t: ((out - t) ** 2).mean(), bounds=bounds)
        return make

    grid = ParallelGroups(world, tp=1, pp=2)  # collective: built once, outside the cases

    def trainer(schedule="gpipe", n_layer=2):
        return lambda: Trainer3D(nn.GPTConfig(vocab_size=16, block_size=4, n_layer=n_layer,
                                              n_head=2, n_embd=8), grid, schedule=schedule,
                                 microbatches=2)

    V = 8  # the vocabulary: 4 logits per rank
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V))
    mine = logits[:, world.rank * 4:(world.rank + 1) * 4]

    def both(targets, **kw):
        """The serial loss's error and the vocab-parallel one's, in one string each."""
        serial, _ = _timed(lambda: functional.cross_entropy(logits, np.array(targets), **kw))
        return serial, lambda: vocab_parallel_cross_entropy(mine, np.array(targets), world, **kw)

    cases = {
        "ddp extra layer": ddp("extra"),
        "ddp missing layer": ddp("lacks"),
        "ddp other shape": ddp("shape"),
        "ddp other dtype": ddp("dtype"),
        "ddp requires_grad": ddp("frozen"),
        "ddp other order": lambda: DistributedDataParallel(_model("order" if one else "named"),
                                                           world),
        "zero extra layer": lambda: ZeRO(_model("extra" if one else "base"),
                                         lambda ps: optim.Adam(ps), world),
        "ps extra layer": lambda: ParameterServer(_model("extra" if one else "base"),
                                                  lambda ps: optim.SGD(ps, lr=0.1), world),
        "ddp unused on every rank": unused_everywhere,
        "pipeline schedule": pipe(("1f1b", 2, 4) if one else ("gpipe", 2, 4)),
        "pipeline m": pipe(("gpipe", 2, 2) if one else ("gpipe", 2, 4)),
        "pipeline bounds": pipe(bounds=[(0, 2), (2, 6)] if one else [(0, 3), (3, 6)]),
        "pipeline layer": pipe(width=5 if one else 4),
        "pipeline layer count": pipe(n=7 if one else 6),
        "3d schedule": trainer(schedule="1f1b" if one else "gpipe"),
        "3d layers": trainer(n_layer=3 if one else 2),
    }
    serial_said = {}
    for name, targets, kw in [("targets -1", [0, -1, 2], {}), ("targets V", [0, V, 2], {}),
                              ("targets -100, ignore_index=-1", [0, -100, 2],
                               {"ignore_index": -1})]:
        serial_said[name], cases[name] = both(targets, **kw)
    seen = {}
    for name, fn in cases.items():
        seen[name] = _timed(fn)
    world.barrier()  # nobody is left inside a collective
    return {"seen": seen, "serial": serial_said}


def _skip_model():
    """A model whose forward leaves its second layer out."""
    import minipar
    from minipar import nn

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.skipped = nn.Linear(3, 4), nn.Linear(3, 4)

        def forward(self, x):
            return self.used(x)

    minipar.manual_seed(0)
    return Skip()


@pytest.mark.mpi
@pytest.mark.fault
def test_ranks_that_disagree_get_the_same_clear_error():
    start = time.perf_counter()
    per_rank = run_on_ranks(agreement_body, 2, timeout=60)
    wall = time.perf_counter() - start
    expected = {
        "ddp extra layer": "rank 1 has an extra parameter '2.weight' (4, 4) float32 that rank 0 "
                           "lacks",
        "ddp missing layer": "rank 1 lacks the parameter '1.weight' (4, 4) float32 that rank 0 has",
        "ddp other shape": "parameter '1.weight' is (4, 4) float32 on rank 0 but (5, 4) float32 "
                           "on rank 1",
        "ddp other dtype": "parameter '0.weight' is (4, 3) float32 on rank 0 but (4, 3) float64 "
                           "on rank 1",
        "ddp requires_grad": "parameter '1.bias' has requires_grad=True on rank 0 but "
                             "requires_grad=False on rank 1",
        "ddp other order": "they come in a different order: at position 0 rank 0 has parameter "
                           "'first.weight' (4, 3) float32, rank 1 has parameter 'second.weight' "
                           "(4, 4) float32",
        "zero extra layer": "rank 1 has an extra parameter '2.weight'",
        "ps extra layer": "rank 1 has an extra parameter '2.weight'",
        "ddp unused on every rank": "does not depend on 2 parameter(s) that require grad: "
                                    "'skipped.weight', 'skipped.bias'",
        "pipeline schedule": "rank 0 has the schedule 'gpipe' (p=2, m=4, v=1",
        "pipeline m": "(p=2, m=2, v=1",
        "pipeline bounds": "stage bounds: rank 0 cuts the layers into [(0, 3), (3, 6)], rank 1 "
                           "into [(0, 2), (2, 6)]",
        "pipeline layer": "layer 5 is Linear(weight (4, 4) float32 bias (4,) float32) on rank 0 "
                          "but Linear(weight (5, 4) float32 bias (5,) float32) on rank 1",
        "pipeline layer count": "rank 0's model has 6 layers, rank 1's has 7",
        "3d schedule": "rank 0 has the schedule 'gpipe' (p=2, m=2, v=1",
        "3d layers": "rank 0's model has 5 layers, rank 1's has 6",
    }
    def texts(rank):  # a local check names its rank; all else must be the same text
        return {k: v[0].replace(f"rank {rank}: ", "") for k, v in per_rank[rank]["seen"].items()}

    for rank, got in enumerate(per_rank):
        seen = got["seen"]
        assert texts(rank) == texts(0), f"rank {rank} saw other errors"
        for case, words in expected.items():
            assert words in seen[case][0], f"rank {rank}, {case}: {seen[case][0]}"
            assert seen[case][1] < BOUND, (case, seen[case][1])
        for case, serial in got["serial"].items():
            assert serial.startswith("IndexError: cross_entropy: target values must lie in"), serial
            assert seen[case][0] == serial.replace("cross_entropy", "vocab_parallel_cross_entropy")
    for case in sorted(per_rank[0]["seen"]):
        print(f"{case}: {max(r['seen'][case][1] for r in per_rank):.3f} s")
    print(f"the launch: {wall:.2f} s")
    assert wall < 6 * BOUND


# --- a mistake on one rank only: that rank raises, the job ends -----------------------------------

def unused_on_one_rank_body():
    """Rank 1's forward leaves a layer out; rank 0 uses it and goes on into backward."""
    import numpy as np

    from minipar import comm, nn, optim
    from minipar.parallel.data import DistributedDataParallel

    world = comm.world()

    class MaybeSkip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            return h if world.rank == 1 else self.b(h)

    model = DistributedDataParallel(MaybeSkip(), world, bucket_cap_mb=1e-5)
    opt = optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(np.ones((2, 3), "float32")).sum().backward()
        opt.step()


def pipeline_batch_body(x_size, y_size, m):
    """A 2-rank GPipe step where rank 0 holds ``x_size`` inputs and rank 1 ``y_size`` targets."""
    import numpy as np

    import minipar
    from minipar import comm, nn
    from minipar.parallel.pipeline import build
    from minipar.parallel.pipeline.runtime import Pipeline

    world = comm.world()
    minipar.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    pipe = Pipeline(model, build("gpipe", 2, m), world, lambda out, t: ((out - t) ** 2).mean())
    x = np.ones((x_size, 3)) if world.rank == 0 else None
    y = np.ones((y_size, 2)) if world.rank == 1 else None
    for _ in range(2):
        pipe.step(x, y)


ONE_RANK = {
    "ddp unused on one rank": (unused_on_one_rank_body, (), [
        "rank 1: DistributedDataParallel: the forward's output does not depend on 2 "
        "parameter(s) that require grad: 'b.weight', 'b.bias'", "find_unused_parameters=True"]),
    "pipeline batch not cut into m on one rank": (pipeline_batch_body, (3, 8, 4), [
        "rank 0: cannot cut a batch of 3 inputs into 4 micro-batches"]),
    "pipeline targets of another size": (pipeline_batch_body, (8, 6, 2), [
        "rank 1, stage 1, micro-batch 0: the output holds 4 samples but the targets 3"]),
}


@pytest.mark.mpi
@pytest.mark.fault
@pytest.mark.parametrize("case", list(ONE_RANK))
def test_a_mistake_on_one_rank_ends_the_job_with_its_message(case):
    body, args, words = ONE_RANK[case]
    start = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        run_on_ranks(body, 2, timeout=30, args=args)
    seconds = time.perf_counter() - start
    print(f"{case}: the job ended in {seconds:.2f} s")
    for text in words:
        assert text in str(failed.value), str(failed.value)
    assert "timed out" not in str(failed.value)
    assert seconds < BOUND
