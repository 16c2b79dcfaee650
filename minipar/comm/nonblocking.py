"""Non-blocking collectives: start one, compute, wait (how gradient buckets overlap backward,
and how fully sharded data parallelism gathers the next layer while this one computes).

    work = comm.iall_reduce(bucket, out=bucket)     # returns at once
    ...                                              # backward goes on
    work.wait()                                      # the bucket now holds the sum

    work = iall_gather(comm, shard, out=full)       # the same for all_gather and reduce_scatter

``algorithm="mpi"`` is MPI_Iallreduce; a hand-coded algorithm runs on the communicator's
background thread (``AsyncWorker``), one collective at a time in the order they were started.
Every rank must start the same collectives in the same order. Why a thread: docs/comm.md.
"""
import queue
import threading

from mpi4py import MPI

from minipar import backend
from minipar.comm import watch
from minipar.comm.buffers import finish, refuse_float8, result_buffer
from minipar.comm.mpi import MPI_OP, agree_on_call, refuse_bfloat16
from minipar.comm.registry import pick
from minipar.comm.wire import inout_buffer, recv_buffer, send_buffer


class Work:
    """A running all-reduce: ``wait()`` returns its result (or raises its error)."""

    def __init__(self, wait_fn=None):
        self._wait_fn, self._done = wait_fn, threading.Event()
        self.result = self.error = None

    def is_completed(self):
        return self._done.is_set()

    def set(self, result=None, error=None):
        """Called by whoever ran the all-reduce: its result, or the error to raise in wait()."""
        self.result, self.error = result, error
        self._done.set()

    def wait(self):
        if self._wait_fn is not None:
            self.set(self._wait_fn())
            self._wait_fn = None
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


def current_gpu():
    """The calling thread's CuPy device (a ``cupy.cuda.Device``), or None on the CPU."""
    return backend.xp().cuda.Device() if backend.device() == "gpu" else None


class JobThread:
    """One background thread running ``fn(*args, **options)`` jobs in the order they were
    started, each on the GPU its caller was using; ``start`` returns a ``Work`` whose ``wait()``
    gives the job's return value (or raises its error). A daemon: a rank that failed must not
    wait at exit for a job blocked on a peer."""

    def __init__(self, name):
        self.jobs = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name=name).start()

    def start(self, fn, *args, **options):
        work = Work()
        self.jobs.put((work, current_gpu(), fn, args, options))
        return work

    def _loop(self):
        while True:
            work, gpu, fn, args, options = self.jobs.get()
            try:
                # CuPy's current device is per thread, and a new thread starts on GPU 0:
                # without this, every rank but those on GPU 0 would run the reduction's kernels
                # (and its copies) on the wrong GPU
                if gpu is not None:
                    gpu.use()
                work.set(fn(*args, **options))
            except BaseException as error:  # handed to the waiting caller
                work.set(error=error)


class AsyncWorker(JobThread):
    """The queued collectives of one communicator, in call order, on a duplicate of ``comm``
    that shares its counters (the bytes still count as this communicator's)."""

    def __init__(self, comm):
        self.comm = comm.dup(share_counters=True)
        super().__init__("minipar-iall_reduce")

    def start(self, collective, x, **options):
        """Queue ``comm.<collective>(x, **options)``; its ``Work`` returns the result."""
        return super().start(getattr(self.comm, collective), x, **options)


def worker(comm):
    """``comm``'s background thread, made on first use: iall_reduce, iall_gather and
    ireduce_scatter queue on the same one, so they run in call order."""
    if comm._worker is None:
        comm._worker = AsyncWorker(comm)
    return comm._worker


def iall_gather(comm, x, algorithm="ring", out=None):
    """Start ``comm.all_gather(x, algorithm, out)`` on the background thread; x must not change
    until ``wait()``, which returns the stack of shape (p, *x.shape)."""
    pick("all_gather", algorithm)
    return worker(comm).start("all_gather", x, algorithm=algorithm, out=out)


def ireduce_scatter(comm, x, op="sum", algorithm="ring", out=None):
    """Start ``comm.reduce_scatter(x, op, algorithm, out)`` on the background thread; ``wait()``
    returns this rank's chunk of the reduced vector."""
    pick("reduce_scatter", algorithm, op)
    return worker(comm).start("reduce_scatter", x, op=op, algorithm=algorithm, out=out)


def iall_reduce_mpi(comm, x, op="sum", out=None):
    """MPI_Iallreduce; the returned ``Work`` completes it (and divides for ``avg``)."""
    pick("all_reduce", "mpi", op)
    refuse_bfloat16("iall_reduce", x)
    refuse_float8("iall_reduce", x)
    # MPI_Iallreduce carries no message of ours: the ranks agree on dtype and count first, as
    # the blocking "mpi" collectives do, for a mismatch would give a silently wrong sum
    agree_on_call(comm, "all_reduce", op, x)
    result = result_buffer(x, out)
    aware, sent = comm.coll.is_cuda_aware(), None
    if result is x:
        send, (recv, done) = MPI.IN_PLACE, inout_buffer(result, aware)
    else:
        (send, sent), (recv, done) = send_buffer(x, aware), recv_buffer(result, aware, comm.rank)
    request = comm.mpi.Iallreduce(send, recv, MPI_OP[op])

    def complete():
        with watch.blocking("MPI iall_reduce", comm.world_ranks):  # a rank that never starts it
            request.Wait()
        for staged in filter(None, (done, sent)):
            staged()  # copy in, give the host buffers back
        return finish(result, op, comm.size)
    return Work(complete)
