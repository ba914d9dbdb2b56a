"""DeepSpeedExamples' ``training/pipeline_parallelism/train.py`` (AlexNet on CIFAR-10, PP 2), shrunk: a small
conv + linear net cut into 2 stages by parameters, ``loss_fn=nn.CrossEntropyLoss()`` (a module),
``initialize(model=net, model_parameters=..., training_data=trainset)`` and ``engine.train_batch()`` in a
loop over more steps than the data holds. The same script under DeepSpeed 0.19.8's PipelineEngine
(``DS_ACCELERATOR=cpu``) and ours gives the same losses (it reads ``training_data`` in order through a
``RepeatingLoader``); every ``steps_per_print`` line shows that step's loss. Clipping is off: see
``_config``."""
from __future__ import annotations

import importlib.util
import logging
import os
import zlib
from typing import Dict, List

import pytest
import torch
from distributed import run_distributed

STEPS, MICRO, GAS, SAMPLES = 4, 2, 4, 12  # 6 micro-batches of data, 16 read: the loader repeats


class Images(torch.utils.data.Dataset):
    """CIFAR-shaped samples (3 x 8 x 8 images, 10 classes), fixed by the seed."""

    def __init__(self, n: int = SAMPLES):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


def _net(pipe):
    """The example's join_layers(AlexNet) in small: features, then a flattening classifier."""
    import torch.nn as nn

    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
              nn.AdaptiveAvgPool2d(2), lambda x: torch.flatten(x, 1), nn.Linear(32, 32), nn.ReLU(),
              nn.Linear(32, 10)]
    net = pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                              partition_method="parameters", activation_checkpoint_interval=0)
    with torch.no_grad():  # the same weights under both: seeded by parameter name
        for name, prm in net.named_parameters():
            prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.2)
    return net


def _config(deepspeed: bool) -> Dict[str, object]:
    params: Dict[str, object] = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7}
    if deepspeed:
        params["torch_adam"] = True  # not its JIT-built CPU Adam
    return {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1,
            "optimizer": {"type": "Adam", "params": params},
            # the default 1.0 clips here; DeepSpeed's ZeRO-0 pipeline norm counts the first stage's gradients
            # only (tests/test_pipe_deepspeed.py), so its clipped steps differ from every true-norm run
            "gradient_clipping": 0.0}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _without_loader_workers(loader_class) -> None:
    """DeepSpeed's loader reads with 2 worker processes on CPU, which a test rank (a daemon process) may not
    start: read in the rank itself (the same batches in the same order)."""
    init = loader_class.__init__

    def in_process(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.num_local_io_workers = 0

    loader_class.__init__ = in_process


def _run() -> Dict[str, object]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.pipe

    import shardspeed
    import shardspeed.pipe

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")  # over the group the test harness created
    _without_loader_workers(deepspeed.runtime.dataloader.DeepSpeedDataLoader)
    out: Dict[str, object] = {}
    for name, pipe, init in (("deepspeed", deepspeed.pipe, deepspeed.initialize),
                             ("shardspeed", shardspeed.pipe, shardspeed.initialize)):
        net = _net(pipe)
        engine, *_ = init(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                          training_data=Images(), config=_config(name == "deepspeed"))
        lines = _Lines()
        logging.getLogger("shardspeed").addHandler(lines)
        logging.getLogger("shardspeed").setLevel(logging.INFO)
        try:
            out[name] = [float(engine.train_batch()) for _ in range(STEPS)]
        finally:
            logging.getLogger("shardspeed").removeHandler(lines)
        if name == "shardspeed":
            out["lines"] = [line for line in lines.lines if line.startswith("step=")]
    return out


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_pipeline_example_matches_deepspeed_and_prints_the_steps_loss():
    results = run_distributed(_run, 2, timeout=300)
    for per_rank in results:
        assert per_rank["shardspeed"] == pytest.approx(per_rank["deepspeed"], rel=1e-5), per_rank
        assert len(set(per_rank["deepspeed"])) == STEPS  # the weights changed every step
    lines, losses = results[0]["lines"], results[0]["shardspeed"]
    assert [line.split(" lr=")[0] for line in lines] == [f"step={i + 1} loss={x:.4f}" for i, x in enumerate(losses)]
    assert results[1]["lines"] == []  # rank 0 prints


def test_repeating_loader_starts_its_loader_again():
    from shardspeed.runtime.dataloader import RepeatingLoader as AtDeepSpeedPath
    from shardspeed.utils import RepeatingLoader

    assert RepeatingLoader is AtDeepSpeedPath
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    assert [b.tolist() for _, b in zip(range(5), RepeatingLoader(loader))] == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
