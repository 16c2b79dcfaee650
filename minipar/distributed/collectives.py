"""torch.distributed's collectives, in place, over minipar's hand-coded algorithms.

    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)   # p.grad now holds the sum over ranks
    dist.broadcast(w, src=0)                        # w now holds rank 0's values

Each call takes a minipar ``Tensor`` (its ``.data`` is overwritten) or a NumPy/CuPy array
(overwritten), as torch overwrites its tensors; it returns None, or a work with ``wait()`` when
``async_op=True``. The communicator underneath moves arrays and returns new ones
(``minipar.comm``); this module is the in-place, torch-shaped layer over it. ``all_reduce``
runs the group's algorithm (process_group.py: an argument or ``MINIPAR_ALLREDUCE``). A call on a
group this rank is not a member of does nothing and returns None, as in torch.
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
    raise TypeError(f"{what} takes a minipar Tensor or a NumPy/CuPy array, "
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
    """torch's Work: ``wait()`` completes the call (True), ``is_completed()`` says if it has."""

    def __init__(self, wait=None):
        self._wait = wait

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


def _peer(group, rank, group_rank, what):
    if rank is None and group_rank is None:
        raise ValueError(f"{what}: name the peer rank (receiving from any source is not "
                         f"supported)")
    return _root(group, rank, group_rank, what)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Send the tensor to world rank ``dst`` (blocking)."""
    comm = _member(group)
    if comm is not None:
        comm.send(_Buffer(tensor, "send").array, _peer(group, dst, group_dst, "send"), tag)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Fill the tensor with what world rank ``src`` sends; returns ``src``."""
    comm = _member(group)
    if comm is None:
        return -1
    peer = _peer(group, src, group_src, "recv")
    buf = _Buffer(tensor, "recv")
    comm.recv(buf.array, peer, tag)
    buf.store()
    return resolve(group).ranks[peer]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Start sending; returns a Work (do not change the tensor before its wait())."""
    comm = _member(group)
    if comm is None:
        return None
    request = comm.isend(_Buffer(tensor, "isend").array, _peer(group, dst, group_dst, "isend"),
                         tag)
    return Work(request.wait)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """Start receiving into the tensor; returns a Work whose wait() fills it."""
    comm = _member(group)
    if comm is None:
        return None
    buf = _Buffer(tensor, "irecv")
    request = comm.irecv(buf.array, _peer(group, src, group_src, "irecv"), tag)
    return Work(lambda: (request.wait(), buf.store()))


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Wait until every rank of the group arrives."""
    comm = _member(group)
    if comm is None:
        return None
    comm.barrier()
    return _done(async_op)
