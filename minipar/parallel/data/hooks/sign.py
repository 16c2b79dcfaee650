"""1-bit compression with error feedback: each rank sends the signs of its gradient, 8 to a
byte, and one scale, their mean magnitude (Seide et al. 2014, "1-bit SGD"; Karimireddy et al.
2019, "Error Feedback Fixes SignSGD"); what the signs miss is kept and joins the next step.

    state = SignState()
    model.register_comm_hook(state, sign_hook)

Bytes per rank per step (one ring all-gather): (p-1) (ceil(n/8) + 4) for a bucket of n
entries, the 4 a float32 scale; plain all-reduce: 2 (p-1)/p n s, s the item size.
"""
from .... import backend
from .default import communicator
from .state import HookState


class SignState(HookState):
    """What ``sign_hook`` keeps between steps: the communicator (``process_group``; None: the
    DDP's) and each bucket's residual in ``error_dict`` by bucket index (torch's name). No
    setting sizes its messages: the ranks agree on the state's kind alone (HookState)."""

    def __init__(self, process_group=None, use_error_feedback=True):
        self.process_group = process_group
        self.use_error_feedback = use_error_feedback
        self.error_dict = {}


def sign_hook(state, bucket):
    """Average the bucket's gradient over the ranks from each rank's signs and scale."""
    comm = communicator(state.process_group, bucket)
    g = bucket.buffer()
    xp = backend.get_array_module(g)
    n, index = g.size, bucket.index()
    state.begin(comm, bucket)
    p = g + state.error_dict[index] if index in state.error_dict else g
    # Karimireddy's scale ||p||_1 / n: scale * sign(p) then keeps p's mean magnitude. It travels
    # as float32, and every rank (this one too) decodes that float32.
    scale = xp.mean(xp.abs(p), dtype=xp.float64).astype(xp.float32).reshape(1)
    positive = p >= 0  # one bit per entry: +1 for p >= 0 (so sign(0) = +1), -1 below
    message = xp.concatenate([xp.packbits(positive), scale.view(xp.uint8)])
    if state.use_error_feedback:
        state.error_dict[index] = p - decode(message, n, g.dtype)
    messages = comm.all_gather(message)  # (p, ceil(n/8) + 4) bytes
    # added in rank order on every rank, from the same messages: the same bits everywhere
    total = xp.zeros_like(g)
    for r in range(comm.size):
        total += decode(messages[r], n, g.dtype)
    g[...] = total / comm.size
    return state.settle(bucket, g)


def decode(message, n, dtype):
    """scale * (+1 or -1) per entry, from a message of packed signs and a float32 scale."""
    xp = backend.get_array_module(message)
    signs = xp.unpackbits(message[:-4])[:n].astype(dtype) * 2 - 1
    scale = message[-4:].copy().view(xp.float32).astype(dtype)  # copied: 4-byte aligned
    return scale * signs
