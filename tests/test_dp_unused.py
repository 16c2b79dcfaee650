"""DDP and the parameters a forward leaves out (2 ranks, float64).

With ``find_unused_parameters=True`` a model whose forward skips a layer trains exactly as the
serial model does (the skipped layer's gradient is zero, every bucket still launches), whatever
the bucket size and with or without overlap, and a rank that leaves out what another uses
contributes zero to its average; by default the same forward is an error naming the
skipped parameters; inside ``no_sync`` nothing is checked (nothing is communicated); a forward
that returns a tuple is walked from every Tensor in it.
"""
import pytest

from minipar.testing import run_on_ranks

TOL = 1e-12
STEPS, BATCH = 3, 8


def _model():
    import minipar
    from minipar import nn

    class Skip(nn.Module):
        """a -> relu -> b, with ``skipped`` (between them in parameter order) and ``aux`` left
        out; with ``two_outputs``, no ``skipped`` and ``aux`` gives a second output."""

        def __init__(self, two_outputs=False):
            super().__init__()
            self.a = nn.Linear(5, 8)
            if not two_outputs:
                self.skipped = nn.Linear(8, 8)
            self.b, self.aux, self.two_outputs = nn.Linear(8, 3), nn.Linear(8, 2), two_outputs

        def forward(self, x):
            h = self.a(x).relu()
            return (self.b(h), self.aux(h)) if self.two_outputs else self.b(h)

    minipar.manual_seed(0)
    return Skip().double(), Skip


def _maybe_skip(skip):
    """a, then b unless ``skip``: the same parameters, used or not."""
    import minipar
    from minipar import nn

    class MaybeSkip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) if skip else self.b(self.a(x))

    minipar.manual_seed(1)
    return MaybeSkip().double()


def _train(model, x, y, net=None):
    """STEPS steps of SGD with momentum; the parameters and last gradients (zeros for None)."""
    import numpy as np

    from minipar import optim, to_numpy

    net = net or model
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return ([p.numpy() for p in model.parameters()],
            [np.zeros(p.shape) if p.grad is None else to_numpy(p.grad) for p in model.parameters()])


def unused_body():
    import numpy as np

    from minipar import comm, to_numpy
    from minipar.parallel.data import DistributedDataParallel

    world = comm.world()
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((BATCH, 5)), rng.standard_normal((BATCH, 3))
    mine = slice(world.rank * BATCH // 2, (world.rank + 1) * BATCH // 2)
    serial = _train(_model()[0], x, y)
    worst = {}
    for name, options in {"one bucket each": {"bucket_cap_mb": 1e-5},
                          "one bucket": {"bucket_cap_mb": 25},
                          "no overlap": {"bucket_cap_mb": 1e-5, "overlap": False}}.items():
        model = _model()[0]
        net = DistributedDataParallel(model, world, find_unused_parameters=True, **options)
        got = _train(model, x[mine], y[mine], net)
        worst[name] = max(float(np.abs(a - b).max()) for a, b in zip(got[0] + got[1],
                                                                      serial[0] + serial[1]))
    out = {"worst": worst}
    model = _model()[0]
    net = DistributedDataParallel(model, world)
    try:
        net(x[mine])
        out["default"] = "no error"
    except ValueError as error:
        out["default"] = str(error)
    with net.no_sync():
        ((net(x[mine]) - y[mine]) ** 2).mean().backward()  # local: no check, no collective
    # rank 1 leaves out what rank 0 uses: its share of that gradient is zero
    local, model = _maybe_skip(world.rank == 1), _maybe_skip(world.rank == 1)
    net = DistributedDataParallel(model, world, find_unused_parameters=True, bucket_cap_mb=1e-5)
    ((local(x[mine]) - y[mine]) ** 2).mean().backward()
    ((net(x[mine]) - y[mine]) ** 2).mean().backward()
    shares = world.all_gather_object([np.zeros(p.shape) if p.grad is None else to_numpy(p.grad)
                                      for p in local.parameters()])
    out["one rank leaves out"] = max(float(np.abs(to_numpy(p.grad) - (s0 + s1) / 2).max())
                                     for p, s0, s1 in zip(model.parameters(), *shares))
    two = _model()[1](two_outputs=True).double()  # aux is reached through the tuple's second
    logits, aux = DistributedDataParallel(two, world)(x[mine])
    (logits.sum() + aux.sum()).backward()
    out["tuple"] = "ok"
    return out


@pytest.mark.mpi
def test_find_unused_parameters_equals_serial_and_default_names_them():
    for rank, out in enumerate(run_on_ranks(unused_body, 2, timeout=120)):
        for name, err in out["worst"].items():
            assert err < TOL, (rank, name, err)
        assert ("does not depend on 4 parameter(s) that require grad: 'skipped.weight', "
                "'skipped.bias', 'aux.weight', 'aux.bias'") in out["default"], out["default"]
        assert "find_unused_parameters=True" in out["default"]
        assert out["tuple"] == "ok"
        assert out["one rank leaves out"] < TOL, out["one rank leaves out"]
