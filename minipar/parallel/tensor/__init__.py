"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each layer's matrices split over ranks.

Data parallelism splits the batch; tensor parallelism splits the weights. The p ranks of a tensor
group see the same batch, each holds 1/p of every weight matrix and computes 1/p of every layer,
and they meet inside each layer through an all-reduce (or, with sequence parallelism, an
all-gather and a reduce-scatter). One file per idea, as in Megatron's ``tensor_parallel/``:

    shard.py       which slice of a serial weight a rank keeps; the whole array back
    mappings.py    f and g: identity one way, a collective the other (Megatron's names)
    layers.py      column- and row-parallel linear layers, the MLP and attention built from them
    embedding.py   the vocabulary split: token table and cross-entropy, logits never gathered
    gpt.py         TensorParallelGPT, the mirror of nn.GPT, and the copies to and from its twin
    report.py      the traffic a CollectiveLog recorded, tabulated beside Megatron's count
    moe.py         mixture-of-experts blocks: experts over an expert group, each a ParallelMLP
                   (imported from ``minipar.parallel.tensor.moe``: the 4D trainer's model)

In outline (lesson 10 runs it against the serial model):

    model = shard_from_serial(serial_gpt, group)    # this rank's slices of the serial weights
    with CollectiveLog() as log:
        local_logits, loss = model(ids, targets)    # logits: this rank's V/p; loss: whole
        loss.backward()
        model.finalize_grads()                      # sequence parallelism's extra sum
    print("\n".join(accounting(log.events, group.size)))
"""
from .embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .gpt import (ParallelBlock, ParallelGPTEmbedding, TensorParallelGPT, check_config,
                  copy_serial_slices, gather_to_serial, local_slices, shard_from_serial)
from .layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                     RowParallelLinear)
from .mappings import (SEQ, CollectiveLog, allreduce_replicated_grads,
                       copy_to_tensor_region, gather_from_sequence_region,
                       gather_from_tensor_region, reduce_from_tensor_region,
                       reduce_scatter_to_sequence_region, scatter_to_sequence_region,
                       scatter_to_tensor_region)
from .report import accounting, place, tally
from .shard import divide, shard, split_specs, unshard

__all__ = ["divide", "shard", "unshard", "split_specs",
           "SEQ", "CollectiveLog", "copy_to_tensor_region", "reduce_from_tensor_region",
           "scatter_to_tensor_region", "gather_from_tensor_region", "scatter_to_sequence_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "allreduce_replicated_grads",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ParallelGPTEmbedding", "ParallelBlock", "check_config", "TensorParallelGPT",
           "local_slices", "copy_serial_slices", "gather_to_serial", "shard_from_serial",
           "place", "tally", "accounting"]
