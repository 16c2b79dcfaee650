"""How DDP averages a complete bucket, beside ddp.py's ``AllReduce`` (one blocking all-reduce
the moment the bucket is complete): ``Overlapped``, the all-reduce on the communicator's
background thread while backward computes the next layers (``overlap``); ``CommHook``,
``hook(state, bucket)`` instead of the all-reduce (``model.register_comm_hook``, torch's
interface; the hooks are in hooks/), and ``OverlappedCommHook``, the hooks on a thread of their
own. Each has ``AllReduce``'s two methods: ``launch(i)``, called once bucket i is complete, in
bucket order, and ``wait()`` at the end of backward, after which every bucket holds the average.
"""
from ... import backend
from ...comm.nonblocking import JobThread
from .buckets import GradBucket


class Overlapped:
    """Each bucket's all-reduce started on the communicator's background thread (NumPy and MPI
    drop the GIL, so it really runs beside backward, given a free core); ``wait`` waits for
    them all."""

    def __init__(self, comm, algorithm, buffers):
        self.comm, self.algorithm, self.buffers, self.works = comm, algorithm, buffers, []

    def launch(self, i):
        buf = self.buffers[i]
        self.works.append(self.comm.iall_reduce(buf, op="sum", algorithm=self.algorithm, out=buf))

    def wait(self):
        works, self.works = self.works, []
        for work in works:
            work.wait()


class CommHook:
    """Each bucket averaged by ``hook(state, bucket)`` at its launch: ``bucket`` a
    ``GradBucket`` over the bucket's buffer, the hook's result (or its ``wait()``'s, a Future
    or a Work as torch's hooks return) left in that buffer."""

    def __init__(self, hook, state, comm, algorithm, buckets, buffers):
        if getattr(hook, "__name__", None) == "bf16_compress_hook":
            # torch refuses this hook here where its backend has no bfloat16; CuPy has none:
            # a TypeError now, not at the first backward
            backend.check_dtype("bfloat16")
        self.hook, self.state, self.buffers, self.rank = hook, state, buffers, comm.rank
        self.buckets = [GradBucket(i, buf, b, comm, algorithm, last=i == len(buckets) - 1)
                        for i, (b, buf) in enumerate(zip(buckets, buffers))]

    def launch(self, i):
        result = self.hook(self.state, self.buckets[i])
        if hasattr(result, "wait"):
            result = result.wait()
        buf = self.buffers[i]
        if result is not buf:
            if getattr(result, "shape", None) != buf.shape:
                raise ValueError(f"rank {self.rank}: communication hook "
                                 f"{getattr(self.hook, '__qualname__', self.hook)!r} returned "
                                 f"{type(result).__name__} of shape "
                                 f"{getattr(result, 'shape', None)} for bucket {i}; expected "
                                 f"the bucket's flat gradient, shape {buf.shape}")
            buf[...] = result  # cast back to the bucket's dtype where the hook compressed

    def wait(self):
        """Nothing left: each bucket was averaged at its launch."""


class OverlappedCommHook(CommHook):
    """The hooks on a thread of their own, in bucket order: their collectives (on the model's
    communicator, idle in the main thread until backward ends) go in the same order on every
    rank while backward computes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.thread, self.works = JobThread("minipar-comm-hook"), []

    def launch(self, i):
        self.works.append(self.thread.start(super().launch, i))

    def wait(self):
        works, self.works = self.works, []
        # a hook's error is raised here at once: the hook thread goes on with the next
        # buckets, whose messages then meet a peer still in this one (a CommError there too,
        # rather than a hang)
        for work in works:
            work.wait()
