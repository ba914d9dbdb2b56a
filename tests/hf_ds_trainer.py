"""transformers' Trainer with ``TrainingArguments(deepspeed=config)``, run unchanged by
tests/test_hf_via_deepspeed_package.py under real DeepSpeed and under shardspeed's ``deepspeed`` package
(which one is whichever ``import deepspeed`` finds: the test sets PYTHONPATH).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_ds_trainer.py OUT_DIR

One process group runs every case; rank 0 writes ``OUT_DIR/result.json``: per run the loss of every
micro-batch (a forward hook on the model), plus the save_model round trip at ZeRO 3.

On a machine without an accelerator, accelerate's state would see one process (its backend is None):
the script gives accelerate the gloo backend itself through a configured ``PartialState`` (what
``TrainingArguments(accelerator_config={"use_configured_state": True})`` is for). On GPUs none of that
is needed.
"""
from __future__ import annotations

import json
import os
import sys

import torch

torch.set_num_threads(1)
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

from accelerate import PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402
from worker_exit import end_distributed  # noqa: E402  (tests/, the folder of this script)

STEPS, MICRO, GAS = 4, 2, 2


def ds_config(stage: int, offload: bool = False) -> dict:
    """A config as users write it for the Trainer: "auto" wherever the Trainer knows the value."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    else:
        zero.update(allgather_partitions=True, allgather_bucket_size=2e8, reduce_scatter=True)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "steps_per_print": 1000, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "wall_clock_breakdown": False}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, length: int = 12):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 96, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(out: str, config: dict, **kw) -> TrainingArguments:
    AcceleratorState._reset_state(reset_partial_state=False)  # one process group, several Trainers
    base = dict(output_dir=out, deepspeed=config, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
                max_steps=STEPS, learning_rate=3e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0,
                logging_steps=1, save_strategy="no", report_to=[], seed=11, disable_tqdm=True,
                accelerator_config={"use_configured_state": True})
    base.update(kw)
    return TrainingArguments(**base)


def model():
    """Built after TrainingArguments, as users do: at ZeRO 3 transformers builds it under deepspeed.zero.Init."""
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def train(a: TrainingArguments, resume: str | None = None, record: dict | None = None):
    m = model()
    if record is not None:  # at ZeRO 3 each rank holds only its shards once the model is built
        record["built_numel"] = sum(p.data.numel() for p in m.parameters())
        record["initial"] = full_weights(m)
    losses: list = []
    m.register_forward_hook(lambda mod, inp, out: losses.append(float(out.loss)))
    trainer = Trainer(model=m, args=a, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses


def full_weights(m) -> dict:
    import deepspeed

    params = dict(m.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def main(out: str) -> None:
    PartialState(backend="gloo")
    import deepspeed

    os.makedirs(out, exist_ok=True)
    result: dict = {"deepspeed": deepspeed.__version__}
    path = os.path.join(out, f"ds_z2_rank{os.environ['RANK']}.json")  # ZeRO 2 from a file, ZeRO 3 from dicts
    with open(path, "w") as f:
        json.dump(ds_config(2), f)
    result["z2"] = train(args(os.path.join(out, "z2"), path, save_strategy="steps", save_steps=STEPS))[1]
    result["z3off"] = train(args(os.path.join(out, "z3off"), ds_config(3, offload=True)))[1]

    # ZeRO 3: an uninterrupted run that saves at step 2, then a fresh Trainer resuming from that checkpoint
    run, record = os.path.join(out, "z3"), {}
    trainer, result["z3"] = train(args(run, ds_config(3), save_strategy="steps", save_steps=2), record=record)
    result["built_numel"] = record["built_numel"]
    trained = full_weights(trainer.model)
    result["moved"] = max(float((trained[n] - w).abs().max()) for n, w in record["initial"].items())
    trainer.save_model(os.path.join(out, "z3_final"))
    trainer.accelerator.wait_for_everyone()
    _, result["z3_resumed"] = train(args(os.path.join(out, "z3r"), ds_config(3)),
                                    resume=os.path.join(run, "checkpoint-2"))
    result["ckpt_files"] = sorted(os.listdir(os.path.join(run, "checkpoint-2")))
    if int(os.environ["RANK"]) == 0:
        torch.save(trained, os.path.join(out, "z3_trained.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
