"""Small equivalents of the ``dschat.utils`` helpers DeepSpeed-Chat's step 1 uses (not copies):
``ds_utils.get_train_ds_config``, ``utils`` (``print_rank_0``, ``to_device``, ``set_random_seed``,
``get_all_reduce_mean``, ``get_optimizer_grouped_parameters``, ``load_hf_tokenizer``, ``save_hf_format``,
``save_zero_three_model`` with ``ZeroParamStatus`` / ``GatheredParameters``), ``model_utils.create_hf_model``
(``HfDeepSpeedConfig`` kept alive during ``from_pretrained`` at ZeRO 3), ``perf.print_throughput`` and
a fake ``create_prompt_dataset`` (phase 1: input ids, mask, labels with padding at -100)."""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import math
import os
import random

import deepspeed.comm as dist  # noqa: F401  (imported as ds_utils does)
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoConfig, AutoTokenizer, set_seed
from transformers.integrations.deepspeed import HfDeepSpeedConfig

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


def get_train_ds_config(offload, dtype, stage=2, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512, enable_tensorboard=False, tb_path="", tb_name=""):
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type, dtype_config = "fp16", {"enabled": True, "loss_scale_window": 100}
    else:
        data_type, dtype_config = "bfloat16", {"enabled": True}
    zero_opt_dict = {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                     "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                     "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                     "memory_efficient_linear": False}
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE, "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10, "zero_optimization": zero_opt_dict, data_type: dtype_config,
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": enable_hybrid_engine, "max_out_tokens": max_out_tokens,
                          "inference_tp_size": inference_tp_size, "release_inference_cache": release_inference_cache,
                          "pin_parameters": pin_parameters, "tp_gather_partition_size": tp_gather_partition_size},
        "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                        "job_name": f"{tb_name}_tensorboard"},
    }


def is_rank_0():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)
    elif is_rank_0():
        print(msg)


def to_device(batch, device):
    out = {}
    for k, v in batch.items():
        try:
            out[k] = v.to(device)
        except AttributeError:
            out[k] = v
    return out


def set_random_seed(seed):
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay=("bias", "layer_norm.weight", "layernorm.weight", "norm.weight",
                                               "ln_f.weight"), lora_names=("lora_right_weight", "lora_left_weight")):
    def has(name, names):
        return any(x in name.lower() for x in names)

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in params if not has(n, no_decay) and not has(n, lora_names)],
               "weight_decay": weight_decay},
              {"params": [p for n, p in params if not has(n, no_decay) and has(n, lora_names)],
               "weight_decay": weight_decay, "lr": lora_lr},
              {"params": [p for n, p in params if has(n, no_decay)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def load_hf_tokenizer(model_name_or_path, fast_tokenizer=True, add_special_tokens=None):
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, fast_tokenizer=fast_tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if add_special_tokens is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": [add_special_tokens]})
    return tokenizer


def create_hf_model(model_class, model_name_or_path, tokenizer, ds_config=None, dropout=None):
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    # kept in this scope, as dschat does: transformers then builds the model under deepspeed.zero.Init
    dschf = HfDeepSpeedConfig(ds_config) if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3 \
        else None  # noqa: F841
    model = model_class.from_pretrained(model_name_or_path, config=model_config)
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    return model


def create_prompt_dataset(tokenizer, max_seq_len, n, seed):
    """Phase-1 rows from fake 'prompt + chosen answer' texts: padded ids, mask, labels (-100 at padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        words = torch.randint(0, 61, (int(torch.randint(4, max_seq_len - 1, (1,), generator=g)),), generator=g)
        text = " ".join(f"w{int(w)}" for w in words) + tokenizer.eos_token
        tok = tokenizer(text, max_length=max_seq_len, padding="max_length", truncation=True, return_tensors="pt")
        ids, mask = tok["input_ids"].squeeze(0), tok["attention_mask"].squeeze(0)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return rows


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_hf_format(model, tokenizer, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    torch.save(model_to_save.state_dict(), os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    os.makedirs(save_dir, exist_ok=True)
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    out = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage == 3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0:
            out[k] = v_p
    if global_rank == 0:
        torch.save(out, os.path.join(save_dir, "pytorch_model.bin"))


def print_throughput(hf_model, args, e2e_time, rank=0):
    if rank <= 0:
        hf_model._num_params = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel()
                                   for p in hf_model.parameters())
        print(f"Model Parameters: {hf_model._num_params / 1e9:.6f} B, Latency: {e2e_time:.2f}s, "
              f"Batch Size: {args.per_device_train_batch_size}, Sequence Length: {args.max_seq_len}")
