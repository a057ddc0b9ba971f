//! Rank program for the sharded-optimizer tests (`tests/sharded.rs`).
//!
//! Trains a small network with SyncBatchNorm, a branch only rank 1's samples use and a layer
//! no sample uses, on deterministic synthetic data, with [`DdpOptimizer::sharded`] (`--shard`)
//! or [`DdpOptimizer::new`]; after every step all ranks check that their parameters are
//! bitwise identical. Writes this rank's final parameters, SyncBatchNorm's running statistics
//! among them, to `OUT/rank{r}.f32` and prints
//! `STATE rank={r} bytes={n}`, the size of the optimizer state the rank holds.
//!
//! `--clip-norm X` clips the averaged gradients to the global norm X and prints `GRADNORM
//! rank={r} step={k} norm={n}` (the norm before clipping) after each step. `--shard-after K` starts unsharded and turns the optimizer, its state built, into a sharded
//! one after step K. `--report-steps` prints `STEP K` after each step (the test that kills a rank mid-training
//! waits for it); panics are reported as one `shard_worker: error: …` line.
//!
//! Checkpoints: `--save-at K` saves after step K into `OUT/ckpt.bin`, then throws the model
//! and the optimizer away, builds new ones (other random weights, sharded or not as
//! `--resume-unsharded` says) and resumes from the file. `--resume-from FILE` starts from a
//! checkpoint another job wrote (possibly at another world size).

use std::path::PathBuf;
use std::process::ExitCode;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{
    AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig, momentum::MomentumConfig,
};
use burn::tensor::{Device, Tensor};
use burn_ddp::checkpoint::{Checkpointer, Progress};
use burn_ddp::sync_batch_norm::{SyncBatchNorm, SyncBatchNormConfig};
use burn_ddp::{Ddp, DdpOptimizer};
use clap::{Parser, ValueEnum};
use ddp_tests::{check_identical, flatten, write_f32};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Optim {
    /// SGD with momentum 0.9 and weight decay.
    Sgd,
    /// Adam.
    Adam,
}

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum)]
    optim: Optim,
    /// Shard the optimizer state.
    #[arg(long)]
    shard: bool,
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Per-rank batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Gradient bucket cap in bytes (also the parameter all-gather's).
    #[arg(long, default_value_t = 256)]
    bucket_bytes: usize,
    /// Width of the hidden layer (a wide one gives gradients that take the collectives'
    /// large, non-inline path).
    #[arg(long, default_value_t = 10)]
    hidden: usize,
    /// Save a checkpoint after this step, then resume from it with a new model and optimizer.
    #[arg(long)]
    save_at: Option<u64>,
    /// The optimizer built to resume after `--save-at` (or to load `--resume-from`) is not
    /// sharded (with `--shard`) or sharded (without).
    #[arg(long)]
    resume_unsharded: bool,
    /// Start from this checkpoint.
    #[arg(long)]
    resume_from: Option<PathBuf>,
    /// Clip the averaged gradients to this global norm (`with_global_norm_clipping`).
    #[arg(long)]
    clip_norm: Option<f64>,
    /// Start unsharded and shard the optimizer (`DdpOptimizer::into_sharded`, its state
    /// already built) after this step.
    #[arg(long)]
    shard_after: Option<u64>,
    /// Print `STEP K` after each step (a test waits for it before killing a rank).
    #[arg(long)]
    report_steps: bool,
    #[arg(long)]
    out: PathBuf,
}

const IN: usize = 6;
const OUT: usize = 3;
const LR: f64 = 0.05;

#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    bn: SyncBatchNorm,
    fc2: Linear,
    /// Used by rank 1's samples only.
    branch: Linear,
    /// Used by no sample: no gradient on any rank, never stepped.
    never: Linear,
    act: Relu,
}

impl Net {
    fn new(hidden: usize, device: &Device) -> Self {
        Net {
            fc1: LinearConfig::new(IN, hidden).init(device),
            bn: SyncBatchNormConfig::new(hidden).init(device),
            fc2: LinearConfig::new(hidden, OUT).init(device),
            branch: LinearConfig::new(hidden, OUT).init(device),
            never: LinearConfig::new(hidden, OUT).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>, use_branch: bool) -> Tensor<2> {
        let [n, _] = x.dims();
        let hidden = self.fc1.weight.dims()[1];
        let h = self.fc1.forward(x).reshape([n, hidden, 1]);
        let h = self.act.forward(self.bn.forward(h).reshape([n, hidden]));
        let y = self.fc2.forward(h.clone());
        if use_branch {
            y + self.branch.forward(h)
        } else {
            y
        }
    }
}

/// Rank `rank`'s batch of step `step` (`ddp_tests::sample`).
fn batch(
    step: u64,
    rank: usize,
    world: usize,
    b: usize,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let start = (step as usize * world + rank) * b;
    ddp_tests::batch::<IN, OUT>(start..start + b, device)
}

fn optimizer(ddp: &Ddp, args: &Args, shard: bool) -> Result<DdpOptimizer, String> {
    let optim = optimizer_of(ddp, args.optim, shard);
    match args.clip_norm {
        Some(max) => optim
            .with_global_norm_clipping(max)
            .map_err(|e| e.to_string()),
        None => Ok(optim),
    }
}

fn optimizer_of(ddp: &Ddp, o: Optim, shard: bool) -> DdpOptimizer {
    let inner: ModuleOptimizer = match o {
        Optim::Sgd => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(1e-3)))
            .init(),
        Optim::Adam => AdamConfig::new().init(),
    };
    if shard {
        DdpOptimizer::sharded(ddp, inner)
    } else {
        DdpOptimizer::new(ddp, inner)
    }
}

/// A new model (weights seeded by `seed`, then rank 0's broadcast) and optimizer, resumed
/// from `ckpt`; the step to continue from.
fn resume(
    ddp: &Ddp,
    args: &Args,
    ckpt: &Checkpointer,
    seed: u64,
    shard: bool,
) -> Result<(Net, DdpOptimizer, u64), String> {
    let device = ddp.device().clone().autodiff();
    device.seed(seed);
    let model = ddp
        .replicate_model(Net::new(args.hidden, &device))
        .map_err(|e| e.to_string())?;
    let mut optim = optimizer(ddp, args, shard)?;
    let (model, resumed) = ckpt
        .load::<_, ()>(ddp, model, &mut optim)
        .map_err(|e| e.to_string())?;
    let step = resumed.ok_or("no checkpoint to resume from")?.progress.step;
    Ok((model, optim, step))
}

fn run(args: &Args) -> Result<(), String> {
    let ddp = Ddp::builder()
        .device(Device::flex())
        .bucket_cap_bytes(args.bucket_bytes)
        .init()
        .map_err(|e| e.to_string())?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let device = ddp.device().clone().autodiff();
    let resumed_shard = args.shard != args.resume_unsharded;
    let (mut model, mut optim, mut step) = match &args.resume_from {
        Some(path) => resume(
            &ddp,
            args,
            &Checkpointer::at(path),
            3000 + rank as u64,
            resumed_shard,
        )?,
        None => {
            device.seed(1000 + rank as u64);
            let model = ddp
                .replicate_model(Net::new(args.hidden, &device))
                .map_err(|e| e.to_string())?;
            (model, optimizer(&ddp, args, args.shard)?, 0)
        }
    };
    let ckpt = Checkpointer::at(args.out.join("ckpt.bin"));
    while step < args.steps {
        let (x, y) = batch(step, rank, world, args.batch, &device);
        let loss = (model.forward(x, rank == 1) - y).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim
            .try_step(LR, model, grads)
            .map_err(|e| e.to_string())?;
        step += 1;
        if args.shard_after == Some(step) {
            optim = optim.into_sharded();
        }
        check_identical(&ddp, &model, step as usize)?;
        if args.report_steps {
            println!("STEP {step}");
        }
        if let Some(norm) = optim.last_grad_norm() {
            println!("GRADNORM rank={rank} step={step} norm={norm:e}");
        }
        if args.save_at == Some(step) {
            ckpt.save(
                &ddp,
                &model,
                &optim,
                Progress {
                    step,
                    ..Progress::default()
                },
                &(),
            )
            .map_err(|e| e.to_string())?;
            drop((model, optim));
            let resumed = resume(&ddp, args, &ckpt, 2000 + rank as u64, resumed_shard)?;
            (model, optim) = (resumed.0, resumed.1);
            if resumed.2 != step {
                return Err(format!("resumed at step {}, saved at {step}", resumed.2));
            }
        }
    }
    let bytes = optim.state_size_bytes().map_err(|e| e.to_string())?;
    println!("STATE rank={rank} bytes={bytes}");
    if let Some(s) = optim.last_shard_stats() {
        println!(
            "SHARD rank={rank} owned_params={} of {} owned_bytes={} of {}",
            s.owned_params, s.params, s.owned_bytes, s.total_bytes
        );
    }
    // The running statistics of the last step: Burn keeps its last update pending, and a visit
    // reads the one before (only here: the per-step check must not commit, or it would hide a
    // checkpoint that saves the older value).
    let _committed = model.valid();
    write_f32(&args.out.join(format!("rank{rank}.f32")), &flatten(&model))
        .map_err(|e| e.to_string())?;
    ddp.barrier().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    burn_ddp::report_panics_as_errors("shard_worker");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shard_worker error: {e}");
            ExitCode::FAILURE
        }
    }
}
