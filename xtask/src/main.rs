//! `cargo xtask …`: the project's task runner, a thin CLI over the libraries.
//!
//! ```text
//! cargo xtask ci
//! cargo xtask readme-deps
//! cargo xtask setup-cuda-build [--llvm DIR] [--check]
//! cargo xtask train [--cpus N | --gpus N] [--sync-bn|--no-sync-bn] [--epochs E] …
//! cargo xtask compare [--ranks N] [--per-rank-batch 4,8,16,32,64] [--seeds K] …
//! cargo xtask bench ddp|syncbn|data|handshake|resnet
//! cargo xtask bench recovery [--nproc N] [--epochs E] [--kill-after-ms T] [--repeats R]
//! cargo xtask bench allreduce [--nproc 2,4] [--sizes 8K,1M,25M,100M] [--transport shm,tcp]
//!                             [--compression none,bf16] [--iters N] [--pin]
//!                             [--nodes 2x4,…] [--collectives all-reduce,reduce-scatter,all-gather]
//! cargo xtask gpu-check build [--out DIR] [--dry] [--add FILE]…
//! .gpu-bin/xtask gpu-check run [--bundle DIR] [--budget-secs S] [--only TEXT]…
//! ```

use std::process::ExitCode;

use cargo_tasks::workspace_root;
use clap::{Parser, Subcommand};
use cuda_tools::{cuda_build, gpu_check, ptx_check};
use train_cnn_runs::{compare, train};

mod ci;
#[cfg(test)]
mod import_cycles;
#[cfg(test)]
mod profile_placement;
mod readme_deps;

#[derive(Parser, Debug)]
#[command(name = "cargo xtask", about = "burn-ddp task runner")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Everything CI checks: formatting, clippy, all tests, and the CUDA binaries built and
    /// linked (with their no-GPU tests run).
    Ci,
    /// Point the LLVM folder Burn's CUDA build expects at an installed LLVM, so that building
    /// with `--features cuda` needs no download (for machines without internet, e.g. CI).
    SetupCudaBuild(cuda_build::SetupArgs),
    /// Train the example CNN data-parallel (2 CPU ranks by default; `--gpus N` on CUDA).
    Train(train::TrainArgs),
    /// The BatchNorm sweep: per per-rank batch b, 1 process × N·b with BatchNorm vs N ranks × b
    /// with per-rank BatchNorm vs N ranks × b with SyncBatchNorm, over several seeds: mean ±
    /// sd, gaps, verdicts and a plot (compare.md, compare.json, compare.svg).
    Compare(compare::CompareArgs),
    /// The GPU check: `build` here packs the CUDA binaries into .gpu-bin/, `run` on a
    /// machine with an NVIDIA GPU (no cargo there: `.gpu-bin/xtask gpu-check run`) runs every
    /// check and prints one table.
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Burn's CUDA path without a GPU: CI's CUDA binaries under the CUDA driver stand-in, every
    /// PTX module assembled by ptxas for sm_90a and every launch checked against an H200's
    /// limits (nothing runs: results are meaningless and not asserted).
    PtxCheck(ptx_check::PtxCheckArgs),
    /// The README's dependency lines as a user's fresh project has them: resolved afresh (no
    /// build) with every CPU feature of burn-ddp, and refused if the graph holds a crate known
    /// not to build there.
    ReadmeDeps,
    /// Benchmarks (release builds, launched through `ddprun`).
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// DDP step time, 1 rank vs N ranks, split into compute / sync, with a bucket-size sweep
    /// (an MLP of ~10M parameters and a small CNN). Arguments after `--` go to `ddp_bench`.
    Ddp {
        /// Ranks of the distributed run (the baseline is 1 rank).
        #[arg(long, default_value_t = 2)]
        nproc: u32,
        /// Transports: shm (ranks of this host over shared memory) and/or tcp (every rank
        /// its own emulated host, `DDP_HOST_ID`, so all traffic is TCP).
        #[arg(long, value_delimiter = ',', default_value = "shm")]
        transport: Vec<String>,
        /// Gradient wire formats compared in each run (the first is the baseline).
        #[arg(long, value_delimiter = ',', default_value = "none")]
        compression: Vec<String>,
        /// More arguments for the rank program (`ddp_bench --help`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Step time of a small CNN with BatchNorm vs SyncBatchNorm on CPU ranks, and the CubeCL
    /// kernels vs the tensor-op path on wgpu and on burn-cpu. Arguments after `--` go to
    /// `syncbn_bench`.
    Syncbn {
        /// More arguments for the benchmark (`syncbn_bench --help`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// The optimizer state sharded across ranks (ZeRO stage 1) vs not: step time, optimizer
    /// state and peak memory per rank (Adam, a 52 M-parameter MLP by default). Arguments after
    /// `--` go to `zero_bench`.
    Zero {
        /// World sizes; each runs unsharded, then sharded.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        nproc: Vec<u32>,
        /// More arguments for the rank program (`zero_bench --help`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// ResNet-18 (CIFAR layout) training steps, burn-ddp beside PyTorch in the same run: each
    /// alone, DDP in a world of one, DDP on N ranks with BatchNorm and SyncBatchNorm (PyTorch
    /// over gloo on the CPU; Burn's rows on Flex and on burn-cpu). PyTorch is python3's, else
    /// installed with pip into `$DDP_TORCH_DIR` (default `~/.cache/burn-ddp/torch`).
    Resnet {
        /// Ranks of the distributed rows.
        #[arg(long, default_value_t = 2)]
        nproc: u32,
        /// Images per rank and step.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Timed steps per row.
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Untimed steps first.
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// cpu, or cuda (a build with ddp-bench's `cuda` feature; the GPU check runs it).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Burn's rows only: no PyTorch, nothing installed.
        #[arg(long)]
        no_torch: bool,
    },
    /// What a lost rank costs: the same train-cnn job never killed, with rank 1 SIGKILLed and
    /// replaced live (`--recover live`), and killed at the same moment and restarted from the
    /// last epoch's checkpoint (`--max-restarts 1`): median wall times and the time lost.
    Recovery(ddp_bench_runs::recovery::RecoveryRuns),
    /// Items/s of the sharded loader vs Burn's DataLoaderBuilder on the same dataset/batcher.
    Data {
        /// More arguments for the benchmark (`data_bench --help`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Connections per second to the rendezvous store with the job's key (a SPAKE2 key
    /// exchange) vs without one, and process-group set-up time. Arguments after
    /// `--` go to `handshake_bench`.
    Handshake {
        /// More arguments for the benchmark (`handshake_bench --help`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// All-reduce of f32 data: size, median/min/max time, algbw and busbw per world size,
    /// and the time from launch to the first barrier.
    Allreduce {
        /// Ranks per run; several values run one after the other.
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        nproc: Vec<u32>,
        /// Message sizes (K, M, G suffixes = KiB, MiB, GiB).
        #[arg(long, value_delimiter = ',', default_value = "8K,1M,25M,100M")]
        sizes: Vec<String>,
        /// shm (shared memory between ranks of this host) or tcp; several values run each.
        #[arg(long, value_delimiter = ',', default_value = "shm")]
        transport: Vec<String>,
        /// Wire formats (none, bf16, fp16), all timed in each run; the first is the baseline
        /// of the `vs first` column.
        #[arg(long, value_delimiter = ',', default_value = "none")]
        compression: Vec<String>,
        /// Timed iterations per size (default: scaled to the size).
        #[arg(long)]
        iters: Option<usize>,
        /// Pin each rank to one core (LOCAL_RANK % cores).
        #[arg(long)]
        pin: bool,
        /// Collectives, one table each: all-reduce, reduce-scatter, all-gather (the
        /// sharded optimizer's two halves of an all-reduce).
        #[arg(long, value_delimiter = ',', default_value = "all-reduce")]
        collectives: Vec<String>,
        /// Emulated hosts instead: layouts KxL (K hosts of L ranks, each host its own
        /// `DDP_HOST_ID`), each timed node-aware and flat with the bytes sent across hosts,
        /// e.g. `2x1,2x2,2x4,3x2,4x1`.
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Bench {
            what:
                Bench::Ddp {
                    nproc,
                    transport,
                    compression,
                    extra,
                },
        } => ddp_bench_runs::ddp::run_ddp(nproc, &transport, &compression, &extra),
        Cmd::Bench {
            what: Bench::Syncbn { extra },
        } => ddp_bench_runs::program::run_program(
            &[
                "-p",
                "ddp-bench",
                "--features",
                "wgpu,cpu",
                "--bin",
                "syncbn_bench",
            ],
            "syncbn_bench",
            &extra,
        ),
        Cmd::Bench {
            what: Bench::Zero { nproc, extra },
        } => ddp_bench_runs::zero::run(&nproc, &extra),
        Cmd::Bench {
            what:
                Bench::Resnet {
                    nproc,
                    batch,
                    steps,
                    warmup,
                    device,
                    no_torch,
                },
        } => ddp_bench_runs::resnet::run(&ddp_bench_runs::resnet::ResnetRuns {
            nproc,
            batch,
            steps,
            warmup,
            device,
            no_torch,
        }),
        Cmd::Bench {
            what: Bench::Recovery(runs),
        } => ddp_bench_runs::recovery::run_recovery(&runs),
        Cmd::Bench {
            what: Bench::Data { extra },
        } => ddp_bench_runs::program::run_program(
            &["-p", "ddp-bench", "--bin", "data_bench"],
            "data_bench",
            &extra,
        ),
        Cmd::Bench {
            what: Bench::Handshake { extra },
        } => ddp_bench_runs::program::run_program(
            &[
                "-p",
                "ddp-bench",
                "--no-default-features",
                "--bin",
                "handshake_bench",
            ],
            "handshake_bench",
            &extra,
        ),
        Cmd::Ci => ci::run(&workspace_root()),
        Cmd::ReadmeDeps => readme_deps::run(&workspace_root()),
        Cmd::PtxCheck(a) => ptx_check::run(&workspace_root(), &a),
        Cmd::SetupCudaBuild(a) => cuda_build::setup(&workspace_root(), &a),
        Cmd::Train(a) => train::train(&workspace_root(), &a),
        Cmd::Compare(a) => compare::compare(&workspace_root(), &a),
        Cmd::GpuCheck(a) => gpu_check::main(&workspace_root(), &a).map_err(|e| e.to_string()),
        Cmd::Bench {
            what:
                Bench::Allreduce {
                    nproc,
                    sizes,
                    transport,
                    compression,
                    collectives,
                    iters,
                    pin,
                    nodes,
                },
        } => ddp_bench_runs::allreduce::run_allreduce(&ddp_bench_runs::allreduce::AllreduceRuns {
            nprocs: nproc,
            sizes,
            transports: transport,
            compression,
            collectives,
            iters,
            pin,
            nodes,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
