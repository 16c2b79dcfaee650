"""PowerSGD: each gradient matrix averaged as a rank-r product P Qᵀ found by one step of power
iteration, with error feedback (Vogels, Karimireddy & Jaggi 2019), as torch's ``powerSGD_hook``.

    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    model.register_comm_hook(state, powerSGD_hook)

Per step and bucket: the 1-D tensors and the matrices too small to gain, in one flat all-reduce;
then P (n x r) and Q (m x r) of every other matrix, each in one all-reduce: (n + m) r elements
where plain averaging sends n m. ``state.error_dict`` holds each bucket's residual, and
``state.q_memory_dict`` the Q reused by the next step (warm start). docs/data_parallel.md.
"""
import numpy as np

from .... import backend
from .default import allreduce_hook, communicator
from .state import HookState


class PowerSGDState(HookState):
    """torch's ``PowerSGDState``: the settings, the step count ``iter`` (plain all-reduce while
    ``iter < start_powerSGD_iter``), and per bucket index the residuals (``error_dict``) and the
    P and Q memories (``p_memory_dict``, ``q_memory_dict``). ``process_group``: a Communicator,
    or None for the model's. Unlike torch's, PowerSGD may start at step 0 with error feedback
    or warm start: torch needs two plain steps because its DDP rebuilds the buckets after the
    first; minipar's never does."""
    # what a step changes, put back when GradScaler skips it (HookState); the stats stay
    kept = ("error_dict", "p_memory_dict", "q_memory_dict", "iter", "rng")

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True,
                 orthogonalization_epsilon=0, random_seed=0,
                 compression_stats_logging_frequency=10_000, batch_tensors_with_same_shape=False):
        rank = matrix_approximation_rank
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"matrix_approximation_rank must be an integer >= 1, got {rank!r}")
        if start_powerSGD_iter < 0 or min_compression_rate < 0 or orthogonalization_epsilon < 0:
            raise ValueError(f"start_powerSGD_iter, min_compression_rate and "
                             f"orthogonalization_epsilon must be >= 0, got {start_powerSGD_iter!r},"
                             f" {min_compression_rate!r} and {orthogonalization_epsilon!r}")
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        # the same seed on every rank: each first Q is the same random matrix everywhere
        self.rng = np.random.RandomState(random_seed)
        self.compression_stats_logging_frequency = compression_stats_logging_frequency
        # torch batches matrices of one shape into one matmul: speed only, the same numbers
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.error_dict, self.p_memory_dict, self.q_memory_dict = {}, {}, {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket):
        """One more step once the last bucket of the step is through."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self):
        """(compression rate, elements before, elements after) over the compressed steps."""
        after = self.total_numel_after_compression
        before = self.total_numel_before_compression
        return (before / after if after > 0 else 0, before, after)

    def settings(self):
        """Ranks with other settings would send P and Q of other sizes, and ranks at another
        ``iter`` would compress while the others all-reduce (HookState compares them)."""
        return dict(matrix_approximation_rank=self.matrix_approximation_rank,
                    start_powerSGD_iter=self.start_powerSGD_iter,
                    min_compression_rate=self.min_compression_rate,
                    use_error_feedback=self.use_error_feedback, warm_start=self.warm_start,
                    random_seed=self.random_seed,
                    orthogonalization_epsilon=self.orthogonalization_epsilon, iter=self.iter)


def should_compress(n, m, rank, min_compression_rate):
    """(compress?, n m, (n + m) rank): a matrix is sent as P and Q only when that is at least
    ``min_compression_rate`` times fewer elements (torch's rule; a 1-D tensor, n x 1, never is)."""
    compressed = (n + m) * rank
    return compressed * min_compression_rate < n * m, n * m, compressed


def orthogonalize(matrix, epsilon=0):
    """The columns of ``matrix`` (n x r, r <= n) made orthonormal in place by Gram-Schmidt, as
    torch does (its rank <= 2 and 16-bit path; it takes a QR above: the same span). A column of
    zeros stays zero with ``epsilon == 0`` (torch's intent; its division would give NaNs)."""
    xp = backend.get_array_module(matrix)
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        norm = xp.sqrt(xp.sum(col * col))
        if epsilon == 0:
            col *= 0 if float(norm) == 0 else 1 / norm
        else:
            col /= norm + epsilon
        # the modified Gram-Schmidt step: col's component removed from every later column
        rest = matrix[:, i + 1:]
        rest -= xp.sum(col * rest, axis=0, keepdims=True) * col


def powerSGD_hook(state, bucket):
    """Average ``bucket`` by PowerSGD (``state``: a ``PowerSGDState``); returns the buffer, which
    holds the approximation. Collectives per compressed step: the uncompressed tensors, P, Q."""
    comm = communicator(state.process_group, bucket)
    state.begin(comm, bucket)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return state.settle(bucket, allreduce_hook(comm, bucket))
    buf, index = bucket.buffer(), bucket.index()
    xp = backend.get_array_module(buf)

    # Error feedback: what the last step's approximation left out of this rank's gradient is
    # added back, so no part of a gradient is lost, only delayed (the paper's section 3.1)
    if state.use_error_feedback:
        if index in state.error_dict:
            buf += state.error_dict[index]
        else:
            state.error_dict[index] = xp.zeros_like(buf)
        before = buf.copy()  # the residual is what the approximation leaves of this

    # Step I: each gradient as a matrix (torch's shape: first dimension by the rest), split into
    # those worth compressing and the rest
    matrices, ranks, plain = [], [], []
    for grad in bucket.gradients():
        matrix = grad.reshape(grad.shape[0] if grad.ndim else 1, -1)  # a view of the bucket
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        compress, numel, compressed = should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += numel
        if compress:
            matrices.append(matrix)
            ranks.append(rank)
            state.total_numel_after_compression += compressed
        else:
            plain.append(grad)
            state.total_numel_after_compression += numel

    # Step II: the uncompressed ones end to end, averaged in one message (empty or not: every
    # rank calls the same collectives)
    flat = (xp.concatenate([g.reshape(-1) for g in plain]) if plain
            else xp.zeros(0, buf.dtype))

    # Step III: P and Q of every matrix as views of two flat memories, one all-reduce each;
    # the first step (or every step without warm start) draws Q at random, the same on every
    # rank; later steps start from the last Q, which tracks the gradient's slowly moving
    # subspace (power iteration spread over steps: the paper's section 3)
    randomize = not state.warm_start or index not in state.p_memory_dict
    if randomize:
        state.p_memory_dict[index] = xp.empty(sum(M.shape[0] * r for M, r in zip(matrices, ranks)),
                                              buf.dtype)
        state.q_memory_dict[index] = xp.empty(sum(M.shape[1] * r for M, r in zip(matrices, ranks)),
                                              buf.dtype)
    ps = views_of(state.p_memory_dict[index], [(M.shape[0], r) for M, r in zip(matrices, ranks)])
    qs = views_of(state.q_memory_dict[index], [(M.shape[1], r) for M, r in zip(matrices, ranks)])
    if randomize:
        draw = np.random.default_rng(state.rng.randint(1_000_000_000))
        for q in qs:
            q[...] = xp.asarray(draw.standard_normal(q.shape))
    for q in qs:
        orthogonalize(q, state.orthogonalization_epsilon)
    for M, q, p in zip(matrices, qs, ps):
        xp.matmul(M, q, out=p)  # P = M Q, this rank's share

    comm.all_reduce(flat, op="sum", algorithm=bucket.algorithm, out=flat)
    xp.divide(flat, comm.size, out=flat)
    offset = 0
    for g in plain:
        g[...] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size

    # sum_r M_r Q = (sum_r M_r) Q; no need to divide by N: P is orthonormalised next
    p_memory = state.p_memory_dict[index]
    comm.all_reduce(p_memory, op="sum", algorithm=bucket.algorithm, out=p_memory)
    for p in ps:
        orthogonalize(p, state.orthogonalization_epsilon)
    for M, p, q in zip(matrices, ps, qs):
        xp.matmul(M.T, p, out=q)  # Q = Mᵀ P, this rank's share
    q_memory = state.q_memory_dict[index]
    comm.all_reduce(q_memory, op="sum", algorithm=bucket.algorithm, out=q_memory)
    xp.divide(q_memory, comm.size, out=q_memory)  # the average of the ranks' Mᵀ P
    for M, p, q in zip(matrices, ps, qs):
        xp.matmul(p, q.T, out=M)  # M ≈ P Qᵀ = P Pᵀ (mean M), written into the bucket

    if state.use_error_feedback:
        state.error_dict[index] = before - buf
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return state.settle(bucket, buf)


def views_of(memory, shapes):
    """``memory`` cut into consecutive arrays of the given 2-D shapes (views)."""
    out, offset = [], 0
    for n, r in shapes:
        out.append(memory[offset:offset + n * r].reshape(n, r))
        offset += n * r
    return out
