"""Lightning's own DeepSpeed strategy (``Trainer(strategy="deepspeed_stage_2"|"deepspeed_stage_3")``) on 2 CPU
ranks, for tests/test_lightning_deepspeed.py. Run it with shardspeed's ``deepspeed`` package first on
PYTHONPATH, or with the real DeepSpeed (``DS_ACCELERATOR=cpu``): the script is the same.

    python tests/lightning_ds_fit.py OUT_DIR [--patch-cpu-check] [--devices N]   # N: 2 unless given

The patch (``--patch-cpu-check``, on this CPU box only; both halves are the strategy's CUDA-only assumption):
``DeepSpeedStrategy.setup_environment`` refuses any accelerator but CUDA ("The DeepSpeed strategy is only
supported on CUDA GPUs"): it is replaced by its parent's (``DDPStrategy.setup_environment``, the same method
without that ``isinstance`` test); and the strategy expects its devices numbered by local rank, as CUDA devices
are (``_validate_device_index_selection``, and ``args.device_rank = root_device.index`` for ``initialize``):
``CPUAccelerator.get_parallel_devices(n)`` gives ``cpu:0 .. cpu:n-1`` instead of ``n`` times ``cpu`` (a tensor
moved to ``cpu:1`` is on the CPU as before). Nothing else of Lightning is touched. Without the flag (the device
script) nothing is patched and the accelerator is CUDA.

Each fit writes ``OUT_DIR/s<stage>.rank<r>.json``: ``rows`` (per batch ``[global_step, batch_idx, loss]``), what
the engine is, after fit the fp32 weights that ``get_fp32_state_dict_from_zero_checkpoint`` reads back from the
last ``ModelCheckpoint`` file (a folder saved by ``engine.save_checkpoint(tag="checkpoint")``), and
``resumed_rows``: a new fit from the epoch-0 checkpoint (``engine.load_checkpoint``), i.e. the second epoch again.
"""
from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from worker_exit import end_distributed  # tests/, the folder of this script

torch.set_num_threads(1)
PATCH = "--patch-cpu-check" in sys.argv
DEVICES = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 2
if PATCH:
    from lightning.pytorch.accelerators import CPUAccelerator

    DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment  # without its CUDA-only test
    CPUAccelerator.get_parallel_devices = staticmethod(lambda devices: [torch.device("cpu", i) for i in
                                                                        range(CPUAccelerator.parse_devices(devices))])


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                           torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class Record(Callback):
    def __init__(self, path):
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append([trainer.global_step, batch_idx, float(loss)])


def loader():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _trainer(stage, callbacks):
    return L.Trainer(strategy=f"deepspeed_stage_{stage}", accelerator="cpu" if PATCH else "cuda", devices=DEVICES,
                     max_epochs=2, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                     logger=False)


def fit(out_dir, stage):
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    L.seed_everything(0, verbose=False)
    rec = Record(os.path.join(out_dir, f"s{stage}"))
    ckpt_dir = os.path.join(out_dir, f"s{stage}_ckpt")
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = _trainer(stage, [rec, saver])
    trainer.fit(Net(), loader())
    engine = trainer.strategy.model
    out = {"rows": rec.rows, "engine": type(engine).__module__ + "." + type(engine).__name__,
           "is_engine": isinstance(engine, deepspeed.DeepSpeedEngine), "deepspeed": deepspeed.__version__}
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(ckpt_dir, "epoch=1.ckpt"))
        out["fp32"] = {k: v.flatten().tolist() for k, v in sorted(sd.items())}
    # resume from the epoch-0 checkpoint (engine.load_checkpoint under Lightning's strategy): the second epoch again
    L.seed_everything(0, verbose=False)
    again = Record(os.path.join(out_dir, f"s{stage}_resume"))
    _trainer(stage, [again]).fit(Net(), loader(), ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
    out["resumed_rows"] = again.rows
    with open(os.path.join(out_dir, f"s{stage}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    for stage in (2, 3):
        fit(sys.argv[1], stage)
    end_distributed()
