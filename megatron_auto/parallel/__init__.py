"""megatron_auto.parallel: process groups, tensor-parallel layers, relayout, pipeline, data parallel.

The commonly used runtime-model names are re-exported here; the other modules (``pipeline``,
``p2p``, ``data_parallel``, ``grad_norm``, ``optimizer`` (AdamW over the data-parallel
parameters) and ``memory`` (per-iteration peak memory, used by the trainer and the profiler))
are imported by path.
"""

from .context import (LayerGroups, ParallelContext, StageLayout, dp_group_ranks, stage_layout,
                      tp_dp_rank, tp_group_ranks)
from .redistribute import batch_chunk, relayout
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)

__all__ = ["LayerGroups", "ParallelContext", "StageLayout", "dp_group_ranks", "stage_layout",
           "tp_dp_rank", "tp_group_ranks", "batch_chunk", "relayout", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
