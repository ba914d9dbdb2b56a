"""A small equivalent of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (not a copy).

It calls DeepSpeed the way that script does: ``deepspeed.add_config_arguments`` on an argparse parser
with ``--local_rank``, ``deepspeed.init_distributed()``, the config as a dict (``get_ds_config``, with
the script's keys, the deprecated ``cpu_offload`` among them), ``deepspeed.initialize(args=...,
model=..., model_parameters=..., training_data=trainset, config=...)``, the loader DeepSpeed returns,
``get_accelerator().device_name(engine.local_rank)``, ``engine.bfloat16_enabled()`` /
``fp16_enabled()``, ``engine.backward`` / ``engine.step``, then an evaluation through the engine.

Differences, all for a test: fake CIFAR-shaped tensors instead of torchvision's download, seeded weights,
``--stage`` and ``--dtype`` take several values (one engine each, in one process group), and rank 0
prints its per-step losses as one JSON line (``EXAMPLE_RESULT {...}``).
"""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2, help="output logging information at a given interval")
    parser.add_argument("--dtype", default=["fp16"], nargs="+", choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training (one engine per value)")
    parser.add_argument("--stage", default=[0], nargs="+", type=int, choices=[0, 1, 2, 3],
                        help="ZeRO stage (one engine per value)")
    parser.add_argument("--samples", default=96, type=int, help="fake training images")
    parser.add_argument("--seed", default=1234, type=int)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(dtype, stage):
    """The example's config, its keys and values (the batch: 16 over all ranks)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def fake_cifar(n, seed):
    """CIFAR-shaped images normalised to [-1, 1] and labels, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    """Accuracy on the test set through the engine (as the example's ``test``)."""
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    return correct, total


def main(args, dtype, stage):
    deepspeed.init_distributed()
    trainset = fake_cifar(args.samples, args.seed)
    testset = fake_cifar(16, args.seed + 1)

    torch.manual_seed(args.seed)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset,
        config=get_ds_config(dtype, stage))

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()

    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            losses.append(loss.item())
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1: d}, {i + 1: 5d}] loss: {running_loss / args.log_interval: .3f}")
                running_loss = 0.0
    correct, total = test(model_engine, testset, local_device, target_dtype)
    return {"losses": losses, "correct": correct, "total": total}


if __name__ == "__main__":
    args = add_argument()
    results = {f"{dtype}/{stage}": main(args, dtype, stage) for dtype in args.dtype for stage in args.stage}
    if torch.distributed.get_rank() == 0:
        print("EXAMPLE_RESULT " + json.dumps(results), flush=True)
