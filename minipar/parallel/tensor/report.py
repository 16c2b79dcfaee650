"""The bill for a tensor group's traffic: what a CollectiveLog recorded, tabulated by place.

Megatron's count per transformer layer and step is two all-reduces forward (g after attention's
c_proj, g after the MLP's c_proj) and two backward (f before c_attn, f before c_fc), each of
B·T·C elements. Outside the layers come one forward all-reduce for the embedding, one backward
for lm_head's f, and three small ones (one number per token) for the loss. Under sequence
parallelism each layer runs two all-gathers of T and two reduce-scatters of T each way instead.
``CollectiveLog`` (mappings.py) measures all of this and ``accounting`` tabulates it.

    place(where)            a module's name -> its row: 'blocks.3.mlp.c_proj' -> 'blocks.3'
    tally(events)           {place: {direction: {op: [count, bytes, bytes sent]}}}
    accounting(events, tp)  the table as lines, each block beside Megatron's count
"""
import collections


def place(where):
    """'blocks.3.mlp.c_proj' -> 'blocks.3'; 'embed.wte' -> 'embed'; 'loss' -> 'loss'."""
    parts = where.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def tally(events):
    """{place: {direction: {op: [count, bytes, bytes sent]}}} from CollectiveLog events."""
    table = collections.defaultdict(lambda: collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0, 0])))
    for e in events:
        row = table[place(e["where"])][e["direction"]][e["op"]]
        row[0] += 1
        row[1] += e["bytes"]
        row[2] += e["sent"]
    return table


def _order(where):
    first = {"embed": 0, "blocks": 1, "ln_f": 2, "lm_head": 3, "loss": 4, "grads": 5}
    head, _, index = where.partition(".")
    return first.get(head, 6), int(index or 0), where


def accounting(events, tp):
    """Lines: per place and collective, how many ran each way, the bytes of each (the whole
    tensor) and the bytes this rank sent. Each block's row stands beside Megatron's count: two
    all-reduces forward and two backward, or, with sequence parallelism, two all-gathers and two
    reduce-scatters each way."""
    table = tally(events)
    lines = [f"{'where':9s} {'collective':15s} {'fwd':>4s} {'bwd':>4s} {'bytes each':>11s} "
             f"{'sent':>9s}  Megatron per layer (fwd + bwd)"]
    for where in sorted(table, key=_order):
        for op in sorted({op for ops_ in table[where].values() for op in ops_}):
            fwd, bwd = (table[where][d].get(op, [0, 0, 0]) for d in ("forward", "backward"))
            count = fwd[0] + bwd[0]
            megatron = {"all_reduce": "2 + 2", "all_gather": "2 + 2 (sequence parallel)",
                        "reduce_scatter": "2 + 2 (sequence parallel)"}
            lines.append(f"{where:9s} {op:15s} {fwd[0]:4d} {bwd[0]:4d} "
                         f"{(fwd[1] + bwd[1]) / count:11,.0f} {fwd[2] + bwd[2]:9,d}  "
                         f"{megatron.get(op, '') if where.startswith('blocks') else ''}")
    lines.append(f"{len(events)} collectives in all; this rank sent "
                 f"{sum(e['sent'] for e in events):,} bytes in its tensor group of {tp}")
    return lines
