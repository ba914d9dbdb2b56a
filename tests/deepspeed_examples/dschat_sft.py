"""A small equivalent of DeepSpeed-Chat's training/step1_supervised_finetuning/main.py (not a copy).

It calls DeepSpeed the way step 1 does: ``deepspeed.add_config_arguments``; with ``--local_rank`` (which
DeepSpeed's launcher passes) ``get_accelerator().set_device`` and ``deepspeed.init_distributed()``, else
no process group at all; ``get_accelerator().device_name()`` for the device; the config from
``get_train_ds_config`` (``bfloat16``, ``offload_param``/``offload_optimizer`` device none, stage-3 keys at
every stage, ``hybrid_engine`` and ``tensorboard`` blocks off); ``HfDeepSpeedConfig`` at ZeRO 3 while
``from_pretrained`` runs; a client ``FusedAdam`` (``DeepSpeedCPUAdam`` with ``--offload``) over grouped
parameters; a transformers scheduler; ``deepspeed.initialize(model=..., optimizer=..., args=...,
config=..., lr_scheduler=..., dist_init_required=True)``; evaluation with ``engine.eval()`` and an
all-reduced mean; ``engine(**batch, use_cache=False).loss``, ``engine.backward`` / ``engine.step``,
``print_throughput(engine.model, ...)`` (the wrapped module's attribute through the engine),
``engine.tput_timer.update_epoch_count()``, then ``save_hf_format`` and, at ZeRO 3,
``save_zero_three_model`` (``ZeroParamStatus``, ``GatheredParameters``).

Differences, all for a test: fake phase-1 data instead of the Dahoas datasets, a tiny local OPT
(``tiny_opt.py``), no LoRA, ``--zero_stage`` takes several values (one engine each, in one process
group), and rank 0 prints its per-step losses as one JSON line (``EXAMPLE_RESULT {...}``).
"""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import argparse
import json
import math
import os

import torch
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, SchedulerType, default_data_collator, get_scheduler

from dschat_utils import (create_hf_model, create_prompt_dataset, get_all_reduce_mean,
                          get_optimizer_grouped_parameters, get_train_ds_config, load_hf_tokenizer,
                          print_rank_0, print_throughput, save_hf_format, save_zero_three_model,
                          set_random_seed, to_device)


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--max_seq_len", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--zero_stage", type=int, nargs="+", default=[0])
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_learning_rate", type=float, default=5e-4)
    parser.add_argument("--train_samples", type=int, default=20)
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def evaluation(model, eval_dataloader, device):
    model.eval()
    losses, steps = 0, 0
    for batch in eval_dataloader:
        batch = to_device(batch, device)
        with torch.no_grad():
            outputs = model(**batch)
        losses += outputs.loss.float()
        steps += 1
    losses = get_all_reduce_mean(losses / steps)
    return torch.exp(losses).item(), losses.item()


def main(args, zero_stage):
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    args.zero_stage_now = zero_stage

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    set_random_seed(args.seed)
    torch.distributed.barrier()

    tokenizer = load_hf_tokenizer(args.model_name_or_path, fast_tokenizer=True)
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config,
                            dropout=args.dropout)
    train_dataset = create_prompt_dataset(tokenizer, args.max_seq_len, args.train_samples, args.seed)
    eval_dataset = create_prompt_dataset(tokenizer, args.max_seq_len, 8, args.seed + 1)
    if args.local_rank == -1:
        train_sampler, eval_sampler = RandomSampler(train_dataset), SequentialSampler(eval_dataset)
    else:
        train_sampler, eval_sampler = DistributedSampler(train_dataset), DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=eval_sampler,
                                 batch_size=args.per_device_eval_batch_size)

    groups = get_optimizer_grouped_parameters(model, args.weight_decay, args.lora_learning_rate)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    print_rank_0("***** Running training *****", args.global_rank)
    result = {"eval": [evaluation(model, eval_dataloader, device)[1]], "losses": []}
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = {loss}")
            model.backward(loss)
            model.step()
            result["losses"].append(loss.item())
            if torch.distributed.get_rank() == 0:
                print_throughput(model.model, args, 1.0, args.global_rank)
        result["eval"].append(evaluation(model, eval_dataloader, device)[1])
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        out = os.path.join(args.output_dir, f"zero{zero_stage}")
        if args.global_rank == 0:
            save_hf_format(model, tokenizer, argparse.Namespace(output_dir=out))
        if zero_stage == 3:
            save_zero_three_model(model, args.global_rank, out, zero_stage=zero_stage)
        if args.global_rank == 0:
            saved = torch.load(os.path.join(out, "pytorch_model.bin"))
            result["saved_sum"] = float(sum(v.float().sum() for v in saved.values()))
    return result


if __name__ == "__main__":
    args = parse_args()
    results = {str(stage): main(args, stage) for stage in args.zero_stage}
    if torch.distributed.get_rank() == 0:
        print("EXAMPLE_RESULT " + json.dumps(results), flush=True)
