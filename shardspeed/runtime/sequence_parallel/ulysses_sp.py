"""DeepSpeed's Arctic Long Sequence Training API (``deepspeed.runtime.sequence_parallel.ulysses_sp``).

A script written for DeepSpeed runs with ``deepspeed`` → ``shardspeed`` in its imports, in DeepSpeed's order
(register, then build or load the model, then initialize; registering a loaded model works too)::

    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path, "sdpa", sequence_parallel_size=P,
                                                          micro_batch_size=1)
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, attn_implementation="sdpa")
    engine, *_ = shardspeed.initialize(model=model, config={..., "sequence_parallel_size": P}, mpu=mpu)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)

As DeepSpeed does, registering replaces the core implementation's entry ("sdpa") in transformers' attention
registry, process-wide: every model of the process that uses it runs sequence-parallel attention from then
on (compute plain references before registering). The same function is also registered as "ulysses".
It is Ulysses (P divides the heads) or, with ``attention="ring"`` (shardspeed's extension; ``"auto"`` picks
it when P does not divide the heads), ring attention, whose batches must come in the zigzag layout
(``UlyssesSPDataLoaderAdapter(..., layout="zigzag")``). ``initialize`` checks on the first forward that
the model's attention went through it (:mod:`.attention_check`).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import ConfigError
from ...mesh.init import init_distributed
from ...mesh.mpu import MeshMPU
from ...mesh.topology import Topology, mesh_dims
from ...parallel.sp import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    check_heads,
    mark_sequence_parallel,
    prepare_full,
    ring_attention,
    sequence_tiled_compute,
    take_shard,
    ulysses_attention,
)

logger = logging.getLogger("shardspeed")

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "TiledFusedLogitsLoss",
           "SequenceTiledCompute", "sequence_tiled_compute", "sequence_parallel_mpu"]

ATTENTION_NAME = "ulysses"


def sequence_parallel_mpu(sequence_parallel_size: int) -> MeshMPU:
    """The mesh of the world with a sequence dimension of ``sequence_parallel_size`` (data = world / P), as
    an mpu for ``initialize(mpu=...)``; the same groups ``initialize`` builds from the config key (collective)."""
    init_distributed()
    return MeshMPU(Topology.from_mesh(dims=mesh_dims({}, ("sequence",)), sequence=int(sequence_parallel_size)))


class UlyssesSPAttentionHF(nn.Module):
    """The "ulysses" attention function of transformers' AttentionInterface: Ulysses (or ring) attention
    over ``process_group`` around the core implementation ``attn``. DeepSpeed's constructor arguments;
    ``attention``: "ulysses" or "ring"."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False, attention: str = "ulysses") -> None:
        super().__init__()
        self.attn, self.process_group, self.attention = attn, process_group, attention
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size, self.attn_head_count, self.attn_head_size = batch_size, attn_head_count, attn_head_size
        self.global_kv_head_count, self.num_hidden_layers = kv_head_count, num_hidden_layers
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.core_attn_implementation: Optional[str] = None  # the registry entry it replaces (DeepSpeed's)
        if attention == "ulysses":
            check_heads(attn_head_count, kv_head_count, self.world_size)
        elif attention != "ring":
            raise ConfigError(f"attention must be 'ulysses' or 'ring', got {attention!r}")

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, Any]:
        mark_sequence_parallel(module)  # went through here (also when eval bypasses it)
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if not self.seq_length_is_variable and self.local_seq_length is not None \
                and query.shape[2] != self.local_seq_length:
            raise ConfigError(f"ulysses attention: this rank has {query.shape[2]} tokens, but seq_length "
                              f"{self.global_seq_length} / sequence_parallel_size {self.world_size} = "
                              f"{self.local_seq_length} (pass seq_length_is_variable=True for varying lengths)")
        # the mask transformers made covers this rank's tokens only: causal attention over the gathered
        # sequence needs none (padding sits at the end, its labels ignored)
        if self.attention == "ring":
            return ring_attention(module, query, key, value, self.process_group, **kwargs)
        return ulysses_attention(self.attn, module, query, key, value, self.process_group, **kwargs)

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False, *, attention: str = "ulysses"):
        """Register the sequence-parallel attention with transformers and return the mpu for
        ``initialize(mpu=...)`` (None at ``sequence_parallel_size`` 1, as DeepSpeed).

        As DeepSpeed: ``core_attn_implementation``'s entry in transformers' registry is replaced, process-wide,
        whether ``model_name_or_path`` is a loaded model (its ``attn_implementation`` must be that one; its
        config is left as it is) or a name or path (its config gives the head counts; the model built or loaded
        next with that implementation runs it). Registering again (another size, ``attention``) replaces the
        previous registration: it wraps the original core function, never the previous wrapper."""
        if int(sequence_parallel_size) == 1:
            return None
        if not seq_length_is_variable and seq_length is None:
            raise ConfigError("register_with_transformers: seq_length_is_variable=False needs seq_length")
        from transformers import AttentionInterface, AutoConfig

        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:
            _check_model_attention(config, core_attn_implementation)
        core = _core_function(AttentionInterface._global_mapping, core_attn_implementation)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, kv_heads = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None) or
                                                             text.num_attention_heads)
        p = int(sequence_parallel_size)
        if attention == "auto":
            attention = "ulysses" if heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0) else "ring"
        mpu = sequence_parallel_mpu(p)
        local = None if seq_length_is_variable or seq_length is None else int(seq_length) // p
        uattn = cls(core, micro_batch_size, heads, int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                    kv_heads, int(text.num_hidden_layers), mpu.get_sequence_parallel_group(), seq_length_is_variable,
                    local, seq_length, disable_in_eval, attention)
        uattn.core_attn_implementation = core_attn_implementation
        logger.info("register_with_transformers: %r now runs %s attention over the sequence group (process-wide)",
                    core_attn_implementation, attention)
        AttentionInterface.register(core_attn_implementation, uattn)
        AttentionInterface.register(ATTENTION_NAME, uattn)
        return mpu


def _check_model_attention(config: Any, core: str) -> None:
    """A loaded model must use the implementation whose entry is replaced (DeepSpeed's check), or "ulysses"."""
    current = getattr(config, "_attn_implementation", None)
    if current not in (None, core, ATTENTION_NAME):
        raise ConfigError(f"core_attn_implementation {core!r} does not match the model's attention implementation "
                          f"{current!r}: load the model with attn_implementation={core!r} (or pass its own "
                          f"implementation, if not eager, as core_attn_implementation)")


def _core_function(mapping: Dict[str, Any], core: str) -> Any:
    """transformers' own function for ``core`` (under a previous registration: the one it wraps)."""
    if core in ("eager", "paged|eager"):
        raise ConfigError(f"core_attn_implementation {core!r}: eager attention needs a 4D mask of the whole "
                          f"sequence; use 'sdpa' or a flash attention")
    if core not in mapping:
        raise ConfigError(f"core_attn_implementation {core!r} is not one of transformers' attention "
                          f"implementations {sorted(mapping)}")
    fn = mapping[core]
    while isinstance(fn, UlyssesSPAttentionHF):
        fn = fn.attn
    return fn


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter: each ``next()`` takes one batch from every SP rank's ``dl`` (all ranks draw),
    then gives each rank its shard of rank 0's batch, then of rank 1's, ... (P micro-batches per P draws).

    Each shard has ``shift_labels`` (labels shifted before sharding, -100 at the end; ``labels`` removed),
    ``position_ids`` (added when absent), and sequences padded to a multiple of P (2P for
    ``layout="zigzag"``, ring attention's) instead of DeepSpeed's error."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device, *, layout: str = "contiguous",
                 pad_token_id: int = 0):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device, self.layout, self.pad_token_id = torch.device(device), layout, pad_token_id
        self.iter = iter(dl)
        self.micro_batches: Deque[Dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> Dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "input_ids" not in batch:
            raise ConfigError("UlyssesSPDataLoaderAdapter: each batch must be a dict with input_ids")
        for full in _gather_batches(batch, self.sp_group, self.sp_world_size, self.device):
            full = prepare_full(full, self.sp_world_size, self.layout, self.pad_token_id)
            self.micro_batches.append(take_shard(full, self.sp_rank, self.sp_world_size, self.layout))


def _gather_batches(batch: Dict[str, Any], group, world: int, device: torch.device) -> List[Dict[str, Any]]:
    """Every SP rank's batch, in rank order (sequence tensors padded to the longest for the gather, then cut
    back to each rank's own length)."""
    seq = int(batch["input_ids"].shape[1])
    lens = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lens, torch.tensor([seq], dtype=torch.int64, device=device), group=group)
    lengths = [int(t.item()) for t in lens]
    longest = max(lengths)
    out: List[Dict[str, Any]] = [{} for _ in range(world)]
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq:
            t = value.to(device)
            if seq < longest:
                t = torch.cat([t, t.new_zeros((t.shape[0], longest - seq, *t.shape[2:]))], dim=1)
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for r in range(world):
                out[r][key] = parts[r][:, :lengths[r]]
        else:
            objs: List[Any] = [None] * world
            dist.all_gather_object(objs, value, group=group)
            for r in range(world):
                out[r][key] = objs[r]
    return out
