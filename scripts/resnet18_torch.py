#!/usr/bin/env python3
"""ResNet-18 in its CIFAR layout in PyTorch, the same network as train-cnn's `resnet` module
(3x3 stem of stride 1, four stages of two basic blocks of 64-128-256-512 channels, convolutions
without bias, BatchNorm or SyncBatchNorm, global average pooling, one linear layer): the PyTorch
side of `cargo xtask bench resnet` and of the GPU check's ResNet rows.

  python3 resnet18_torch.py --count-params            # prints `PARAMS 11173962`
  python3 resnet18_torch.py --device cpu --batch 8    # PyTorch eager, one process
  python3 -m torch.distributed.run --nproc-per-node 2 resnet18_torch.py --ddp --device cpu

Every run prints one `RESNET {json}` line from rank 0 (the fields of `train-cnn bench`'s):
the median step time over the timed steps (the device synchronised before each clock read),
and under DDP the median of the same steps under `no_sync()`, each run right before or after a
synchronised one (alternately); their difference is the gradient synchronisation the step
waits for (DDP overlaps part of it with the backward pass).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# PyTorch's count for this network with 3 input channels and 10 classes; train-cnn's test
# `resnet18_has_pytorchs_parameter_count` holds the same number.
RESNET18_PARAMS = 11_173_962


class BasicBlock(nn.Module):
    def __init__(self, in_ch, out_ch, stride, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.norm1 = norm(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.norm2 = norm(out_ch)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), norm(out_ch)
            )

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, in_channels=3, num_classes=10, norm=nn.BatchNorm2d):
        super().__init__()
        widths = [64, 128, 256, 512]
        self.stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.stem_norm = norm(widths[0])
        blocks, in_ch = [], widths[0]
        for stage, width in enumerate(widths):
            for block in range(2):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(in_ch, width, stride, norm))
                in_ch = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        x = F.relu(self.stem_norm(self.stem(x)))
        x = self.blocks(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def count_params(model):
    return sum(p.numel() for p in model.parameters())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--count-params", action="store_true")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (env:// ranks)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (needs --ddp)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=8, help="images per rank and step")
    p.add_argument("--size", type=int, default=32, help="image rows and columns")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16 (CUDA)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    a = p.parse_args()

    if a.count_params:
        n = count_params(ResNet18())
        print(f"PARAMS {n}")
        return 0 if n == RESNET18_PARAMS else 1
    if a.sync_bn and not a.ddp:
        sys.exit("resnet18_torch.py: --sync-bn needs --ddp")
    if a.sync_bn and a.device != "cuda":
        sys.exit("resnet18_torch.py: PyTorch's SyncBatchNorm runs on GPUs only (--device cuda)")

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    rank, world = 0, 1
    if a.ddp:
        backend = "nccl" if a.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(42)
    model = ResNet18().to(device)
    assert count_params(model) == RESNET18_PARAMS
    if a.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    net = model
    if a.ddp:
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optim = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    images = torch.randn(a.batch, 3, a.size, a.size, generator=gen).to(device)
    labels = torch.randint(0, 10, (a.batch,), generator=gen).to(device)

    def step(sync):
        optim.zero_grad(set_to_none=True)
        ctx = net.no_sync() if (a.ddp and not sync) else torch.enable_grad()
        with ctx:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss = F.cross_entropy(net(images), labels)
            loss.backward()
        optim.step()

    timed = {True: [], False: []}
    kinds = [True, False] if a.ddp else [True]
    for i in range(a.warmup + a.steps):
        # Which of the pair runs first alternates, so that neither gains from its place.
        for sync in kinds if i % 2 == 0 else kinds[::-1]:
            if a.ddp:
                dist.barrier()
            synchronize(device)
            t = time.perf_counter()
            step(sync)
            synchronize(device)
            if i >= a.warmup:
                timed[sync].append(time.perf_counter() - t)

    no_sync = statistics.median(timed[False]) * 1e3 if a.ddp else None
    if rank == 0:
        row = {
            "framework": "PyTorch",
            "version": torch.__version__,
            "mode": "ddp" if a.ddp else "alone",
            "ranks": world,
            "norm": "SyncBatchNorm" if a.sync_bn else "BatchNorm",
            "device": a.device,
            "batch": a.batch,
            "size": a.size,
            "steps": a.steps,
            "step_ms": statistics.median(timed[True]) * 1e3,
            "no_sync_ms": no_sync,
            "own_sync_ms": None,
            "threads": torch.get_num_threads(),
        }
        print("RESNET " + json.dumps(row), flush=True)
    if a.ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
