"""TRL trainers, unchanged, at ZeRO 3 on whichever ``deepspeed`` the worker imports (tests/test_trl_via_deepspeed_package.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/trl_job.py {sft|dpo|grpo} OUT_DIR

Under real DeepSpeed (DS_ACCELERATOR=cpu) or under shardspeed's package (PYTHONPATH starts with
``shardspeed deepspeed-path``): the script is the same. A tiny Llama (2 layers, hidden 32, vocab 64) and a
word-level tokenizer are built here from configs (nothing is downloaded), with tiny in-memory datasets.
Rank 0 writes ``OUT_DIR/<kind>.json``: which deepspeed ran, the per-step log rows of the Trainer (loss,
grad_norm, and the trainer's own metrics) and, for GRPO, the completions it generated at each step.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from worker_exit import end_distributed  # tests/, the folder of this script

torch.set_num_threads(1)

WORDS = ("the a cat dog sat ran on in mat park red blue big small and then it was happy sad one two three "
         "four five up down left right yes no good bad hot cold sun moon tree car fast slow").split()
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
ZERO3 = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
         "stage3_param_persistence_threshold": "auto"}
DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "steps_per_print": 1000,
             "zero_optimization": ZERO3}
STEPS, LR = 3, 1e-2


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM, set_seed

    set_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def sentences(n, seed, length=5):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (length,), generator=g)) for _ in range(n)]


def common(out_dir):
    return dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS,
                learning_rate=LR, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
                deepspeed=DS_CONFIG, bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True, use_cpu=True)


def run_sft(out_dir, tok):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": sentences(16, 1, length=6)})
    args = SFTConfig(max_length=16, **common(out_dir))
    return SFTTrainer(model=model(tok), args=args, train_dataset=data, processing_class=tok), {}


def run_dpo(out_dir, tok):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    prompts, chosen, rejected = sentences(16, 2, 3), sentences(16, 3, 3), sentences(16, 4, 3)
    data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    args = DPOConfig(max_length=16, beta=0.5, **common(out_dir))
    ref = model(tok)  # the same weights as the policy; TRL prepares it (prepare_deepspeed: no optimizer, frozen)
    ref.requires_grad_(False)
    trainer = DPOTrainer(model=model(tok), ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    return trainer, {"ref_engine": type(trainer.ref_model).__name__}


def reward_len(completions, **kwargs):
    """Rewards completions that say "yes" and are short: varied enough that advantages are not all zero."""
    return [float(c.split().count("yes")) - 0.1 * len(c.split()) for c in completions]


def run_grpo(out_dir, tok, gather=True):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict({"prompt": sentences(8, 5, 3)})
    args = GRPOConfig(num_generations=2, max_completion_length=6, use_vllm=False, beta=0.0, temperature=1.0,
                      ds3_gather_for_generation=gather, generation_batch_size=4, log_completions=False,
                      **common(out_dir))
    trainer = GRPOTrainer(model=model(tok), reward_funcs=reward_len, args=args, train_dataset=data,
                          processing_class=tok)
    return trainer, {}


def hooks_on(model):
    """Module hooks on ``model``: torch forward (pre-)hooks, and modules whose parameter dict is not a plain dict
    (shardspeed's read watchers)."""
    torch_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    watchers = sum(type(m._parameters) is not dict for m in model.modules())
    return [torch_hooks, watchers]


def capture_generations(trainer, sink, seen):
    """Records the completions of every generation step (the token ids GRPO produced, on every rank), and
    while ``generate`` runs: the hooks left on the model and whether every parameter is whole and
    ``ds_status`` AVAILABLE (TRL took the ZeRO-3 hooks off inside ``GatheredParameters``)."""
    inner, model = trainer._generate_single_turn, trainer.model
    generate = model.generate

    def watched_generate(*a, **k):
        params = list(model.parameters())
        seen.append({"hooks": hooks_on(model), "available": all(getattr(p, "ds_status", None) is not None
                                                                and p.ds_status.name == "AVAILABLE" for p in params),
                     "whole": all(p.numel() > 0 for p in params)})
        return generate(*a, **k)

    def wrapped(*a, **k):
        out = inner(*a, **k)
        sink.append([list(map(int, ids)) for ids in out[0]])
        return out

    trainer._generate_single_turn = wrapped
    model.generate = watched_generate


def train_one(kind, out_dir, tok):
    """Build and train one trainer; returns what rank 0 records for it."""
    import deepspeed

    builders = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo,
                "grpo_nogather": lambda o, t: run_grpo(o, t, gather=False)}
    trainer, extra = builders[kind](out_dir, tok)
    gens: list = []
    seen: list = []
    if kind.startswith("grpo"):
        capture_generations(trainer, gens, seen)
    trainer.train()
    world_gens = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(world_gens, gens)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {"deepspeed": deepspeed.__version__, "engine": type(trainer.model_wrapped).__name__,
            "rows": rows, "generations": world_gens, "during_generate": seen, "hooks_after": hooks_on(trainer.model),
            **extra}


def main(kinds, out_dir):
    """Trains each of ``kinds`` (comma-separated) in turn in this process (the imports are paid once)."""
    from accelerate.state import AcceleratorState

    tok = tokenizer()
    for kind in kinds.split(","):
        try:
            record = train_one(kind, os.path.join(out_dir, kind), tok)
        except Exception as exc:  # recorded (the same on every rank, before any collective), then the next one
            record = {"error": f"{type(exc).__name__}: {exc}"}
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(out_dir, f"{kind}.json"), "w") as f:
                json.dump(record, f)
        AcceleratorState._reset_state()  # the next trainer sets up its own DeepSpeed plugin (the group stays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_distributed()
