"""accelerate with DeepSpeed, unchanged, for tests/test_accelerate_via_deepspeed_package.py: started by
``accelerate launch --config_file CFG.yaml`` (a DEEPSPEED section) under real DeepSpeed or under shardspeed's
``deepspeed`` package (whichever ``import deepspeed`` finds: the test sets PYTHONPATH).

    accelerate launch --config_file CFG.yaml tests/accelerate_ds_loop.py OUT_DIR

One process group runs three custom loops: ``launched``, with the DeepSpeed plugin the launcher described
(``Accelerator()`` reads it from the environment), then ``z2`` and ``z3`` with
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``. Rank 0 writes ``OUT_DIR/result.json``:
per loop the loss of every micro-batch, and which ``deepspeed`` the worker imported; the ZeRO 3 loop also
saves its state half-way (``save_state``), and after the end loads it and runs the second half again.

On a machine without an accelerator, accelerate's state sees one process unless it is told the backend
(``InitProcessGroupKwargs(backend="gloo")``); on GPUs that handler is not needed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

torch.set_num_threads(1)

from accelerate import Accelerator, DeepSpeedPlugin  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from worker_exit import end_distributed  # noqa: E402  (tests/, the folder of this script)

MICRO, GAS, MICRO_BATCHES = 2, 2, 8


def model():
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def loader():
    ids = torch.randint(0, 96, (64, 12), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)


def ds_config(stage: int, own_optimizer: bool) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if stage == 3:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if own_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                           "warmup_num_steps": 2, "warmup_type": "linear"}}
    return cfg


def accelerator(plugin=None) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=False)  # one process group, several Accelerators
    return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def prepare(acc: Accelerator):
    m = model()
    built = sum(p.data.numel() for p in m.parameters())
    if "optimizer" in acc.state.deepspeed_plugin.deepspeed_config:
        opt = DummyOptim(m.parameters())
        sched = DummyScheduler(opt)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    return (*acc.prepare(m, opt, loader(), sched), built)


def loop(acc: Accelerator, m, opt, dl, sched, first: int = 0, end: int = MICRO_BATCHES) -> list:
    """The loop of accelerate's examples (accumulate, backward, step, schedule, zero_grad) over micro-batches
    first..end-1 of the loader; returns each one's loss, averaged over the ranks."""
    losses = []
    for i, batch in enumerate(dl):
        if i == end:
            break
        if i < first:
            continue
        with acc.accumulate(m):
            loss = m(**batch).loss
            losses.append(float(acc.gather(loss.detach()).mean()))
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
    return losses


def train(acc: Accelerator) -> list:
    return loop(acc, *prepare(acc)[:4])


def main(out: str) -> None:
    import deepspeed

    result: dict = {"deepspeed": deepspeed.__version__, "origin": importlib.util.find_spec("deepspeed").origin}
    acc = accelerator()  # the plugin accelerate launch described (ACCELERATE_DEEPSPEED_* in the environment)
    result["launched_stage"] = acc.state.deepspeed_plugin.zero_stage
    result["world"] = acc.num_processes
    result["launched"] = train(acc)
    # the loops below bring their own plugin, as a script started by plain torchrun does (accelerate refuses
    # a plugin's config beside the DeepSpeed fields an accelerate config file gave the launcher)
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    result["z2"] = train(accelerator(DeepSpeedPlugin(hf_ds_config=ds_config(2, own_optimizer=False))))
    # ZeRO 3: save_state after 2 steps, 2 more steps, load_state, the same 2 steps again
    acc = accelerator(DeepSpeedPlugin(hf_ds_config=ds_config(3, own_optimizer=True)))
    m, opt, dl, sched, result["z3_built_numel"] = prepare(acc)
    half = MICRO_BATCHES // 2
    result["z3"] = loop(acc, m, opt, dl, sched, end=half)
    acc.save_state(os.path.join(out, "state"))
    result["z3"] += loop(acc, m, opt, dl, sched, first=half)
    acc.load_state(os.path.join(out, "state"))
    result["z3_reloaded"] = loop(acc, m, opt, dl, sched, first=half)
    if acc.is_main_process:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
