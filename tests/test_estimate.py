"""The memory estimator (shardspeed.estimate): pure arithmetic checked by hand, against the ZeRO paper and
DeepSpeed's estimators, the activation formulas against Korthikanti et al., the fake-tensor trace against the
formulas, the CLI, and one measured run (peak RSS of a real 2-rank training step within 10% of the prediction).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardspeed.cli import main
from shardspeed.errors import ConfigError
from shardspeed.estimate import (
    ActivationProfile,
    ModelSpec,
    TransformerShape,
    describe_gpt,
    estimate_peak,
    formula_activations,
    layer_saved_bytes,
    paper_table,
)
from shardspeed.models import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ACT = ActivationProfile(0.0, 0.0, 1, 1, False)
FITTED = ActivationProfile(0.0, 0.0, 1, 1, False, "fitted")  # usable at any TP/PP degree


def _spec(psi: float, units=(1,)) -> ModelSpec:
    return ModelSpec("flat", (int(psi),), tuple(int(u) for u in units), activations=NO_ACT)


def _states(est) -> float:
    return sum(est.model_states.values())


def _cfg(stage: int, dtype: str = "bf16", **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, **zero}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


# ---- model states: the ZeRO paper and DeepSpeed --------------------------------------------------------

def test_zero_paper_table_from_the_peak_estimator():
    """Ψ = 7.5B, N = 64, mixed-precision Adam: 120, 31.4, 16.6, 1.9 GB (the optimizer step holds exactly the
    model states when there are no activations)."""
    psi = 7.5e9
    got = [_states(estimate_peak(_spec(psi, [psi / 100] * 100), _cfg(s), world_size=64)) / 1e9 for s in range(4)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    assert [v / 1e9 for v in paper_table().values()] == pytest.approx(got)


def test_fp32_master_is_the_parameter_unless_offloaded():
    psi, n = 1e9, 8
    est = estimate_peak(_spec(psi), _cfg(2, "fp32"), world_size=n)
    assert est.terms["master"] == 0 and est.terms["optimizer"] == 8 * psi / n
    off = estimate_peak(_spec(psi), _cfg(2, "fp32", offload_optimizer={"device": "cpu"}), world_size=n)
    assert off.terms["master_host"] == 4 * psi / n and off.terms["optimizer_host"] == 8 * psi / n
    nv = estimate_peak(_spec(psi), _cfg(3, offload_optimizer={"device": "nvme", "nvme_path": "/x"},
                                        offload_param={"device": "nvme", "nvme_path": "/x"}), world_size=n)
    assert nv.nvme == pytest.approx(14 * psi / n) and "params" not in nv.terms


def test_matches_deepspeed_estimators_where_they_agree_with_the_paper():
    """DeepSpeed's ZeRO-2 GPU figure is 2Ψ + 18Ψ/N: the paper's 2Ψ + 14Ψ/N plus an fp32 gradient copy 4Ψ/N
    (shardspeed converts gradients to fp32 one unit at a time). With optimizer offload both keep 2Ψ of 16-bit
    parameters on the device. ZeRO-3: 4·L + 18Ψ/N against the paper's 16Ψ/N (the same fp32 gradient copy, and
    two bytes per element of the largest layer gathered, twice)."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds2

    psi, n, layer = 7_500_000_000, 64, 100_000_000
    spec = _spec(psi, [layer] * 75)
    _, ds_gpu = ds2(psi, n, 1, cpu_offload=False)
    ours = _states(estimate_peak(spec, _cfg(2), world_size=n))
    assert ds_gpu == pytest.approx(ours + 4 * psi / n, rel=1e-9)
    _, ds_gpu_off = ds2(psi, n, 1, cpu_offload=True)
    off = estimate_peak(spec, _cfg(2, offload_optimizer={"device": "cpu"}), world_size=n)
    assert off.terms["params"] == ds_gpu_off == 2 * psi
    _, ds3_gpu, largest = ds3(psi, layer, n, 1, cpu_offload=False, cpu_offload_params=False)
    ours3 = _states(estimate_peak(spec, _cfg(3), world_size=n))
    assert ds3_gpu - largest == pytest.approx(ours3 + 2 * psi / n, rel=1e-9)


# ---- the other terms, by hand --------------------------------------------------------------------------

def test_buckets_gathered_units_and_startup_by_hand():
    units = (1000, 1000, 1000, 1000, 500)  # four blocks and the root's unit (last)
    spec = ModelSpec("m", (4500,), units, activations=ActivationProfile(0.0, 0.0, 1, 1, False))
    cfg = _cfg(3, "fp32", stage3_prefetch_bucket_size=1000, stage3_param_persistence_threshold=0)
    est = estimate_peak(spec, cfg, world_size=2)
    # root + the unit in use + one unit prefetched (the bucket) = 2500 elements, fp32
    assert est.terms["gathered"] == 2500 * 4
    # stage 3 keeps one full-size bucket alive (a unit's reduction ends before the next one fills)
    assert est.terms["grad_buckets"] == 1 * 1000 * 4
    # stage 2 with unit-sized buckets, no activations to free: the bucket being filled and two in flight
    per_param = ModelSpec("m", units, units, activations=ActivationProfile(0.0, 0.0, 1, 1, False))
    s2u = estimate_peak(per_param, _cfg(2, "fp32", reduce_bucket_size=1000), world_size=2)
    assert s2u.terms["grad_buckets"] == 3 * 1000 * 4
    assert est.startup_device == (4500 + 1000) * 4  # the whole model built, plus one unit being cut
    z = estimate_peak(spec, cfg, world_size=2, zero_init=True)
    assert z.startup_device == (4500 / 2 + 4500) * 4  # one shard plus the largest parameter assembled
    # stage 2 with the default 5e8-element buckets: one full-size bucket
    s2 = estimate_peak(spec, _cfg(2, "fp32"), world_size=2)
    assert s2.terms["grad_buckets"] == 4500 * 4 and "grads" not in s2.terms  # accumulator made after backward


def test_bad_sizes_raise_config_errors():
    with pytest.raises(ConfigError, match="tp"):
        estimate_peak(_spec(1e6), _cfg(1), world_size=6, tp=4)
    # offload_param below stage 3 is ignored, as DeepSpeed ignores it
    assert estimate_peak(_spec(1e6), _cfg(1, offload_param={"device": "cpu"}), world_size=2) == \
        estimate_peak(_spec(1e6), _cfg(1), world_size=2)
    with pytest.raises(ConfigError, match="activations"):
        estimate_peak(ModelSpec("m", (10,), (10,)), _cfg(1), world_size=1)


# ---- the plan decides ----------------------------------------------------------------------------------

def test_estimate_prices_the_plan_that_decide_makes():
    from shardspeed.plan import decide

    spec = _spec(1e6, [1e5] * 10).with_activations(FITTED)
    cfg = _cfg(3, offload_optimizer={"device": "cpu"}, stage3_prefetch_bucket_size=2e5)
    assert estimate_peak(spec, plan=decide(cfg, 4)) == estimate_peak(spec, cfg, world_size=4)
    with pytest.raises(ConfigError, match="plan's mesh"):
        estimate_peak(spec, cfg, world_size=8, plan=decide(cfg, 4))
    # tp/pp are model facts: the plan's mesh sizes the data dimension (8 = 2 pipeline x 2 TP x 2 data)
    split = estimate_peak(spec, _cfg(1), world_size=8, tp=2, pp=2)
    assert split.model_states["params"] == 1e6 / 4 * 2 and split.model_states["optimizer"] == 1e6 / 4 / 2 * 8
    # the config's tensor_parallel.autotp_size when tp is not given
    tp_cfg = {**_cfg(1), "tensor_parallel": {"autotp_size": 2}}
    assert estimate_peak(spec, tp_cfg, world_size=8) == estimate_peak(spec, _cfg(1), world_size=8, tp=2)


def test_pipelined_gradients_are_reduced_at_the_boundary():
    """In a pipeline the plan reduces stage 2 gradients once per step (reduce_every_micro_step false): the
    full-size buckets are held, as at stages 0-1, instead of a 1/N accumulator and transient buckets."""
    spec = _spec(1e6, [1e5] * 10).with_activations(FITTED)
    flat = estimate_peak(spec, _cfg(2), world_size=4)
    piped = estimate_peak(spec, _cfg(2), world_size=4, pp=2)
    assert "grad_buckets" in flat.terms and flat.model_states["grads"] == 1e6 / 4 * 2
    assert "grad_buckets" not in piped.terms and piped.model_states["grads"] == 1e6 / 2 * 2


def test_contradictions_are_decides():
    spec = _spec(1e6)
    with pytest.raises(ConfigError, match="zero.Init"):
        estimate_peak(spec, _cfg(2), world_size=2, zero_init=True)
    with pytest.raises(ConfigError, match="pipeline.stages 4 disagrees"):
        estimate_peak(spec, {**_cfg(1), "pipeline": {"stages": 4}}, world_size=4, pp=2)
    with pytest.raises(ConfigError, match="autotp_size 4 disagrees"):
        estimate_peak(spec, {**_cfg(1), "tensor_parallel": {"autotp_size": 4}}, world_size=4, tp=2)
    with pytest.raises(ConfigError, match="offload_optimizer needs stage 1"):
        estimate_peak(spec, _cfg(0, offload_optimizer={"device": "cpu"}), world_size=2)


def test_table_rows_are_the_pairs_decide_accepts():
    from shardspeed.estimate.table import peak_rows

    spec = _spec(1e6, [1e5] * 10)
    rows = peak_rows(spec, _cfg(1), world_size=2, zero_init=True)
    assert {r.stage for r in rows} == {3} and len(rows) == 5  # zero.Init needs stage 3
    with pytest.raises(ConfigError, match="offload_param needs stage 3"):
        peak_rows(spec, _cfg(1), world_size=2, stages=[1], offloads=[("cpu", "cpu")])


def test_one_home_no_import_cycle():
    """shardspeed.estimate's modules import one another in one direction; shardspeed.memory_estimate re-exports
    the same objects."""
    import ast
    import pathlib

    import shardspeed.estimate as est
    import shardspeed.memory_estimate as me

    pkg = pathlib.Path(est.__file__).parent
    graph = {}
    for f in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[f.stem] = deps - {None}
    graph.pop("__init__")

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph.get(a, ()))

    assert not [m for m in graph if reaches(m, m)]
    for name in ("estimate_model_state_memory", "ModelStateMemory", "estimate_peak", "describe", "ModelSpec"):
        assert getattr(me, name) is getattr(est, name)


SECTIONS = {"zero_optimization", "offload_optimizer", "offload_param", "tensor_parallel", "pipeline",
            "activation_checkpointing"}
#: attribute owners that are not configs: a Plan, a Candidate or TuningSpace, argparse's args, a row or a
#: measurement, an object's own field (the config's own classes are in shardspeed/config)
NOT_CONFIG = {"plan", "p", "c", "cand", "candidate", "space", "args", "self", "r"}


def config_section_reads(root: str = "shardspeed") -> dict:
    """Modules under ``root`` (outside config/ and plan/) that read the config sections in code, docstrings
    and comments aside: ``{"reads": {path: lines}, "writes": {path: lines}}``. A read is an attribute load of a
    section name on an object not in NOT_CONFIG, or ``x["section"]`` / ``x.get("section")``; a write is
    ``x["section"] = ...``, ``pop`` or ``setdefault`` (the autotuner and the estimate table write configs)."""
    import ast
    import pathlib

    def owner(node) -> str:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""

    def chain(node) -> set:
        names = set()
        while isinstance(node, ast.Attribute):
            names.add(node.attr)
            node = node.value
        return names

    out: dict = {"reads": {}, "writes": {}}
    base = pathlib.Path(root)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base.parent).as_posix()
        if rel.startswith(("shardspeed/config/", "shardspeed/plan/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            kind = None
            if isinstance(node, ast.Attribute) and node.attr in SECTIONS and isinstance(node.ctx, ast.Load):
                if owner(node.value) not in NOT_CONFIG and not chain(node.value) & {"plan", "candidate"}:
                    kind = "reads"
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in SECTIONS:
                kind = "reads" if isinstance(node.ctx, ast.Load) else "writes"
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                  and isinstance(node.args[0], ast.Constant) and node.args[0].value in SECTIONS):
                kind = {"get": "reads", "pop": "writes", "setdefault": "writes"}.get(node.func.attr)
            if kind:
                out[kind].setdefault(rel, []).append(node.lineno)
    return out


def test_the_estimator_and_the_cost_model_read_no_config_section():
    """Stage, offload, TP, PP and checkpointing are the plan's: shardspeed/estimate and the autotuner's cost
    model read none of those sections (the estimate table and the ZeRO-paper helper write configs)."""
    found = config_section_reads(os.path.join(ROOT, "shardspeed"))
    mine = [p for p in found["reads"] if p.startswith("shardspeed/estimate/")
            or p in ("shardspeed/memory_estimate.py", "shardspeed/autotune/model.py", "shardspeed/autotune/memory.py")]
    assert [p for p in mine if p not in found["writes"]] == []


# ---- activations ---------------------------------------------------------------------------------------

def test_korthikanti_formulas():
    s, b, h, a = 2048, 1, 4096, 32
    shape = TransformerShape(n_layer=1, hidden=h, n_head=a, vocab=1, ffn_hidden=4 * h, max_seq=s, dropout=True,
                             fused_attention=False)
    sbh = s * b * h
    assert layer_saved_bytes(shape, b, s, 2) == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 4, 8):
        assert layer_saved_bytes(shape, b, s, 2, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        sp = layer_saved_bytes(shape, b, s, 2, tp=t, sequence_parallel=True)
        assert sp == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    fused = TransformerShape(1, h, a, 1, 4 * h, s, dropout=False, fused_attention=True)
    assert layer_saved_bytes(fused, b, s, 4) == pytest.approx(sbh * 64 + 4 * a * s * b)  # fp32, no masks
    full = formula_activations(shape, b, s, 2, checkpointing=False)
    ck = formula_activations(shape, b, s, 2, checkpointing=True)
    assert ck.forward_bytes < full.forward_bytes / 5


def test_trace_is_linear_in_micro_batch_and_checkpointing_saves():
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=3, n_head=4, n_embd=64, dropout=0.1)
    one = describe_gpt(cfg, {"train_micro_batch_size_per_gpu": 1}, micro_batch=1, seq_len=64).activations
    four = describe_gpt(cfg, {"train_micro_batch_size_per_gpu": 4}, micro_batch=4, seq_len=64).activations
    ck = describe_gpt(cfg, {"train_micro_batch_size_per_gpu": 4}, micro_batch=4, seq_len=64,
                      checkpointing=True).activations
    assert one is not None and four is not None and ck is not None
    assert 3.7 * one.forward_bytes < four.forward_bytes <= 4 * one.forward_bytes  # (positions are shared)
    assert ck.forward_bytes < four.forward_bytes / 4 and ck.peak_bytes < four.peak_bytes / 2
    # the trace and the formula agree on the order of magnitude (the trace sees the real kernels' copies)
    shape = TransformerShape(3, 64, 4, 64, 256, 64, dropout=True, fused_attention=True)
    f = formula_activations(shape, 4, 64, 4)
    assert 0.5 < four.forward_bytes / f.forward_bytes < 2.5


def _saved_by_autograd(cfg: GPTConfig, micro_batch: int, autocast: bool) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one real forward (the activations alive
    when it ends), under ``torch.autocast`` bf16 or not."""
    import torch

    from shardspeed.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(x, x)
    return sum(seen.values())


def test_torch_autocast_trace_counts_what_autograd_saves():
    """torch_autocast: the trace runs the forward under autocast, so it counts the bf16 copies of the Linear
    weights and the bf16 casts of their inputs that autograd keeps for backward: the traced forward bytes are
    those a real autocast forward saves (to the loss scalar), and differ from the fp32 trace's."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=128)
    base = {"train_micro_batch_size_per_gpu": 2}
    traced = {}
    for autocast in (False, True):
        conf = dict(base, torch_autocast={"enabled": True, "dtype": "bf16"}) if autocast else base
        prof = describe_gpt(cfg, conf, micro_batch=2, seq_len=64).activations
        assert prof is not None
        assert prof.forward_bytes == pytest.approx(_saved_by_autograd(cfg, 2, autocast), abs=8)
        traced[autocast] = prof.forward_bytes
    linear_weights = 3 * 12 * 128 * 128 + 256 * 128  # the blocks' four Linears and the tied head, 2 bytes each
    assert traced[True] != traced[False] and traced[True] > 2 * linear_weights


def test_stage3_units_are_the_blocks_and_the_root():
    spec = describe_gpt(GPTConfig.preset("small"), None, trace=False)
    block = 12 * 256 * 256 + 13 * 256  # 4 linears (weights and biases) and two layer norms
    assert spec.stage3_units[:4] == (block,) * 4
    assert sum(spec.stage3_units) == spec.num_params


# ---- the command ---------------------------------------------------------------------------------------

def test_estimate_command_peak_table(capsys, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}))
    assert main(["estimate", "--preset", "tiny", "--config", str(cfg), "--world", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in out["rows"]}
    assert len(rows) == 12 and out["micro_batch"] == 2
    assert rows[(3, "none", "none")]["device"] < rows[(0, "none", "none")]["device"]
    assert rows[(3, "nvme", "nvme")]["nvme"] > 0
    assert main(["estimate", "--model", "tiny", "--micro-batch", "2", "--checkpointing", "--stage", "2"]) == 0
    text = capsys.readouterr().out
    assert "checkpointing" in text and text.count("\n2 ") == 3


def tiny_gpt():
    from shardspeed.models import GPT

    return GPT(GPTConfig.preset("tiny"))


def test_factory_model_is_described_on_meta_and_traced(capsys):
    assert main(["estimate", "--model", "test_estimate:tiny_gpt", "--micro-batch", "2", "--stage", "3",
                 "--world", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 220_544 and len(out["rows"]) == 5
    assert all(r["activations_source"] == "traced" and r["terms"]["activations"] > 0 for r in out["rows"])


def test_estimate_command_errors_exit_2(capsys):
    assert main(["estimate", "--model", "no_such_module:build", "--micro-batch", "1"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", "/nonexistent/config.json"]) == 2
    assert "error" in capsys.readouterr().err


# ---- one measured run ----------------------------------------------------------------------------------

def test_prediction_within_10_percent_of_measured_rss():
    """Stage 3, micro-batch 2, sequence 128, world 2: benchmarks/bench_estimate.py's measurement for one config
    (fresh processes, MALLOC_MMAP_THRESHOLD_=65536, VmHWM over the RSS before the build, max over ranks)."""
    code = ("import json; from benchmarks.bench_estimate import measure, predict; "
            "rows = measure([{'stage': 3, 'offload': False, 'ckpt': False, 'mb': 2}], 128, 2, 2, timeout=240); "
            "predict(rows, 128, 2); print(json.dumps([r['measured_bytes'] for r in rows] + "
            "[r['predicted_bytes'] for r in rows]))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured, predicted = json.loads(out.stdout.strip().splitlines()[-1])
    assert predicted == pytest.approx(measured, rel=0.10), (measured / 2**20, predicted / 2**20)
