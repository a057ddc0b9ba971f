#!/usr/bin/env python3
"""Reads train-cnn's metrics.json files for scripts/gpu-check.sh and prints its OUTCOME/BENCH lines.

  gpu_check_report.py compare A_DIR B_DIR TOL   last-epoch losses of run A vs run B (relative);
                                                exit 1 above TOL
  gpu_check_report.py step-times DIR BATCH      samples/s and ms/step of DIR/{cuda-bn,cuda-syncbn,
                                                wgpu-syncbn,cpu-syncbn}; exit 1 if a run is missing
"""
import json
import os
import sys


def last_epoch(run_dir):
    with open(os.path.join(run_dir, "metrics.json")) as f:
        return json.load(f)[-1]


def compare(a_dir, b_dir, tol):
    a, b = last_epoch(a_dir), last_epoch(b_dir)
    worst = 0.0
    for key in ("train_loss", "eval_loss"):
        rel = abs(a[key] - b[key]) / max(abs(b[key]), 1e-12)
        worst = max(worst, rel)
        print(f"OUTCOME {key}: {os.path.basename(a_dir)} {a[key]:.6f}, "
              f"{os.path.basename(b_dir)} {b[key]:.6f} (relative difference {rel:.1e}, bound {tol:g})")
    print(f"OUTCOME eval accuracy: {a['eval_accuracy']:.4f} vs {b['eval_accuracy']:.4f}")
    return 0 if worst <= tol else 1


RUNS = ("cuda-bn", "cuda-syncbn", "wgpu-syncbn", "cpu-syncbn")


def step_times(root, batch):
    rate = {}
    for name in RUNS:
        try:
            rate[name] = last_epoch(os.path.join(root, name))["samples_per_sec"]
        except (OSError, ValueError, IndexError, KeyError):
            print(f"OUTCOME {name}: no metrics (the run failed)")
    print("BENCH | train-cnn run (last epoch, batch %d) | samples/s | ms/step | vs cpu |" % batch)
    for name, sps in rate.items():
        vs = f"{sps / rate['cpu-syncbn']:.2f}x" if "cpu-syncbn" in rate else "-"
        print(f"BENCH | {name} | {sps:.0f} | {1000.0 * batch / sps:.2f} | {vs} |")
    if "cuda-bn" in rate and "cuda-syncbn" in rate:
        cost = rate["cuda-bn"] / rate["cuda-syncbn"] - 1.0
        print(f"BENCH | SyncBatchNorm vs BatchNorm step time on CUDA (world 1) | {100 * cost:+.1f} % | | |")
    return 0 if len(rate) == len(RUNS) else 1


def main(argv):
    if len(argv) == 5 and argv[1] == "compare":
        return compare(argv[2], argv[3], float(argv[4]))
    if len(argv) == 4 and argv[1] == "step-times":
        return step_times(argv[2], int(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
