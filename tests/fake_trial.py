"""A stand-in trial for the search tests (stdlib only, starts in ~0.1 s): ``fake_trial.py SCRIPT ARGS``.

As the bandwidth probe (``-m shardspeed.autotune.bandwidth OUT``) it writes fixed link figures. As a trial
it reads the config after ``--deepspeed_config`` and writes the metrics a real trial would, from a known
"truth": step time = gas·(0.02 + 0.01·mbs) + 0.004·stage (+0.003 with optimizer offload); peak memory per
rank at 2 ranks, fp32 = the cost model's own structure (ZeRO model states, the bucket or gathered units,
the optimizer step's temporaries) + 0.5 GB + 0.1 GB per sample (0.03 GB and 4/3 of the per-sample time with
activation checkpointing), so the structural model can fit it exactly. ``--hang-stage S`` hangs at stage S after starting a child in a
session of its own (as torchrun's workers are), which the tuner must kill too. ``--no-blocks`` fails every checkpointed trial as
the engine does for a model with no block to checkpoint; ``--no-tp`` every tensor-parallel one, as for a model
with no TP plan.
"""
import json
import subprocess
import sys
import time

NUM_PARAMS = 50_000_000
LARGEST = NUM_PARAMS // 4
DP = 2


def truth(cfg):
    z = cfg.get("zero_optimization", {})
    stage, mbs, gas = z.get("stage", 0), cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    ckpt = (cfg.get("activation_checkpointing") or {}).get("enabled", False)
    t = gas * (0.02 + 0.01 * mbs * (4 / 3 if ckpt else 1)) + 0.004 * stage + (0.003 if "offload_optimizer" in z else 0.0)
    n = NUM_PARAMS
    states = 4 * n / (DP if stage == 3 else 1) + 4 * n / (DP if stage >= 2 else 1) + 8 * n / (DP if stage >= 1 else 1)
    working = 3 * LARGEST * 4 if stage == 3 else min(z.get("reduce_bucket_size", 500_000_000), n) * 4
    working += 4 * n / (DP if stage >= 1 else 1)
    return t, 0.5e9 + states + working + 0.1e9 * mbs * (0.3 if ckpt else 1.0)


def main(argv):
    if argv[:2] == ["-m", "shardspeed.autotune.bandwidth"]:
        with open(argv[2], "w") as f:
            json.dump({"latency_s": 1e-4, "bus_bandwidth": 1e9, "adam_s_per_elem": 1e-9, "host_adam_s_per_elem": 1e-9,
                       "copy_bandwidth": 1e10}, f)
        return 0
    args = argv[1:]
    with open(args[args.index("--deepspeed_config") + 1]) as f:
        cfg = json.load(f)
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if "--hang-stage" in args and stage == int(args[args.index("--hang-stage") + 1]):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    if "--no-blocks" in args and (cfg.get("activation_checkpointing") or {}).get("enabled"):
        print("shardspeed.errors.ConfigError: no transformer block found to checkpoint; pass block_types",
              file=sys.stderr)
        return 1
    if "--no-tp" in args and (cfg.get("tensor_parallel") or {}).get("autotp_size", 1) > 1:
        print("shardspeed.errors.ConfigError: no tensor-parallel plan matches this model; set "
              "tensor_parallel.partition_config", file=sys.stderr)
        return 1
    t, mem = truth(cfg)
    at = cfg["autotuning"]
    with open(at["metric_path"], "w") as f:
        json.dump({"step_time_s": t, "latency": t * 1e3, "throughput": cfg["train_batch_size"] / t,
                   "peak_memory": mem, "peak_rss": mem, "num_params": NUM_PARAMS, "largest_unit": LARGEST,
                   "num_units": 4}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
