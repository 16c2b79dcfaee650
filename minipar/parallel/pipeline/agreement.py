"""What the ranks of a pipeline must agree on, checked before anything runs, and the batch checks
of a step.

Before the first step (``agreed_bounds``, called by ``Pipeline``): one ``same_everywhere`` of
this rank's schedule (name, p, m, v, flags and a fingerprint of every rank's action list), stage
bounds and layers (class, parameter shapes and dtypes). Ranks given different schedules would
post sends and receives that never match; ranks cutting the model differently would send
activations the next stage cannot take. Either is the same ValueError on every rank, naming the
first difference, instead of a hang.

During a step the checks are local (``split_batch``, ``check_targets``): the rank that holds the
bad batch raises, and its peers, blocked on the message it will never send, are ended with it
(the job-abort of minipar.comm, or minipar.testing's).
"""
import hashlib

from minipar import backend
from minipar.comm.agreement import same_everywhere

from .partition import balanced_split


def describe_schedule(schedule):
    """What the ranks must share: the schedule's shape and a fingerprint of its actions."""
    actions = hashlib.sha256(repr(schedule.actions).encode()).hexdigest()[:12]
    return {"name": schedule.name, "p": schedule.ranks, "m": schedule.microbatches,
            "v": schedule.chunks, "split_backward": schedule.split_backward,
            "remat": schedule.remat, "asynchronous": schedule.asynchronous, "actions": actions}


def describe_layer(layer):
    params = " ".join(f"{name} {tuple(p.shape)} {p.dtype}" for name, p in layer.named_parameters())
    return f"{type(layer).__name__}({params})"


def agreed_bounds(comm, schedule, layers, bounds=None):
    """The stage bounds (default: equal layer counts), after checking that every rank of ``comm``
    has the same schedule, bounds and layers; otherwise every rank raises the same ValueError.
    A bounds error (too few layers) is raised after the exchange, so on every rank alike."""
    failed = None
    try:
        bounds = [tuple(b) for b in bounds or balanced_split([1] * len(layers), schedule.n_stages)]
    except ValueError as error:
        failed, bounds = error, f"none ({error})"
    mine = (describe_schedule(schedule), bounds, [describe_layer(layer) for layer in layers])
    same_everywhere(comm, "the pipeline's ranks disagree before the first step", mine,
                    _difference, error=ValueError)
    if failed:
        raise failed
    return bounds


def _difference(everyone):
    """How the first rank whose (schedule, bounds, layers) differ from rank 0's differs."""
    r = next(r for r, theirs in enumerate(everyone) if repr(theirs) != repr(everyone[0]))
    return f"{_first_difference(everyone[0], everyone[r], r)}; build the same schedule and " \
           f"model on every rank"


def _first_difference(first, other, r):
    (sched0, bounds0, layers0), (sched, bounds, layers) = first, other
    if sched0 != sched:
        def show(d):
            return (f"{d['name']!r} (p={d['p']}, m={d['m']}, v={d['v']}, actions {d['actions']}"
                    + "".join(f", {k}" for k in ("split_backward", "remat", "asynchronous")
                              if d[k]) + ")")
        return f"rank 0 has the schedule {show(sched0)}, rank {r} has {show(sched)}"
    if len(layers0) != len(layers):
        return f"rank 0's model has {len(layers0)} layers, rank {r}'s has {len(layers)}"
    if repr(bounds0) != repr(bounds):  # as same_everywhere compares: (0, 2) is not (np.int64(0), 2)
        return f"stage bounds: rank 0 cuts the layers into {bounds0}, rank {r} into {bounds}"
    i = next(i for i, (a, b) in enumerate(zip(layers0, layers)) if a != b)
    return f"layer {i} is {layers0[i]} on rank 0 but {layers[i]} on rank {r}"


def split_batch(x, y, m, rank, first, last):
    """This rank's m micro-batches of inputs and targets (None where not given). ``first`` and
    ``last``: whether the rank holds stage 0 (it needs x) and the last stage (it needs y)."""
    if first and x is None:
        raise ValueError(f"rank {rank} holds the first stage: step() needs the inputs x here")
    if last and y is None:
        raise ValueError(f"rank {rank} holds the last stage: step() needs the targets y here")
    return _split(x, m, "inputs", rank), _split(y, m, "targets", rank)


def _split(batch, m, what, rank):
    """``m`` micro-batches along the first axis (sizes differ by at most one), or None."""
    if batch is None:
        return None
    if len(batch) < m:
        raise ValueError(f"rank {rank}: cannot cut a batch of {len(batch)} {what} into {m} "
                         f"micro-batches")
    return backend.get_array_module(batch).array_split(batch, m)


def check_targets(out, target, stage, mb, rank):
    """The last stage's output and its micro-batch of targets must hold as many samples (a loss
    that broadcasts would otherwise give a wrong number silently)."""
    if out.ndim and target.ndim and len(out) != len(target):
        raise ValueError(f"rank {rank}, stage {stage}, micro-batch {mb}: the output holds "
                         f"{len(out)} samples but the targets {len(target)}: the inputs x given "
                         f"to the first stage and the targets y given to the last must be "
                         f"batches of the same size")
