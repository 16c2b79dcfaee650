"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each layer's matrices split over ranks.

    shard.py       which slice of a serial weight a rank keeps; the whole array back
    mappings.py    f and g: identity one way, a collective the other (Megatron's names)
    layers.py      column- and row-parallel linear layers, the MLP and attention built from them
    embedding.py   the vocabulary split: token table and cross-entropy, logits never gathered
    report.py      the traffic a CollectiveLog recorded, tabulated beside Megatron's count
"""
from .embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                     RowParallelLinear)
from .mappings import (SEQ, CollectiveLog, allreduce_replicated_grads,
                       copy_to_tensor_region, gather_from_sequence_region,
                       gather_from_tensor_region, reduce_from_tensor_region,
                       reduce_scatter_to_sequence_region, scatter_to_sequence_region,
                       scatter_to_tensor_region)
from .report import accounting, place, tally
from .shard import divide, shard, split_specs, unshard
