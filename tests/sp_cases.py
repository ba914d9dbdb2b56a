"""Shared parts of the sequence-parallel tests: a tiny Llama, the reference loop (one process, no
sequence parallelism, the same global batch) and the sharded loop through shardspeed.

Registering the sequence-parallel attention replaces transformers' "sdpa" entry process-wide (as DeepSpeed
does): a rank computes every reference before its first registration (``reference`` checks it)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

VOCAB, HIDDEN, STEPS, LR, CLIP = 64, 32, 3, 3e-3, 0.5


def llama_config(heads: int = 4, kv_heads: int = 2, layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       attention_dropout=0.0, tie_word_embeddings=False)


def llama(heads: int = 4, kv_heads: int = 2, layers: int = 2, seed: int = 0, attn: str = "sdpa"):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(llama_config(heads, kv_heads, layers), attn_implementation=attn)


def plain_sdpa() -> bool:
    """Whether transformers' "sdpa" entry is still its own function (no registration in this process yet)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward


def batches(replicas: int, micro: int, seq: int, pad_tail: int = 0, seed: int = 1,
            steps: int = STEPS) -> List[List[Dict[str, Any]]]:
    """``steps`` steps of one micro-batch per data replica; ``pad_tail`` ignored labels at the end of sample 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(replicas):
            ids = torch.randint(0, VOCAB, (micro, seq), generator=g)
            labels = ids.clone()
            if pad_tail:
                labels[0, -pad_tail:] = -100
            step.append({"input_ids": ids, "labels": labels})
        out.append(step)
    return out


def reference(model, steps: List[List[Dict[str, Any]]], clip: float = CLIP) -> Dict[str, Any]:
    """Plain torch: each replica's token-mean loss, averaged over replicas (what data parallelism trains)."""
    assert plain_sdpa(), "a reference must be computed before the sequence-parallel attention is registered"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in steps:
        opt.zero_grad()
        total = sum(model(**b).loss for b in step) / len(step)
        total.backward()
        if clip:  # the engine's gradient_clipping: the global norm must count each parameter once
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(total.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def config(stage: int, sp: int, micro: int = 1, **extra: Any) -> Dict[str, Any]:
    return dict({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                 # stage 3 releases every unit between uses (none persistent: the tiny model's parameters are
                 # all under DeepSpeed's default persistence threshold, which would keep them whole)
                 "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0}
                                                          if stage == 3 else {})},
                 "sequence_parallel_size": sp,
                 "gradient_clipping": CLIP}, **extra)


def train_sp(model, cfg: Dict[str, Any], steps: List[List[Dict[str, Any]]], *, attention: str = "ulysses",
             tiled: Optional[int] = None, tiled_loss: int = 1, register_with: Any = None,
             compile_backend: Optional[str] = None) -> Dict[str, Any]:
    """The same steps through shardspeed with sequence parallelism: this rank takes its data replica's batch
    and its shard of the sequence; the loss is the built-in token-count combination.

    ``register_with`` (a name/path or another loaded model; default ``model``) is what
    ``register_with_transformers`` gets; ``model`` may be a function building the model, called after
    registering (DeepSpeed's order: register, then build, then initialize). ``compile_backend``: the engine's
    blocks compiled with it (``engine.compile``) before the first step."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.parallel.sp import causal_lm_loss, enable_tiled_mlp, sequence_parallel_loss, shard_batch
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    sp = cfg["sequence_parallel_size"]
    mpu = UlyssesSPAttentionHF.register_with_transformers(model if register_with is None else register_with, "sdpa",
                                                          sp, cfg["train_micro_batch_size_per_gpu"], attention=attention)
    if not isinstance(model, torch.nn.Module):
        model = model()
    if tiled:
        enable_tiled_mlp(model, tiled)
    engine, *_ = shardspeed.initialize(model=model, config=cfg, mpu=mpu)
    if compile_backend is not None:
        engine.compile(backend=compile_backend)
    group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    layout = "zigzag" if attention == "ring" else "contiguous"
    losses = []
    for step in steps:
        b = shard_batch(step[mpu.get_data_parallel_rank()], rank, sp, layout=layout)
        if tiled_loss > 1:
            hidden = engine.module.model(input_ids=b["input_ids"], position_ids=b["position_ids"]).last_hidden_state
            loss = causal_lm_loss(engine.module, hidden, b["shift_labels"], group, shards=tiled_loss)
        else:
            logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            loss = sequence_parallel_loss(logits, b["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()  # the replicas' mean, as the reference reports
        dist.all_reduce(mean, group=mpu.get_data_parallel_group())
        losses.append(float(mean) / mpu.get_data_parallel_world_size())
    full = engine._zero3_consolidated_16bit_state_dict() if cfg["zero_optimization"]["stage"] == 3 else \
        {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": full}


def max_diff(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, float]:
    """Largest loss and parameter differences (parameters: only where ``a`` has them, i.e. rank 0 at stage 3)."""
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    if a["params"] is None:
        return {"loss": loss, "param": 0.0}
    keys = set(a["params"]) & set(b["params"])
    assert keys, "no parameters to compare"
    return {"loss": loss, "param": max(float((a["params"][k] - b["params"][k]).abs().max()) for k in keys)}


def sp_logits(engine, input_ids: torch.Tensor, mpu) -> torch.Tensor:
    """The engine's forward logits of ``input_ids`` (every rank holds the whole batch), each rank running its
    shard of the sequence, gathered over the sequence group into the whole sequence's."""
    import torch.distributed as dist

    from shardspeed.parallel.sp import shard_batch

    group, rank, sp = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), \
        mpu.get_sequence_parallel_world_size()
    b = shard_batch({"input_ids": input_ids, "labels": input_ids.clone()}, rank, sp)
    with torch.no_grad():
        logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits.contiguous()
    parts = [torch.empty_like(logits) for _ in range(sp)]
    dist.all_gather(parts, logits, group=group)
    return torch.cat(parts, dim=1)[:, : input_ids.shape[1]]
