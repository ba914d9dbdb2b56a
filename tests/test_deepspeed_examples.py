"""DeepSpeedExamples, import changed and nothing else (issue 37).

Small equivalents of five DeepSpeedExamples scripts live in tests/deepspeed_examples/ (CIFAR, HelloDeepSpeed,
pipeline parallelism, DeepSpeed-Chat step 1 SFT, bf16_master_weight); each does a plain ``import deepspeed``
and uses DeepSpeed's API as the original does. All five run at world 2 in ONE launch each way (their
``run_examples.py`` runs them one after another in one process group; it appends ``--local_rank`` as
DeepSpeed's launcher does): once on the real DeepSpeed (``DS_ACCELERATOR=cpu``), once on shardspeed's
``deepspeed`` package. Rank 0's per-step losses must agree: fp32 to 1e-5, bf16 to one bf16 step (relative
2**-8). Cases: CIFAR fp32 and bf16 at ZeRO 0-3; HelloDeepSpeed bf16 + ZeRO 1 + CPU-offloaded optimizer, then
resumed from its checkpoint; the pipeline example data-parallel (``-p 0``) and with 2 stages; DS-Chat SFT
bf16 at ZeRO 0, 2, 3 (tiny OPT); bf16_master_weight's three ZeRO-3 configs (the one with an offloaded
optimizer refused by shardspeed).
"""
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_examples")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32_TOL = 1e-5
BF16_REL = 2.0 ** -8
_CPU_ADAM = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('CPUAdamBuilder').load()")


def _bf16_configs(folder):
    """bf16_master_weight's configs: ZeRO 3 + bf16; + bf16 master weights (DeepSpeed requires its CPU Adam,
    i.e. an offloaded optimizer, unless optimizer states are bf16 too: fp32 moments on the host); + bf16 optimizer
    states."""
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    wg = json.loads(json.dumps(base))
    wg["bf16"]["bf16_master_weights_and_grads"] = True
    wg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    wg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    full = json.loads(json.dumps(wg))
    full["bf16"]["bf16_optimizer_states"] = True
    del full["zero_optimization"]["offload_optimizer"]
    paths = []
    for name, cfg in (("baseline", base), ("bf16_master_wg", wg), ("bf16_full", full)):
        paths.append(os.path.join(folder, f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(cfg, f)
    return paths


def _plan(folder, who):
    pipe_cfg = os.path.join(folder, "pipe_ds_config.json")
    with open(pipe_cfg, "w") as f:  # the example's ds_config.json, at a tiny batch
        json.dump({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
                   "wall_clock_breakdown": False}, f)
    plan = [["cifar10_deepspeed.py", ["--dtype", "fp32", "bf16", "--stage", "0", "1", "2", "3"]],
            ["train_bert_ds.py", ["--checkpoint_dir", os.path.join(folder, f"bert-{who}")]],
            *[["dschat_sft.py", ["--model_name_or_path", os.path.join(folder, "tiny-opt"), "--dtype", "bf16",
                                 "--zero_stage", stage, "--output_dir", os.path.join(folder, f"sft-{who}")]]
              for stage in ("0", "2", "3")]]
    plan += [["bf16_master_weight.py", ["--deepspeed_config", p]] for p in _bf16_configs(folder)]
    # last: DeepSpeed's pipeline engine leaves process-wide state that engines built after it trip over
    plan += [["pipeline_train.py", ["--backend", "gloo", "-p", "0", "2", "--deepspeed_config", pipe_cfg]]]
    path = os.path.join(folder, f"plan-{who}.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def _launch(plan, ours, cwd):
    """DeepSpeed through torchrun + run_examples.py (which appends --local_rank like DeepSpeed's launcher);
    ours through ``shardspeed run --as-deepspeed`` (its workers get --local_rank, and ``import deepspeed`` finds
    shardspeed's package)."""
    runner = os.path.join(HERE, "run_examples.py")
    if ours:
        cmd = [sys.executable, "-m", "shardspeed.cli", "run", "--nproc", "2", "--as-deepspeed", runner, plan]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", runner, plan]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDSPEED_TIMEOUT="120")
    env["PYTHONPATH"] = REPO
    if not ours:
        env["DS_ACCELERATOR"] = "cpu"
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _parse(text):
    """{script: [("ok", result) | ("error", line) | ("missing", None), one per plan entry]} from the runner's
    marker lines: rank 0 announces entry i and prints its result; the first error line of any rank counts."""
    entries, current = {}, None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "EXAMPLE_BEGIN":
            current = int(rest.split(" ")[0])
            entries.setdefault(current, [rest.split(" ")[1], "missing", None])  # rank 1 may have failed first
        elif kind == "EXAMPLE_RESULT" and current is not None and entries[current][1] == "missing":
            entries[current][1:] = ["ok", json.loads(rest)]
        elif kind == "EXAMPLE_ERROR":
            i, script, message = rest.split(" ", 2)
            entry = entries.setdefault(int(i), [script, "missing", None])
            if entry[1] == "missing":
                entry[1:] = ["error", message]
    out = {}
    for i in sorted(entries):
        out.setdefault(entries[i][0], []).append(entries[i][1:])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepspeed_fused_adam):
    folder = str(tmp_path_factory.mktemp("ds_examples"))
    subprocess.run([sys.executable, os.path.join(HERE, "tiny_opt.py"), os.path.join(folder, "tiny-opt")],
                   check=True, capture_output=True, timeout=300)
    procs = {"ours": _launch(_plan(folder, "ours"), True, folder)}  # it needs no DeepSpeed op: start it now
    subprocess.run([sys.executable, "-c", _CPU_ADAM], check=True, capture_output=True, timeout=1800,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"))  # DeepSpeed's offload runs use its CPU Adam
    procs["deepspeed"] = _launch(_plan(folder, "deepspeed"), False, folder)
    texts = {}
    for who, proc in procs.items():
        try:
            texts[who] = proc.communicate(timeout=420)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
            texts[who] = proc.communicate()[0] + "\nTIMEOUT"
    return {who: _parse(text) for who, text in texts.items()}, texts


def _results(runs, script, entry=0):
    parsed, texts = runs
    for who, shardspeeds in (("ours", True), ("deepspeed", False)):  # each ran on the deepspeed it should
        versions = [line.split(" ", 1)[1] for line in texts[who].splitlines() if line.startswith("EXAMPLE_DEEPSPEED ")]
        assert versions and ("+shardspeed" in versions[0]) is shardspeeds, f"{who} imported deepspeed {versions}"
    ds, ours = parsed["deepspeed"].get(script, [])[entry:entry + 1], parsed["ours"].get(script, [])[entry:entry + 1]
    assert ds and ds[0][0] == "ok", f"DeepSpeed's run of {script} failed: {ds}\n{texts['deepspeed'][-3000:]}"
    assert ours and ours[0][0] == "ok", f"shardspeed's run of {script}: {ours[0][1] if ours else 'not reached'}"
    return ds[0][1], ours[0][1]


def _close(ds, ours, bf16, what):
    assert len(ds) == len(ours), f"{what}: {len(ds)} steps against {len(ours)}"
    for i, (a, b) in enumerate(zip(ds, ours)):
        tol = BF16_REL * abs(a) if bf16 else FP32_TOL
        assert abs(a - b) <= tol, f"{what} step {i}: DeepSpeed {a!r}, shardspeed {b!r} (|diff| {abs(a - b):.3g} > {tol:.3g})"


def test_cifar10_zero_0_to_3_fp32_and_bf16(runs):
    ds, ours = _results(runs, "cifar10_deepspeed.py")
    assert sorted(ds) == sorted(ours) == sorted(f"{d}/{s}" for d in ("fp32", "bf16") for s in range(4))
    for case, got in ds.items():
        _close(got["losses"], ours[case]["losses"], case.startswith("bf16"), f"cifar {case}")
        assert (got["correct"], got["total"]) == (ours[case]["correct"], ours[case]["total"])


def test_hello_deepspeed_bf16_offload_and_resume(runs):
    ds, ours = _results(runs, "train_bert_ds.py")
    _close(ds["losses"], ours["losses"], True, "HelloDeepSpeed")
    _close(ds["resumed"], ours["resumed"], True, "HelloDeepSpeed resumed")
    assert (ds["tags"], ds["latest"]) == (ours["tags"], ours["latest"])


def test_pipeline_example_data_parallel_and_two_stages(runs):
    ds, ours = _results(runs, "pipeline_train.py")
    assert sorted(ds) == sorted(ours) == ["0", "2"]
    _close(ds["0"], ours["0"], False, "pipeline -p 0 (RepeatingLoader)")
    _close(ds["2"], ours["2"], False, "pipeline -p 2 (train_batch)")


@pytest.mark.parametrize("entry,stage", [(0, "0"), (1, "2"), (2, "3")])
def test_deepspeed_chat_sft(runs, entry, stage):
    ds, ours = (r[stage] for r in _results(runs, "dschat_sft.py", entry))
    _close(ds["losses"], ours["losses"], True, f"DS-Chat ZeRO {stage}")
    _close(ds["eval"], ours["eval"], True, f"DS-Chat ZeRO {stage} eval")
    _close([ds["saved_sum"]], [ours["saved_sum"]], True, f"DS-Chat ZeRO {stage} saved weights")


def test_bf16_master_weight_baseline(runs):
    ds, ours = _results(runs, "bf16_master_weight.py", 0)
    _close(ds["baseline.json"], ours["baseline.json"], True, "bf16_master_weight baseline.json")


def test_bf16_master_weight_with_offloaded_optimizer(runs):
    """bf16_master_wg.json (torch_autocast + bf16 masters offloaded, fp32 moments: DeepSpeed's CPU Adam at ZeRO 3):
    DeepSpeed's losses."""
    ds, ours = _results(runs, "bf16_master_weight.py", 1)
    assert len(ds["bf16_master_wg.json"]) == 5, ds
    _close(ds["bf16_master_wg.json"], ours["bf16_master_wg.json"], True, "bf16_master_weight bf16_master_wg.json")


def test_bf16_master_weight_bf16_masters_and_states(runs):
    """bf16_full.json (torch_autocast + bf16 masters + bf16 optimizer states at ZeRO 3): DeepSpeed's losses."""
    ds, ours = _results(runs, "bf16_master_weight.py", 2)
    _close(ds["bf16_full.json"], ours["bf16_full.json"], True, "bf16_master_weight bf16_full.json")


