"""What the ring did on this rank, block by block and step by step: the work behind the layout.

    with RingLog() as log:
        out = ring_attention(q, k, v, group)
        out.sum().backward()
    log.work("forward")     # {"blocks": 5, "skipped": 3, "scores": .., "causal": .., "wait_s": ..}
    log.steps("forward")    # per step, [(q chunk, k chunk, kind), ...]: the ring's timeline

``scores`` counts the entries of q kᵀ computed (blocks computed × block size); ``causal`` those
the causal mask keeps (j ≤ i), the work of a kernel that skips masked entries; ``wait_s`` the
seconds spent waiting for the next k/v block (the communication compute did not hide).
"""
from ...recording import Recorder


class RingLog(Recorder):
    """Context: records each block the ring attention runs on this rank (``events``, dicts)."""

    def steps(self, direction="forward"):
        """[[(q chunk, k chunk, kind), ...] for each step]; kind: full, diagonal or skipped."""
        blocks = [e for e in self.events if e["direction"] == direction and "kind" in e]
        out = [[] for _ in range(1 + max((e["step"] for e in blocks), default=-1))]
        for e in blocks:
            out[e["step"]].append((e["q_chunk"], e["k_chunk"], e["kind"]))
        return out

    def work(self, direction="forward"):
        """Totals over the steps: blocks computed and skipped, score entries, seconds waited."""
        mine = [e for e in self.events if e["direction"] == direction]
        blocks = [e for e in mine if "kind" in e]
        return {"blocks": sum(e["kind"] != "skipped" for e in blocks),
                "skipped": sum(e["kind"] == "skipped" for e in blocks),
                "scores": sum(e["scores"] for e in blocks),
                "causal": sum(e["causal"] for e in blocks),
                "wait_s": sum(e.get("wait_s", 0.0) for e in mine)}


def note_block(direction, step, i, j, kind, shape):
    """A block of q chunk i against k chunk j; ``shape`` that of its scores (..., c, c)."""
    if not RingLog.recording():
        return
    c_q, c_k = shape[-2], shape[-1]
    rows = 1
    for n in shape[:-2]:
        rows *= n
    scores = 0 if kind == "skipped" else rows * c_q * c_k
    causal = rows * c_q * (c_q + 1) // 2 if kind == "diagonal" else scores
    RingLog.record({"direction": direction, "step": step, "q_chunk": i, "k_chunk": j,
                    "kind": kind, "scores": scores, "causal": causal})


def note_wait(direction, step, seconds):
    """Seconds this rank waited at ``step`` for a block still on the wire."""
    RingLog.record({"direction": direction, "step": step, "wait_s": seconds})
