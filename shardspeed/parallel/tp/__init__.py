"""Tensor parallelism (Megatron-style layers over the mesh's ``model`` dimension) and AutoTP plans.

See docs/parallelism.md, "Tensor parallelism".
"""
from .apply import TPReport, VocabParallelHead, apply_tensor_parallel
from .comm import TPGroup, copy_to, gather_from, gather_seq, reduce_from, reduce_scatter_seq, scatter_to
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import mean_cross_entropy, vocab_parallel_cross_entropy
from .plan import PRESETS, Rule
from .rng import ForkedDropout, TPRNGTracker
from .slicing import TPSlice, assemble, take

__all__ = [
    "TPReport", "VocabParallelHead", "apply_tensor_parallel", "TPGroup", "copy_to", "gather_from", "gather_seq",
    "reduce_from", "reduce_scatter_seq", "scatter_to", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "mean_cross_entropy", "vocab_parallel_cross_entropy", "PRESETS", "Rule",
    "ForkedDropout", "TPRNGTracker", "TPSlice", "assemble", "take",
]
