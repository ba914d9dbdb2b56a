"""The flops profiler: totals against the analytic GPT count and DeepSpeed's profiler, the report layout, and
the engine's report at ``flops_profiler.profile_step`` (rank 0 only, stages 2 and 3, ``output_file``).

Analytic count for ``shardspeed.models.GPT`` (L layers, width d, vocabulary V, sequence T, B·T tokens):
matmul weights N_mm = 12·L·d² + V·d (qkv 3d², proj d², MLP 8d², tied LM head V·d); forward = 2·N_mm FLOPs per
token + attention 4·L·T·d per token (QKᵀ and the weighted sum, 2·T·d each, causal mask not subtracted);
training = 3 × forward = 6·N_mm + 12·L·T·d per token (``GPT.flops_per_token`` uses N including biases and
LayerNorm weights, 0.4% more at these sizes). As counted (``flops_per_step(measured=True)``) the attention
backward also recomputes QKᵀ (torch's formula for the flash kernels): 6·N_mm + 14·L·T·d per token.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os

import pytest
import torch
from distributed import run_distributed

from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.profiling import FlopsProfiler, get_model_profile, peak_flops, peak_flops_for_name
from shardspeed.profiling.profiler import number_to_string, params_to_string

B, T = 2, 64


def _gpt(preset: str = "small") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(preset))


def _analytic(cfg: GPTConfig, tokens: int, seq: int, training: bool, score_recompute: bool = False) -> int:
    n_mm = 12 * cfg.n_layer * cfg.n_embd ** 2 + cfg.vocab_size * cfg.n_embd
    attn = 4 * cfg.n_layer * seq * cfg.n_embd
    fwd = (2 * n_mm + attn) * tokens
    if not training:
        return fwd
    # the flash kernels' backward recomputes QKᵀ: torch counts attention backward 2.5× its forward
    return 3 * fwd + (attn * tokens // 2 if score_recompute else 0)


def _tokens():
    torch.manual_seed(1)
    return torch.randint(0, 256, (B, T))


def test_forward_flops_match_analytic_and_formatting():
    model = _gpt()
    x = _tokens()
    flops, macs, params = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    want = _analytic(model.config, B * T, T, training=False)
    assert abs(flops - want) / want < 0.01  # DeepSpeed's element-wise estimates (LayerNorm, GELU) add ~0.2%
    assert macs == pytest.approx(want / 2, rel=0.002)  # MACs: matmul FLOPs only
    assert params == model.num_params()
    s_flops, s_macs, s_params = get_model_profile(model, args=[x], print_profile=False)
    assert s_flops == number_to_string(flops) and s_macs.endswith("MACs") and s_params == params_to_string(params)


def test_training_flops_match_analytic_within_2_percent():
    model = _gpt()
    model.train()
    x = _tokens()
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(x, x)
    prof.stop_profile()
    with prof.count_backward():
        loss.backward()
    total = prof.get_total_flops() + prof.get_backward_flops()
    tokens = B * T
    want = _analytic(model.config, tokens, T, training=True)
    assert abs(total - want) / want < 0.02, (total, want)
    # the model's own formula (N with biases and norms) agrees too
    assert abs(total - model.flops_per_token(T) * tokens) / total < 0.02
    # backward as torch counts it: 2× the forward's matmuls, 2.5× its attention (the flash kernels recompute
    # the scores); element-wise backward not counted
    cfg = model.config
    attn_fwd = 4 * cfg.n_layer * T * cfg.n_embd * tokens
    assert prof.get_backward_flops() == 2 * (2 * prof.get_total_macs() - attn_fwd) + 5 * attn_fwd // 2
    prof.end_profile()


def test_same_totals_as_deepspeeds_profiler():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_profiler = pytest.importorskip("deepspeed.profiling.flops_profiler")
    model = _gpt()
    x = _tokens()
    ours = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    theirs = ds_profiler.get_model_profile(copy.deepcopy(model), args=[x], print_profile=False, as_string=False)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 0.05 * b, (ours, theirs)


def test_report_layout_depth_and_output_file(tmp_path):
    model = _gpt("tiny")
    out = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, args=[_tokens()], module_depth=3, top_modules=2, output_file=str(out))
    text = out.read_text()
    for line in ("-------------------------- DeepSpeed Flops Profiler --------------------------",
                 "Profile Summary at step 1:", "params per GPU:", "fwd MACs per GPU:", "fwd flops per GPU:",
                 "fwd latency:", "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
                 "Aggregated Profile per GPU", "Detailed Profile per GPU"):
        assert line in text, line
    aggregated = text.split("Aggregated Profile per GPU")[1].split("Detailed Profile per GPU")[0]
    assert "depth 0:" in aggregated and "depth 2:" in aggregated and "depth 3:" not in aggregated
    assert "'GPT'" in aggregated and "'Block'" in aggregated and "CausalSelfAttention" not in aggregated
    detailed = text.split("Detailed Profile per GPU")[1]
    for name in ("(blocks): ModuleList(", "(0): Block(", "(attn): CausalSelfAttention(", "(c_attn): Linear(",
                 "(lm_head): Linear("):
        assert name in detailed, name
    assert "% Params" in detailed and "% MACs" in detailed and "% latency" in detailed

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        get_model_profile(model, args=[_tokens()], detailed=False, module_depth=1)
    assert "Detailed Profile per GPU" not in buf.getvalue() and "depth 0:" in buf.getvalue()
    assert "depth 1:" not in buf.getvalue()


def test_ignore_modules_moves_counts_to_the_parent():
    model = _gpt("tiny")
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[torch.nn.Linear])
    model(_tokens())
    prof.stop_profile()
    assert prof.module_profile(model.lm_head).flops == 0
    assert prof.module_profile(model.blocks[0].mlp).macs > 0  # its Linears' counts land in the MLP
    full = get_model_profile(_gpt("tiny"), args=[_tokens()], print_profile=False, as_string=False)[0]
    assert prof.get_total_flops() == full
    prof.end_profile()


def test_peak_table():
    assert peak_flops("cpu") is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float16) == 312e12
    assert peak_flops_for_name("NVIDIA L40S") == 362e12 and peak_flops_for_name("NVIDIA L4") == 121e12
    assert peak_flops_for_name("Tesla V100-SXM2-32GB") is None  # no bf16 tensor cores
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert peak_flops_for_name("Some New Chip") is None


# ---- the engine ------------------------------------------------------------------------------------------
GAS = 2


def _engine_case(stage: int, output_file):
    import torch.distributed as dist

    import shardspeed

    rank = dist.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 3, "top_modules": 1,
                           "detailed": True, "output_file": output_file},
    }
    model = _gpt("tiny")
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    torch.manual_seed(10 + rank)
    buf = io.StringIO()
    before = None
    with contextlib.redirect_stdout(buf):
        for step in range(3):
            for _ in range(GAS):
                x = torch.randint(0, 256, (B, T))
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
            if step == 0:
                before = engine.flops_per_step()
    return dict(stdout=buf.getvalue(), flops_per_step=engine.flops_per_step(), before=before,
                measured=engine.flops_per_step(measured=True),
                peak=engine.peak_flops(), params=sum(p.numel() for p in _gpt("tiny").parameters()))


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_reports_at_profile_step_on_rank_0(stage, tmp_path):
    out_file = str(tmp_path / "flops.txt") if stage == 3 else None
    results = run_distributed(_engine_case, 2, stage, out_file)
    cfg = GPTConfig.preset("tiny")
    want = GAS * _analytic(cfg, B * T, T, training=True)
    for r in results:
        assert r["before"] is None  # nothing measured before profile_step
        assert abs(r["flops_per_step"] - want) / want < 0.01, (r["flops_per_step"], want)
        assert r["flops_per_step"] == 3 * GAS * _analytic_with_elementwise(cfg)
        hw = GAS * _analytic(cfg, B * T, T, training=True, score_recompute=True)
        assert abs(r["measured"] - hw) / hw < 0.02, (r["measured"], hw)
        assert r["peak"] is None  # CPU
    text = open(out_file).read() if out_file else results[0]["stdout"]
    assert results[1]["stdout"] == ""  # rank 1 prints nothing
    if out_file:
        assert "Flops Profiler" not in results[0]["stdout"]
    assert text.count("Profile Summary at step 2:") == 1  # DeepSpeed numbers it with the updated global step
    assert "world size:" in text and "data parallel size:" in text and "batch size per GPU:" in text
    assert "bwd latency:" in text and "iter latency:" in text and "bwd flops per GPU (measured):" in text
    # parameters at their true sizes, also at stage 3 where the module holds shard placeholders
    params_line = next(line for line in text.splitlines() if line.startswith("params per GPU:"))
    assert params_line.split(":", 1)[1].strip() == params_to_string(results[0]["params"])
    fwd_line = next(line for line in text.splitlines() if line.startswith("fwd flops per GPU:"))
    assert fwd_line.split(":", 1)[1].strip() == number_to_string(_analytic_with_elementwise(cfg))
    assert "'Block'" in text and "(attn): CausalSelfAttention(" in text


def _analytic_with_elementwise(cfg: GPTConfig) -> int:
    """One micro-batch's forward as both profilers count it: matmuls and attention plus DeepSpeed's
    element-wise estimates (LayerNorm 5 per element, GELU 1 per element)."""
    tokens = B * T
    ln = 5 * cfg.n_embd * tokens * (2 * cfg.n_layer + 1)
    gelu = 4 * cfg.n_embd * tokens * cfg.n_layer
    return _analytic(cfg, tokens, T, training=False) + ln + gelu
