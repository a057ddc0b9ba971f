//! `train-cnn`: one rank of a data-parallel CNN training run.
//!
//! Run it alone (one process) or as N ranks under a launcher (`ddprun`, torchrun-style env).
//! Rank 0 shows a progress bar, prints the per-epoch table, writes `metrics.csv`,
//! `metrics.json`, `curves.svg` and `checkpoint.bin` under `--out`. `train-cnn bench …` times
//! ResNet-18 steps instead ([`train_cnn::bench`]).

use std::path::PathBuf;
use std::process::ExitCode;

use burn::nn::BatchNorm;
use burn::tensor::Device;
use burn_ddp::Ddp;
use burn_ddp::sync_batch_norm::SyncBatchNorm;
use clap::Parser;
use train_cnn::data::DataSpec;
use train_cnn::model::{ModelKind, NormLayer};
use train_cnn::train::{self, LrSchedule, TrainConfig, TrainError};

/// Train a small CNN (or ResNet-18) with BatchNorm on one rank of a data-parallel run.
#[derive(Debug, Parser)]
#[command(name = "train-cnn", version)]
struct Args {
    /// Samples per batch on each rank (global batch = this × world size).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Total number of epochs.
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    /// SGD learning rate (momentum 0.9), the peak of the schedule.
    #[arg(long, default_value_t = 0.02)]
    lr: f64,
    /// Learning-rate schedule: cosine decay to 0 over the run, or constant.
    #[arg(long, value_enum, default_value_t = LrSchedule::Cosine)]
    lr_schedule: LrSchedule,
    /// Seed of initialisation, synthetic data and data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// `synthetic` (embedded, generated) or `mnist:DIR` (IDX files, gzipped or not).
    #[arg(long, default_value = "synthetic")]
    data: DataSpec,
    /// Synthetic training images.
    #[arg(long, default_value_t = 10000)]
    train_size: usize,
    /// Synthetic evaluation images.
    #[arg(long, default_value_t = 2000)]
    eval_size: usize,
    /// The network: the small CNN (`--channels`) or ResNet-18 in its CIFAR layout (11.2 M
    /// parameters; on the CPU, slow: for GPUs and benchmarks).
    #[arg(long, value_enum, default_value_t = ModelKind::Cnn)]
    model: ModelKind,
    /// Output channels of the small CNN's conv blocks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,32")]
    channels: Vec<usize>,
    /// Output directory (metrics, plot, checkpoint).
    #[arg(long, default_value = "runs/train-cnn")]
    out: PathBuf,
    /// Continue from `OUT/checkpoint.bin` (automatic after a launcher's restart:
    /// TORCHELASTIC_RESTART_COUNT, DDP_RESTART_COUNT or DDP_ROUND above 0 and a checkpoint
    /// there).
    #[arg(long)]
    resume: bool,
    /// Also save a checkpoint every N optimizer steps (0: only after each epoch); a resumed
    /// run continues at the exact batch.
    #[arg(long, default_value_t = 0, value_name = "N")]
    checkpoint_every_steps: u64,
    /// Synchronise BatchNorm statistics across ranks (SyncBatchNorm).
    #[arg(long)]
    sync_bn: bool,
    /// Shard the optimizer state across the ranks (ZeRO stage 1): each rank keeps the
    /// momentum of its own parameters only; the training is bitwise the same.
    #[arg(long)]
    shard_optimizer: bool,
    /// Device of each rank: auto (CUDA when built with it, else CPU), cpu, wgpu, cuda.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Gradients on the wire: none, bf16 or fp16 (16-bit values, f32 accumulation; default:
    /// `DDP_COMPRESSION`, else none).
    #[arg(long, value_name = "none|bf16|fp16")]
    compression: Option<ddp_comm::Compression>,
    /// Write this rank's timeline to DIR/rank-<R>.trace.json (as `DDP_TRACE=DIR`; under
    /// `ddprun --trace DIR` / `cargo xtask train --trace DIR` the launcher also merges the
    /// ranks into DIR/trace.json).
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Never draw the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Print nothing but errors (metrics, plot and checkpoint are still written).
    #[arg(long)]
    quiet: bool,
    /// Evaluate after the last epoch only (earlier epochs show no eval numbers).
    #[arg(long)]
    eval_last_only: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // wgpu's GL probe fails on machines without a GL driver and goes on with
                // Vulkan: not an error for the user.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new(format!(
                        "warn,{}",
                        burn_ddp::QUIET_WGPU_PROBE
                    ))
                }),
        )
        .with_ansi(ddp_comm::log::colour_wanted())
        .with_writer(std::io::stderr)
        .init();
    // Collectives inside Burn's forward and backward passes (SyncBatchNorm) can only fail by
    // panicking, e.g. when another rank died: one `train-cnn: error: …` line, no backtrace.
    burn_ddp::report_panics_as_errors("train-cnn");
    // `train-cnn bench …`: ResNet-18 steps timed (`cargo xtask bench resnet`), no training run.
    if std::env::args_os().nth(1).is_some_and(|a| a == "bench") {
        let args = train_cnn::bench::Args::parse_from(std::env::args_os().skip(1));
        return match train_cnn::bench::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("train-cnn bench: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = Args::parse();
    if let Some(dir) = &args.trace {
        // SAFETY: no other thread runs yet; the tracer reads the variable on first use.
        unsafe { std::env::set_var(ddp_comm::trace::TRACE_VAR, dir) };
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train-cnn: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), TrainError> {
    let cfg = TrainConfig {
        batch_size: args.batch_size,
        epochs: args.epochs,
        lr: args.lr,
        schedule: args.lr_schedule,
        seed: args.seed,
        data: args.data,
        synthetic_sizes: (args.train_size, args.eval_size),
        model: args.model,
        channels: args.channels,
        out: args.out,
        resume: args.resume,
        checkpoint_every_steps: args.checkpoint_every_steps,
        resume_if_present: burn_ddp::recovery::restarted(),
        progress: !args.no_progress && !args.quiet,
        quiet: args.quiet,
        eval_last_only: args.eval_last_only,
        shard_optimizer: args.shard_optimizer,
    };
    // Join the job the launcher describes (ddprun, torchrun, Slurm; a world of one when started
    // alone): rank, world size, the device of this rank, the process group.
    let ddp = join(args.backend, args.compression)?;
    if args.sync_bn {
        run_with::<SyncBatchNorm>(&ddp, &cfg)
    } else {
        run_with::<BatchNorm>(&ddp, &cfg)
    }
}

/// Which device each rank trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
enum Backend {
    /// CUDA device `LOCAL_RANK` when built with `cuda` and a CUDA device is usable, else the
    /// CPU (with a warning when built with `cuda`).
    #[default]
    Auto,
    /// The CPU backend (Flex).
    Cpu,
    /// CubeCL's CPU runtime (burn-cpu: kernels compiled by LLVM, SyncBatchNorm's CubeCL kernels
    /// included; build with `--features cpu`).
    BurnCpu,
    /// wgpu's default adapter (build with `--features wgpu`).
    Wgpu,
    /// CUDA device `LOCAL_RANK` (build with `--features cuda`); an error without one.
    Cuda,
}

/// `burn_ddp::init()` with this program's device and compression settings.
fn join(backend: Backend, compression: Option<ddp_comm::Compression>) -> Result<Ddp, TrainError> {
    // Under `ddprun --recover live` a lost rank is replaced while the others run; the loop
    // hands the replacement its state (`train::train`).
    let builder = Ddp::builder().live_recovery();
    let builder = match compression {
        Some(c) => builder.compression(c),
        None => builder,
    };
    let builder = match backend {
        Backend::Auto => builder,
        Backend::Cpu => builder.device(Device::flex()),
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => builder.device(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(not(feature = "wgpu"))]
        Backend::Wgpu => {
            return Err(TrainError::Config(
                "--backend wgpu needs train-cnn built with `--features wgpu`".into(),
            ));
        }
        #[cfg(feature = "cpu")]
        Backend::BurnCpu => builder.device(Device::cpu()),
        #[cfg(not(feature = "cpu"))]
        Backend::BurnCpu => {
            return Err(TrainError::Config(
                "--backend burn-cpu needs train-cnn built with `--features cpu`".into(),
            ));
        }
        // Without the `cuda` feature (`cargo xtask train --gpus N` builds with it), `init`
        // says so.
        Backend::Cuda => builder.cuda(),
    };
    Ok(builder.init()?)
}

fn run_with<N: NormLayer>(ddp: &Ddp, cfg: &TrainConfig) -> Result<(), TrainError> {
    let trained = train::train::<N>(ddp, cfg)?;
    if ddp.is_main() && !cfg.quiet {
        let p = &trained.paths;
        println!(
            "done: {} epochs; metrics {} and {}, plot {}, checkpoint {}",
            trained.history.len(),
            p.csv.display(),
            p.json.display(),
            p.plot.display(),
            p.checkpoint.display()
        );
    }
    Ok(())
}
