"""Which part of a serial weight a rank keeps, and the whole array back from the parts.

Initialisation is Megatron's CPU path: every rank draws the full serial weight from the same seed
and keeps its slice. A parallel layer therefore equals its serial twin (``nn.Linear``,
``nn.MLP``, ...) built with the same seed. ``shard`` does the slicing and ``unshard`` undoes it.
A module's ``tp_split`` names which of its parameters are split and how, as
{attribute: (axis, stride)}; parameters it does not name are replicated. ``split_specs`` collects
them over a module tree.

    shard(full, axis, rank, size)       rank's 1/size of ``full`` along ``axis``
    shard(full, 0, rank, size, 3)       a fused QKV weight: rank's piece of q, of k and of v
    unshard(parts, axis)                (size, *local shape) stacked over ranks -> full
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
