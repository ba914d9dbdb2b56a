"""Sequence parallelism (long context): the sequence of each sample split over the mesh's sequence dimension.

Ulysses attention (all-to-all of heads and sequence), ring attention (no head limit, zigzag load balance),
ALST's tiled compute, the batch split and the token-count loss. The Hugging Face face of it (DeepSpeed's
``UlyssesSPAttentionHF`` API) is :mod:`shardspeed.runtime.sequence_parallel.ulysses_sp`."""
from .attention import SP_MARK, check_heads, mark_sequence_parallel, ring_attention, ulysses_attention
from .comm import all_gather_stacked, all_to_all, sum_over_ranks
from .loss import combine_shard_losses, combine_shard_means, sequence_parallel_loss, token_count
from .models import causal_lm_loss, disable_tiled_mlp, enable_tiled_mlp
from .shard import IGNORE_INDEX, padded_length, prepare_full, shard_batch, take_shard, unshard
from .tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "SP_MARK", "check_heads", "mark_sequence_parallel", "ring_attention", "ulysses_attention", "all_gather_stacked", "all_to_all", "sum_over_ranks",
    "combine_shard_losses", "combine_shard_means", "sequence_parallel_loss", "token_count", "causal_lm_loss",
    "disable_tiled_mlp", "enable_tiled_mlp", "IGNORE_INDEX", "padded_length", "prepare_full", "shard_batch",
    "take_shard", "unshard", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute",
]
