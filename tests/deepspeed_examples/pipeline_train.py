"""A small equivalent of DeepSpeedExamples' training/pipeline_parallelism/train.py (not a copy).

It calls DeepSpeed the way that script does: ``deepspeed.add_config_arguments`` with ``--local_rank``,
``--backend``, ``-p/--pipeline-parallel-size`` and ``--deepspeed_config``;
``deepspeed.init_distributed(dist_backend=args.backend)``; ``LOCAL_RANK`` from the environment;
``deepspeed.runtime.utils.set_random_seed``; with ``-p 0`` a data-parallel engine from
``deepspeed.initialize(args=..., model=..., model_parameters=[...], training_data=trainset)`` read through
``deepspeed.utils.RepeatingLoader`` with ``engine.gradient_accumulation_steps()``, ``engine.device``,
``engine.backward`` / ``engine.step``; otherwise a ``deepspeed.pipe.PipelineModule`` over the AlexNet-style
layer list (``features``, ``avgpool``, a flattening lambda, ``classifier``; ``partition_method='parameters'``)
trained with ``engine.train_batch()`` on the loader built from ``training_data``.

Differences, all for a test: a tiny AlexNet-shaped network (same layer kinds, dropout included) on fake
16x16 images instead of torchvision's AlexNet on CIFAR; ``get_accelerator().set_device`` instead of
``torch.cuda.set_device`` (CPU); ``-p`` takes several values (one engine each, in one process group); and
rank 0 prints the losses as one JSON line (``EXAMPLE_RESULT {...}``).
"""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader


class TinyAlexNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.5), nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True),
            nn.Dropout(p=0.5), nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def cifar_trainset(local_rank, n=64):
    """Fake 16x16 'CIFAR' images and labels, the same on every rank (the example's barrier kept)."""
    dist.barrier()
    g = torch.Generator().manual_seed(11)
    images = torch.randn(n, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, nargs="+", default=[2],
                        help="pipeline parallelism (0: plain data parallel; one engine per value)")
    parser.add_argument("--backend", type=str, default="nccl", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_base(args):
    torch.manual_seed(args.seed)
    net = TinyAlexNet(num_classes=10)
    trainset = cifar_trainset(args.local_rank)
    engine, _, dataloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    dataloader = RepeatingLoader(dataloader)
    data_iter = iter(dataloader)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        batch = next(data_iter)
        inputs = batch[0].to(engine.device)
        labels = batch[1].to(engine.device)
        outputs = engine(inputs)
        loss = criterion(outputs, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1),
            *vision_model.classifier]


def train_pipe(args, stages, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = TinyAlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=stages,
                         partition_method=part, activation_checkpoint_interval=0)
    trainset = cifar_trainset(args.local_rank)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    return [float(engine.train_batch()) for _ in range(args.steps)]


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    results = {str(p): train_pipe(args, p) if p else train_base(args) for p in args.pipeline_parallel_size}
    if dist.get_rank() == 0:
        print("EXAMPLE_RESULT " + json.dumps(results), flush=True)
