"""Expert parallelism (GShard, Lepikhin et al. 2020): a mixture of experts whose experts live on
different ranks, tokens travelling to them and back through the hand-coded all-to-all.

    dispatch.py   the plan (counts per rank and expert), dispatch and combine over
                  all_to_all_v, the counts matrix printed as a table
    layer.py      ExpertParallelMoE: nn.moe.MoE with this rank's experts; from_serial

Lesson 12 runs it against its serial twin, ``nn.moe.MoE`` on each rank's tokens; the theory is
in docs/tensor_parallel.md.
"""
from .dispatch import (Plan, all_to_all_v, combine, counts_matrix, dispatch, gather_rows, plan,
                       reduce_scatter_rows, table)
from .layer import ExpertParallelMoE

__all__ = ["ExpertParallelMoE", "Plan", "all_to_all_v", "combine", "counts_matrix", "dispatch",
           "gather_rows", "plan", "reduce_scatter_rows", "table"]
