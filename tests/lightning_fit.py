"""Runs lightning.Trainer fits for tests/test_lightning.py (a script: Lightning's launcher re-runs it per rank).

    python tests/lightning_fit.py parity OUT_DIR   # 2 CPU ranks: ddp, ShardspeedStrategy stage 2/3, resumes
    python tests/lightning_fit.py errors OUT_DIR   # 1 rank: conflicting Trainer settings are refused

Each fit writes ``OUT_DIR/<run>.rank<r>.json``: ``rows``, per training batch ``[global_step, batch_idx, loss, lr]``,
and whether ``configure_model`` built the parameters sharded (``built_sharded``).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from shardspeed.integrations.lightning import ShardspeedStrategy  # noqa: E402
from shardspeed.zero.tags import init_shard_of  # noqa: E402

torch.set_num_threads(1)


class Net(L.LightningModule):
    """A tiny regression MLP built in configure_model (so stage 3 builds it under shardspeed.zero.Init)."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                           torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            # stage 3: built under shardspeed.zero.Init, so each parameter holds only this rank's shard
            self.built_sharded = all(init_shard_of(p) is not None for p in self.net.parameters())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    def __init__(self, out_dir, run):
        self.path, self.rows = os.path.join(out_dir, run), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append([trainer.global_step, batch_idx, float(loss), trainer.optimizers[0].param_groups[0]["lr"]])

    def on_train_end(self, trainer, pl_module):
        with open(f"{self.path}.rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rows": self.rows, "built_sharded": pl_module.built_sharded,
                       "strategy": type(trainer.strategy).__name__}, f)


def loader():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)


def fit(out_dir, run, strategy, devices=2, ckpt_dir=None, ckpt_path=None, **trainer_kw):
    L.seed_everything(0, verbose=False)
    callbacks = [Record(out_dir, run)]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, logger=False,
                        enable_checkpointing=bool(ckpt_dir), **trainer_kw)
    trainer.fit(Net(), loader(), ckpt_path=ckpt_path)
    return trainer


def parity(out_dir):
    fit(out_dir, "ddp_gas1", "ddp", gradient_clip_val=0.5)
    fit(out_dir, "ddp_gas2", "ddp", gradient_clip_val=0.5, accumulate_grad_batches=2)
    for stage, gas in ((2, 1), (3, 2)):
        config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.5,
                  "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas}
        run = f"ss{stage}"
        ckpt = os.path.join(out_dir, f"{run}_ckpt")
        fit(out_dir, run, ShardspeedStrategy(config=config), ckpt_dir=ckpt)
        fit(out_dir, f"{run}_resume", ShardspeedStrategy(config=config), ckpt_path=os.path.join(ckpt, "epoch=0.ckpt"))


def errors(out_dir):
    msgs = {}
    cases = {
        "accumulate": (dict(config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}),
                       dict(accumulate_grad_batches=3)),
        "clip": (dict(config={"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}),
                 dict(gradient_clip_val=0.5)),
        "clip_value": (dict(stage=2), dict(gradient_clip_val=0.5, gradient_clip_algorithm="value")),
    }
    for name, (skw, tkw) in cases.items():
        try:
            fit(out_dir, f"err_{name}", ShardspeedStrategy(**skw), devices=1, **tkw)
            msgs[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            msgs[name] = f"{type(exc).__name__}: {exc}"
    # and a run the strategy accepts: the Trainer's accumulation and clipping fill in an empty config
    trainer = fit(out_dir, "ok", "shardspeed_stage_2", devices=1, accumulate_grad_batches=2, gradient_clip_val=0.5)
    engine = trainer.strategy.engine
    msgs["ok"] = {"gas": engine.gradient_accumulation_steps(), "clip": engine.gradient_clipping(),
                  "global_step": trainer.global_step, "engine_steps": engine.global_steps}
    with open(os.path.join(out_dir, "errors.json"), "w") as f:
        json.dump(msgs, f)


if __name__ == "__main__":
    {"parity": parity, "errors": errors}[sys.argv[1]](sys.argv[2])
