"""Which part of a serial weight a rank keeps, and the whole array back: the serial twin's slices.

Initialisation is Megatron's CPU path: every rank draws the full serial weight from the same seed
and keeps its slice, so a parallel layer or model equals its serial twin built with the same seed.
A module's ``tp_split`` names its split parameters as {attribute: (axis, stride)}; the others
are replicated.

    shard(full, axis, rank, size)       rank's 1/size of ``full`` along ``axis``
    shard(full, 0, rank, size, 3)       a fused QKV weight: rank's piece of q, of k and of v
    unshard(parts, axis)                (size, *local shape) stacked over ranks -> full
    copy_serial_slices(parallel, serial, group)    load a parallel model from its serial twin
    gather_to_serial(parallel, group)              the serial twin's arrays back (collective)
"""
from ... import backend


def divide(n, p, what):
    """n / p, or a ValueError that every rank raises alike (each checks the same numbers)."""
    if n % p:
        raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {p}: every "
                         f"rank must hold an equal share (choose tp among the divisors of {n})")
    return n // p


def shard(full, axis, rank, size, stride=1):
    """Rank's part of ``full`` along ``axis``. The axis is cut into ``stride`` blocks (q, k and v
    of a fused QKV weight) and each block into ``size`` pieces; the rank keeps its piece of each."""
    xp = backend.get_array_module(full)
    a = xp.moveaxis(full, axis, 0)
    n = divide(a.shape[0] // stride, size, "split dimension")
    part = a.reshape(stride, size, n, *a.shape[1:])[:, rank].reshape(stride * n, *a.shape[1:])
    return xp.ascontiguousarray(xp.moveaxis(part, 0, axis))


def unshard(parts, axis, stride=1):
    """The inverse of ``shard``: ``parts`` (size, *local shape) stacked over ranks -> full."""
    xp = backend.get_array_module(parts)
    a = xp.moveaxis(parts, axis + 1, 1)  # (size, local n, ...)
    size, n, rest = a.shape[0], a.shape[1] // stride, a.shape[2:]
    a = a.reshape(size, stride, n, *rest).swapaxes(0, 1).reshape(stride * size * n, *rest)
    return xp.moveaxis(a, 0, axis)


def split_specs(module):
    """{parameter name: (axis, stride)} for the split parameters of ``module``'s tree."""
    specs = {}
    for prefix, m in module.named_modules():
        for attr, spec in getattr(m, "tp_split", {}).items():
            if getattr(m, attr) is not None:
                specs[f"{prefix}.{attr}" if prefix else attr] = spec
    return specs


# ----------------------------------------------------------------------------------------------
# The serial twin: slices in, whole arrays out
# ----------------------------------------------------------------------------------------------

def local_slices(parallel, full_arrays, group, names=None):
    """{name: this rank's slice} of serial arrays (weights or gradients) for every parameter of
    ``parallel``; replicated parameters keep the whole array. ``names`` maps a parameter to its
    serial name where the two differ (an expert-parallel MoE renumbers its experts)."""
    names = names or {name: name for name, _ in parallel.named_parameters()}
    missing = [names[name] for name, _ in parallel.named_parameters()
               if names[name] not in full_arrays]
    if missing:
        raise KeyError(f"the serial module has no parameters {missing}: the two module trees "
                       f"must mirror each other")
    specs, out = split_specs(parallel), {}
    for name, _ in parallel.named_parameters():
        axis, stride = specs.get(name, (None, 1))
        full = full_arrays[names[name]]
        out[name] = full if axis is None else shard(full, axis, group.rank, group.size, stride)
    return out


def copy_serial_slices(parallel, serial, group, names=None):
    """Load each parameter of ``parallel`` with its slice of the same-named parameter of the
    mirrored ``serial`` module (a layer, a GPT, or a pipeline stage of one). The one path from a
    serial twin to its tensor-parallel model: the dense GPT, the MoE GPT and their stages."""
    full = {name: p.data for name, p in serial.named_parameters()}
    parts = local_slices(parallel, full, group, names)
    for name, p in parallel.named_parameters():
        p.data[...] = backend.get_array_module(p.data).asarray(parts[name], dtype=p.dtype)
    return parallel


def gather_to_serial(parallel, group, grads=False):
    """{name: full NumPy array} of every parameter (or gradient): the serial twin's values.
    Collective over ``group``: all-gathers the split ones."""
    specs, out = split_specs(parallel), {}
    for name, p in parallel.named_parameters():
        value = p.grad if grads else p.data
        if name in specs:
            parts = group.all_gather(backend.get_array_module(value).ascontiguousarray(value))
            value = unshard(parts, *specs[name])
        out[name] = backend.to_numpy(value)
    return out
