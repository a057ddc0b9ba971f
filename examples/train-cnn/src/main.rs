//! `train-cnn`: one rank of a data-parallel CNN training run.
//!
//! Run it alone (one process) or as N ranks under a launcher (`ddprun`, torchrun-style env).
//! Rank 0 shows a progress bar, prints the per-epoch table, writes `metrics.csv`,
//! `metrics.json`, `curves.svg` and `checkpoint.bin` under `--out`.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::nn::BatchNorm;
use burn_ddp::sync_batch_norm::SyncBatchNorm;
use clap::Parser;
use train_cnn::data::DataSpec;
use train_cnn::dist::{Backend, Cluster, DdpCluster};
use train_cnn::model::NormLayer;
use train_cnn::train::{self, LrSchedule, TrainConfig, TrainError};

/// Train a small CNN with BatchNorm on one rank of a data-parallel run.
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
    /// `synthetic` (embedded, generated) or `mnist:DIR` (IDX files, uncompressed).
    #[arg(long, default_value = "synthetic")]
    data: DataSpec,
    /// Synthetic training images.
    #[arg(long, default_value_t = 10000)]
    train_size: usize,
    /// Synthetic evaluation images.
    #[arg(long, default_value_t = 2000)]
    eval_size: usize,
    /// Output channels of the conv blocks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,32")]
    channels: Vec<usize>,
    /// Output directory (metrics, plot, checkpoint).
    #[arg(long, default_value = "runs/train-cnn")]
    out: PathBuf,
    /// Continue from `OUT/checkpoint.bin`.
    #[arg(long)]
    resume: bool,
    /// Synchronise BatchNorm statistics across ranks (SyncBatchNorm).
    #[arg(long)]
    sync_bn: bool,
    /// Device of each rank: auto (CUDA when built with it, else CPU), cpu, wgpu, cuda.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Never draw the progress bar.
    #[arg(long)]
    no_progress: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
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
        channels: args.channels,
        out: args.out,
        resume: args.resume,
        progress: !args.no_progress,
    };
    let mut cluster = DdpCluster::from_env(args.backend)?;
    if args.sync_bn {
        run_with::<SyncBatchNorm, _>(&mut cluster, &cfg)
    } else {
        run_with::<BatchNorm, _>(&mut cluster, &cfg)
    }
}

fn run_with<N: NormLayer, C: Cluster>(
    cluster: &mut C,
    cfg: &TrainConfig,
) -> Result<(), TrainError> {
    let trained = train::train::<N, C>(cluster, cfg)?;
    if cluster.is_main() {
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
