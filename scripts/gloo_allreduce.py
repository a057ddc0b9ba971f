#!/usr/bin/env python3
"""PyTorch gloo all-reduce of f32 data, printed like ddp-comm's allreduce_bench (for the CPU
scaling row of `cargo xtask gpu-check run`, where torch exists): run as `python3 -m torch.distributed.run --nproc-per-node N
gloo_allreduce.py --sizes 1M,25M`. Rank 0 prints one `BENCH |` line per size."""
import argparse
import time

import torch
import torch.distributed as dist


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1M,25M")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    for size in a.sizes.split(","):
        nbytes = parse_size(size)
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for _ in range(a.iters + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        times = sorted(times[2:])
        med = times[len(times) // 2]
        algbw = nbytes / med / 1e9
        busbw = algbw * 2 * (n - 1) / n
        if rank == 0:
            print(f"BENCH | torch gloo, {n} ranks | {size} | median {med * 1e6:.1f} us | "
                  f"algbw {algbw:.3f} GB/s | busbw {busbw:.3f} GB/s |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
