"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each layer's matrices split over ranks.

One file per idea, as in Megatron's ``tensor_parallel/`` (the theory: docs/tensor_parallel.md):

    shard.py       which slice of a serial weight a rank keeps; the serial twin's slices in and out
    mappings.py    f and g: identity one way, a collective the other (Megatron's names)
    layers.py      column- and row-parallel linear layers, the MLP and attention built from them
    embedding.py   the vocabulary split: token table and cross-entropy, logits never gathered
    gpt.py         TensorParallelGPT, the mirror of nn.GPT
    report.py      the traffic a CollectiveLog recorded, tabulated beside Megatron's count
    moe.py         mixture-of-experts blocks: experts over an expert group, each a ParallelMLP

    model = shard_from_serial(serial_gpt, group)    # lesson 10 runs it against the serial model
    with CollectiveLog() as log: ...                # then accounting(log.events, group.size)
"""
from .embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .gpt import (ParallelBlock, ParallelGPTEmbedding, TensorParallelGPT, check_config,
                  shard_from_serial)
from .layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                     RowParallelLinear, SequenceParallelDropout)
from .mappings import (SEQ, CollectiveLog, allreduce_replicated_grads,
                       copy_to_tensor_region, gather_from_sequence_region,
                       gather_from_tensor_region, reduce_from_tensor_region,
                       reduce_scatter_to_sequence_region, scatter_to_sequence_region,
                       scatter_to_tensor_region)
from .report import accounting, place, tally
from .shard import (copy_serial_slices, divide, gather_to_serial, local_slices, shard,
                    split_specs, unshard)

__all__ = ["divide", "shard", "unshard", "split_specs",
           "SEQ", "CollectiveLog", "copy_to_tensor_region", "reduce_from_tensor_region",
           "scatter_to_tensor_region", "gather_from_tensor_region", "scatter_to_sequence_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "allreduce_replicated_grads",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
           "SequenceParallelDropout",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ParallelGPTEmbedding", "ParallelBlock", "check_config", "TensorParallelGPT",
           "local_slices", "copy_serial_slices", "gather_to_serial", "shard_from_serial",
           "place", "tally", "accounting"]
