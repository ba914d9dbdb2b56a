"""Worker for tests/test_deepspeed_configs_multirank.py, run by torchrun at world 2 with either the real
DeepSpeed or shardspeed's ``deepspeed`` package first on the path: configs DeepSpeed accepts (TRL's reference
model through its own ``prepare_deepspeed``, an hjson file, ``offload_param`` below stage 3), each giving logits
that rank 0 writes to ``OUT/logits.pt``. Then, with the real DeepSpeed, a model partitioned by its zero.Init given
to shardspeed.initialize; with shardspeed's package, transformers' from_pretrained under HfDeepSpeedConfig (our
zero.Init) compared with the checkpoint (``OUT/checks.json``)."""
import datetime
import json
import math
import os
import sys
import types

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from trl.models.utils import prepare_deepspeed
from worker_exit import end_distributed  # tests/, the folder of this script

import shardspeed
from shardspeed.compat import active

OUT = sys.argv[1]
HJSON = """{
  # DeepSpeed reads its config file with hjson: comments, unquoted keys and strings, optional commas
  train_micro_batch_size_per_gpu: 2
  gradient_accumulation_steps: 1,
  zero_optimization: {
    stage: 0
    offload_param: {
      device: cpu
    }
  },
}
"""


def tiny_gpt2(frozen: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    return model.requires_grad_(not frozen)


def accelerate_config(stage: int) -> dict:
    """What accelerate's DeepSpeedPlugin holds when TRL prepares the reference model (steps_per_print inf)."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": math.inf,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "none"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}


def logits(engine, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine(input_ids=ids).logits.detach().cpu()


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300),
                               auto_mpi_discovery=False)
    rank = torch.distributed.get_rank()
    ids = torch.arange(12).reshape(2, 6) * (rank + 3) % 64  # each rank its own batch
    results = {}
    for stage in (3, 2):
        for frozen in (True, False):
            plugin = types.SimpleNamespace(deepspeed_config=accelerate_config(stage))
            accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
            engine = prepare_deepspeed(tiny_gpt2(frozen), accelerator)
            name = f"trl_ref_z{stage}_{'frozen' if frozen else 'trainable'}"
            results[name] = logits(engine, ids)
            results[name + "_stage"] = torch.tensor(engine.zero_optimization_stage())  # TRL forces 0 below 3
    path = os.path.join(OUT, f"hjson_{rank}.json")
    with open(path, "w") as f:
        f.write(HJSON)
    engine, optimizer, _, _ = deepspeed.initialize(model=tiny_gpt2(True), config=path)
    engine.eval()
    results["hjson_z0_offload_param"] = logits(engine, ids)
    checks = {"optimizer": repr(optimizer)}
    checks.update(refuse_deepspeed_partitioned() if not active() else from_pretrained_under_zero3(rank))
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save({f"{k}_rank{r}": v for r, res in enumerate(gathered) for k, v in res.items()},
                   os.path.join(OUT, "logits.pt"))
        with open(os.path.join(OUT, "checks.json"), "w") as f:
            json.dump(checks, f)


def refuse_deepspeed_partitioned() -> dict:
    """A model partitioned by the real DeepSpeed's zero.Init, given to shardspeed: one line at initialize."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    try:
        shardspeed.initialize(model=model, config=config)
    except shardspeed.ShardspeedError as e:
        return {"refused": [type(e).__name__, str(e)]}
    return {"refused": None}


def from_pretrained_under_zero3(rank: int) -> dict:
    """transformers' from_pretrained under HfDeepSpeedConfig calls our zero.Init and GatheredParameters: the
    gathered weights equal the checkpoint's; ds_shape / ds_numel give the full sizes."""
    from safetensors.torch import save_file
    from transformers.integrations import HfDeepSpeedConfig

    folder = os.path.join(OUT, "hf")
    torch.manual_seed(1)
    saved = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    state = {k: v.contiguous() for k, v in saved.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    if rank == 0:
        saved.config.save_pretrained(folder)
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    torch.distributed.barrier()
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # noqa: F841
    model = GPT2LMHeadModel.from_pretrained(folder)
    sizes_ok = all(p.numel() == 0 and p.ds_numel == math.prod(p.ds_shape) > 0 for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    different = sorted(k for k, v in state.items() if not torch.equal(loaded[k], v))
    return {"from_pretrained": ["loaded", different, len(state)], "ds_sizes": sizes_ok}


if __name__ == "__main__":
    main()
    end_distributed()
