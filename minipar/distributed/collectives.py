"""torch.distributed's collectives, in place, over minipar's hand-coded algorithms.

    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)   # p.grad now holds the sum over ranks
    dist.broadcast(w, src=0)                        # w now holds rank 0's values

Each call takes a minipar ``Tensor`` (its ``.data`` is overwritten), a NumPy/CuPy array or a torch
CPU tensor (overwritten), as torch overwrites its tensors; it returns None, or a work with
``wait()`` when ``async_op=True``. The communicator underneath moves arrays and returns new ones
(``minipar.comm``); this module is the in-place, torch-shaped layer over it (point-to-point:
p2p.py). ``all_reduce`` runs the group's algorithm (process_group.py: an argument or
``MINIPAR_ALLREDUCE``). A call on a group this rank is not a member of does nothing and returns
None, as in torch.
"""
from .. import backend
from ..autograd import Tensor
from .process_group import ReduceOp, op_name, resolve


def _data(tensor, what):
    """The array a call works on: the tensor's data or the array itself."""
    if isinstance(tensor, Tensor):
        return tensor.data
    if hasattr(tensor, "__array_interface__") or backend.is_gpu_array(tensor):
        return tensor
    # a torch CPU tensor or Parameter (a torch program with only `import torch.distributed`
    # changed): its .numpy() shares the tensor's memory, so writing into it fills it in place
    if type(tensor).__module__.split(".")[0] == "torch" and hasattr(tensor, "device"):
        if tensor.device.type != "cpu":
            raise TypeError(f"{what} takes torch tensors on the CPU, got one on {tensor.device}")
        return tensor.detach().numpy()
    raise TypeError(f"{what} takes a minipar Tensor, a NumPy/CuPy array or a torch CPU tensor, "
                    f"got {type(tensor).__name__}")


class _Buffer:
    """A contiguous array to hand the communicator, and the write-back into the caller's
    array when that one is a strided view (the communicator needs contiguous buffers)."""

    def __init__(self, tensor, what):
        self.target = _data(tensor, what)
        self.array = (self.target if self.target.flags.c_contiguous
                      else backend.get_array_module(self.target).ascontiguousarray(self.target))

    def store(self, values=None):
        if values is not None and values is not self.array:
            if not backend.is_gpu_array(self.array):  # a host buffer takes device values by copy
                values = backend.to_numpy(values)
            self.array[...] = values.reshape(self.array.shape)
        if self.array is not self.target:
            self.target[...] = self.array


class Work:
    """torch's Work: ``wait()`` completes the call (True), ``is_completed()`` says if it has;
    a receive's ``_source_rank()`` is its sender's world rank, as torch's."""

    def __init__(self, wait=None, source=-1):
        self._wait, self.source = wait, source

    def _source_rank(self):
        self.wait()
        return self.source

    def is_completed(self):
        return self._wait is None

    def wait(self, timeout=None):
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()
        return True


def _done(async_op):
    """A blocking call's return: None, or an already completed Work when async_op asks one."""
    return Work() if async_op else None


def _member(group):
    """The group's communicator on a member, None elsewhere."""
    return resolve(group).comm


def _root(group, rank, group_rank, what):
    """The group rank of a world rank ``rank`` (torch's src/dst), or ``group_rank`` itself."""
    pg = resolve(group)
    if (rank is None) == (group_rank is None):
        raise ValueError(f"{what}: pass exactly one of the world rank or the group rank")
    if group_rank is not None:
        return int(group_rank)
    if rank not in pg.ranks:
        raise ValueError(f"{what}: rank {rank} is not in the group {pg.ranks}")
    return pg.ranks.index(rank)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Every rank's tensor becomes op(tensor_0, ..., tensor_{p-1}) (op: ReduceOp, default SUM).

    ``async_op=True`` starts it and returns a Work (``comm.iall_reduce``): wait() before reading."""
    comm = _member(group)
    if comm is None:
        return None
    buf, name = _Buffer(tensor, "all_reduce"), op_name(op)
    algorithm = resolve(group).algorithm
    if async_op:
        work = comm.iall_reduce(buf.array, op=name, algorithm=algorithm, out=buf.array)
        return Work(lambda: (work.wait(), buf.store()))
    comm.all_reduce(buf.array, op=name, algorithm=algorithm, out=buf.array)
    buf.store()
    return None


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Every rank's tensor becomes the tensor of world rank ``src``."""
    comm = _member(group)
    if comm is None:
        return None
    root = _root(group, src, group_src, "broadcast")
    buf = _Buffer(tensor, "broadcast")
    comm.broadcast(buf.array, root=root, out=buf.array)
    buf.store()
    return _done(async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """The tensor of world rank ``dst`` becomes op over the ranks; the others keep theirs."""
    comm = _member(group)
    if comm is None:
        return None
    root = _root(group, dst, group_dst, "reduce")
    buf = _Buffer(tensor, "reduce")
    out = buf.array if comm.rank == root else None
    if comm.reduce(buf.array, root=root, op=op_name(op), out=out) is not None:
        buf.store()
    return _done(async_op)


def _one_per_rank(comm, tensors, what):
    if len(tensors) != comm.size:
        raise ValueError(f"{what} has {len(tensors)} entries for a group of {comm.size} ranks")


def _rooted(comm, group, rank, group_rank, what, listed=None):
    """The group rank of the call's root (world rank 0 when neither is given, as in torch); the
    root's list ``what`` (``"gather: gather_list"``) must hold one entry per rank."""
    call = what.split(":")[0]
    root = _root(group, 0 if rank is None and group_rank is None else rank, group_rank, call)
    if comm.rank == root and what != call:
        if listed is None:
            raise ValueError(f"{what}: the root rank passes it")
        _one_per_rank(comm, listed, what)
    return root


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[i] becomes rank i's tensor, on every rank."""
    comm = _member(group)
    if comm is None:
        return None
    _one_per_rank(comm, tensor_list, "all_gather: tensor_list")
    stacked = comm.all_gather(_Buffer(tensor, "all_gather").array)
    for out, values in zip(tensor_list, stacked):
        _Buffer(out, "all_gather").store(values)
    return _done(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output_tensor (p * n elements, e.g. shape (p*k, ...) or (p, k, ...)) becomes the ranks'
    input tensors concatenated in rank order."""
    comm = _member(group)
    if comm is None:
        return None
    out = _Buffer(output_tensor, "all_gather_into_tensor")
    out.store(comm.all_gather(_Buffer(input_tensor, "all_gather_into_tensor").array))
    return _done(async_op)


def _reduce_scatter(comm, out, flat, op):
    if flat.size != out.array.size * comm.size:
        raise ValueError(f"reduce_scatter: the input holds {flat.size} elements, not "
                         f"{comm.size} x the output's {out.array.size}")
    out.store(comm.reduce_scatter(flat, op=op_name(op)))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """output becomes op over the ranks of their input_list[rank] (every entry output's shape)."""
    comm = _member(group)
    if comm is None:
        return None
    _one_per_rank(comm, input_list, "reduce_scatter: input_list")
    out = _Buffer(output, "reduce_scatter")
    parts = [_data(t, "reduce_scatter").reshape(-1) for t in input_list]
    xp = backend.get_array_module(*parts)  # the inputs' device (store() copies to out's)
    _reduce_scatter(comm, out, xp.concatenate(parts), op)
    return _done(async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """output (n elements) becomes op over the ranks of chunk ``rank`` of input (p * n)."""
    comm = _member(group)
    if comm is None:
        return None
    out = _Buffer(output, "reduce_scatter_tensor")
    _reduce_scatter(comm, out, _Buffer(input, "reduce_scatter_tensor").array.reshape(-1), op)
    return _done(async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """On world rank ``dst``, gather_list[i] becomes rank i's tensor (the others pass None)."""
    comm = _member(group)
    if comm is None:
        return None
    root = _rooted(comm, group, dst, group_dst, "gather: gather_list", gather_list)
    stacked = comm.gather(_Buffer(tensor, "gather").array, root=root)
    if stacked is not None:
        for out, values in zip(gather_list, stacked):
            _Buffer(out, "gather").store(values)
    return _done(async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """tensor becomes scatter_list[rank] of world rank ``src`` (the others pass None)."""
    comm = _member(group)
    if comm is None:
        return None
    root = _rooted(comm, group, src, group_src, "scatter: scatter_list", scatter_list)
    out = _Buffer(tensor, "scatter")
    stacked = None
    if comm.rank == root:
        parts = [_data(t, "scatter") for t in scatter_list]
        stacked = backend.get_array_module(*parts).stack(parts)
    out.store(comm.scatter(stacked, root=root, out=out.array))
    return _done(async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """output_tensor_list[j] becomes rank j's input_tensor_list[rank] (sizes may differ)."""
    comm = _member(group)
    if comm is None:
        return None
    _one_per_rank(comm, input_tensor_list, "all_to_all: input_tensor_list")
    _one_per_rank(comm, output_tensor_list, "all_to_all: output_tensor_list")
    outs = [_Buffer(t, "all_to_all") for t in output_tensor_list]
    parts = [_data(t, "all_to_all").reshape(-1) for t in input_tensor_list]
    xp = backend.get_array_module(*parts)
    got = comm.all_to_all_v(xp.concatenate(parts), [p.size for p in parts],
                            [o.array.size for o in outs])
    _split_into(outs, got)
    return _done(async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """Rows of input by destination (``input_split_sizes``, default equal), output's rows by
    source (``output_split_sizes``): rank j's block for this rank lands at block j."""
    comm = _member(group)
    if comm is None:
        return None
    out, x = _Buffer(output, "all_to_all_single"), _data(input, "all_to_all_single")
    send = _split_sizes(input_split_sizes, len(x), comm.size, "input")
    recv = _split_sizes(output_split_sizes, len(out.array), comm.size, "output")
    out.store(comm.all_to_all_v(x, send, recv))
    return _done(async_op)


def _split_sizes(sizes, rows, p, what):
    """torch's split sizes: given, or ``rows`` cut in p equal blocks."""
    if sizes is not None:
        return [int(n) for n in sizes]
    if rows % p:
        raise ValueError(f"all_to_all_single: the {what} has {rows} rows, not a multiple of the "
                         f"group's {p} ranks (pass {what}_split_sizes)")
    return [rows // p] * p


def _split_into(outs, flat):
    start = 0
    for out in outs:
        out.store(flat[start:start + out.array.size])
        start += out.array.size


def all_gather_object(object_list, obj, group=None):
    """object_list[i] becomes rank i's ``obj`` (any picklable object), on every rank."""
    comm = _member(group)
    if comm is not None:
        _one_per_rank(comm, object_list, "all_gather_object: object_list")
        object_list[:] = comm.all_gather_object(obj)


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    """Every rank's object_list becomes world rank ``src``'s (same length on every rank)."""
    comm = _member(group)
    if comm is not None:
        root = _rooted(comm, group, src, group_src, "broadcast_object_list")
        object_list[:] = comm.broadcast_object(list(object_list), root=root)


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    """On world rank ``dst``, object_gather_list[i] becomes rank i's ``obj``."""
    comm = _member(group)
    if comm is None:
        return
    root = _rooted(comm, group, dst, group_dst, "gather_object: object_gather_list",
                   object_gather_list)
    got = comm.gather_object(obj, root=root)
    if comm.rank == root:
        object_gather_list[:] = got


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                        group=None, group_src=None):
    """scatter_object_output_list[0] becomes world rank ``src``'s input list's entry [rank]."""
    comm = _member(group)
    if comm is None:
        return
    root = _rooted(comm, group, src, group_src,
                   "scatter_object_list: scatter_object_input_list", scatter_object_input_list)
    if not scatter_object_output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list needs one entry")
    # the whole list travels (the communicator has no object scatter; objects here are small)
    objects = comm.broadcast_object(scatter_object_input_list if comm.rank == root else None,
                                    root=root)
    scatter_object_output_list[0] = objects[comm.rank]


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Wait until every rank of the group arrives."""
    comm = _member(group)
    if comm is None:
        return None
    comm.barrier()
    return _done(async_op)
