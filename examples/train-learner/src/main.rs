//! A burn-train program, written as a Burn user writes one — a model with `TrainStep` and
//! `InferenceStep`, `ClassificationOutput`, loss and accuracy metrics, `SupervisedTraining`
//! with checkpoints — made data-parallel by burn-ddp only where it must be: `burn_ddp::init`,
//! `replicate_model`, `DdpModel`, the sharded loaders, checkpointers and a renderer on rank 0.
//!
//! ```text
//! cargo run -p train-learner -- --out runs/learner                  # one process
//! ddprun --nproc-per-node 2 -- target/debug/train-learner --batch-size 16 --out runs/learner
//! ```
//!
//! The data are three interleaved spirals in the plane (generated, no download); the model an
//! MLP with tanh activations, trained with SGD. On N ranks with `--batch-size b` it takes the
//! steps one process takes with batch N·b (see tests/equivalence.rs). Rank 0 prints one line
//! per epoch and split ([`burn_ddp::EpochLineRenderer`]): burn-train's full-screen interface
//! needs its `tui` feature and a terminal of its own, which several ranks cannot share; the
//! other ranks print nothing.
//!
//! **A lost rank**: the job restarts from its last checkpoint on its own. Under `ddprun
//! --max-restarts K` the launcher starts the group again, and every rank resumes after the last
//! epoch rank 0 checkpointed completely ([`LearnerCheckpoints`]: rank 0 writes, every rank
//! reads), the train loader set to the next epoch: the job ends bitwise as the job never killed
//! (tests/restart.rs), having lost the epoch that was running. Live recovery (`ddprun --recover
//! live`) does not cover a `Learner` job: burn-train 0.22.1's `TrainStep::optimize` cannot
//! return an error and its loop gives no place to recover a failed step (docs/failures.md
//! names the missing calls). A replacement started for this program stops at `init` with one
//! line saying to run with `--recover restart` instead; a loop of one's own gets live recovery
//! from `burn_ddp::recovery::LiveTraining`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Tanh};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::data::ShardedDataLoaderBuilder;
use burn_ddp::learner::LearnerCheckpoints;
use burn_ddp::{DdpModel, EpochLineRenderer, SilentRenderer};
use clap::Parser;

const CLASSES: usize = 3;

#[derive(Debug, Parser)]
#[command(about = "A burn-train Learner program, data-parallel with burn-ddp")]
struct Args {
    /// Epochs.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Items per batch on each rank (the global batch is this times the ranks).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// SGD's learning rate.
    #[arg(long, default_value_t = 0.2)]
    lr: f64,
    /// Training points (validation: a quarter as many more).
    #[arg(long, default_value_t = 3000)]
    train_size: usize,
    /// Seed of the weights and of the shuffling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// burn-train's artifacts (rank 0's checkpoints under `checkpoint/`, each rank's logs) and
    /// `params.f32`, rank 0's final parameters.
    #[arg(long, default_value = "runs/learner")]
    out: PathBuf,
}

/// An MLP of two hidden tanh layers.
#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    out: Linear,
    act: Tanh,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(2, 32).init(device),
            fc2: LinearConfig::new(32, 32).init(device),
            out: LinearConfig::new(32, CLASSES).init(device),
            act: Tanh::new(),
        }
    }

    fn classify(&self, batch: Points) -> ClassificationOutput {
        let h = self.act.forward(self.fc1.forward(batch.x));
        let h = self.act.forward(self.fc2.forward(h));
        let output = self.out.forward(h);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.y.clone());
        ClassificationOutput {
            loss,
            output,
            targets: batch.y,
        }
    }
}

impl TrainStep for Mlp {
    type Input = Points;
    type Output = ClassificationOutput;

    fn step(&self, batch: Points) -> TrainOutput<ClassificationOutput> {
        let out = self.classify(batch);
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

impl InferenceStep for Mlp {
    type Input = Points;
    type Output = ClassificationOutput;

    fn step(&self, batch: Points) -> ClassificationOutput {
        self.classify(batch)
    }
}

/// A batch of points and their classes.
#[derive(Debug, Clone)]
struct Points {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

/// Point `i` of the three spirals: its class is `i % 3`; its place along the arm and its
/// jitter come from a fixed scramble of `i` (no RNG state: every rank computes the same point,
/// and training and validation indices follow one distribution).
fn point(i: usize) -> ([f32; 2], usize) {
    let class = i % CLASSES;
    let h = (i as u64 ^ 0x5DEE_CE66).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let along = (h >> 40) as f32 / (1u64 << 24) as f32;
    let jitter = ((h >> 16) & 0xFFFF) as f32 / 65536.0 - 0.5;
    let angle = along * 4.0 + class as f32 * std::f32::consts::TAU / CLASSES as f32 + 0.3 * jitter;
    ([along * angle.cos(), along * angle.sin()], class)
}

/// Turns point indices into a batch.
#[derive(Debug, Clone)]
struct SpiralBatcher;

impl Batcher<usize, Points> for SpiralBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Points {
        let n = items.len();
        let (xs, ys): (Vec<[f32; 2]>, Vec<i64>) = items
            .into_iter()
            .map(|i| {
                let (x, c) = point(i);
                (x, c as i64)
            })
            .unzip();
        Points {
            x: Tensor::from_data(TensorData::new(xs.concat(), [n, 2]), device),
            y: Tensor::from_data(TensorData::new(ys, [n]), device),
        }
    }
}

/// Every parameter's values, in the module's order.
fn flatten(module: &impl Module) -> Vec<f32> {
    struct Flat(Vec<f32>);
    impl ModuleVisitor for Flat {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = param.val().into_data().convert::<f32>();
            self.0.extend(values.iter::<f32>());
        }
    }
    let mut flat = Flat(Vec::new());
    module.visit(&mut flat);
    flat.0
}

fn run(args: &Args) -> Result<(), String> {
    let ddp = burn_ddp::init().map_err(|e| e.to_string())?;
    let device = ddp.device().clone().autodiff();
    device.seed(args.seed);
    let model = ddp
        .replicate_model(Mlp::new(&device))
        .map_err(|e| e.to_string())?;

    let train = ShardedDataLoaderBuilder::new(SpiralBatcher)
        .batch_size(args.batch_size)
        .seed(args.seed)
        .build_for(InMemDataset::new((0..args.train_size).collect()), &ddp)
        .map_err(|e| e.to_string())?;
    let valid_items = (args.train_size..args.train_size + args.train_size / 4).collect();
    let valid = ShardedDataLoaderBuilder::new(SpiralBatcher)
        .batch_size(args.batch_size)
        .shuffle(false)
        .build_for(InMemDataset::new(valid_items), &ddp)
        .map_err(|e| e.to_string())?;

    // Rank 0 writes the checkpoints; after a restart every rank resumes from them.
    let checkpoints = LearnerCheckpoints::open(
        &ddp,
        args.out.join("checkpoint"),
        burn_ddp::recovery::restarted(),
    )
    .map_err(|e| e.to_string())?;
    if let Some(epoch) = checkpoints.resume_epoch() {
        train.set_epoch(epoch as u64);
        if ddp.is_main() {
            eprintln!("train-learner: restarted, resuming after epoch {epoch}");
        }
    }

    // Each rank its own artifact directory: burn-train writes its logs there.
    let dir = args.out.join(format!("rank{}", ddp.rank()));
    let learner = Learner::new(DdpModel::new(&ddp, model), SgdConfig::new().init(), args.lr);
    let mut training = SupervisedTraining::new(&dir, Arc::new(train), Arc::new(valid))
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs);
    training = checkpoints.apply(training);
    training = if ddp.is_main() {
        training.renderer(Box::new(EpochLineRenderer::new()))
    } else {
        training.renderer(Box::new(SilentRenderer))
    };
    let result = training.launch(learner);
    if let Some(e) = result.error {
        return Err(format!("training failed: {e}"));
    }
    let model = result.model.into_inner();
    if ddp.is_main() {
        let bytes: Vec<u8> = flatten(&model)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let path = args.out.join("params.f32");
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    ddp.barrier().map_err(|e| e.to_string())
}

/// README.md's burn-train block, compiled here against this program's model and loaders
/// (`build.rs` copies it out of the README): a README edit that no longer compiles fails this
/// build. Never called: it would train for ten epochs.
#[allow(dead_code, unused_variables)]
fn readme_snippet(
    device: Device,
    train: Arc<burn_ddp::data::ShardedDataLoader<usize, Points>>,
    valid: Arc<burn_ddp::data::ShardedDataLoader<usize, Points>>,
) -> Result<(), burn_ddp::DdpError> {
    use burn::optim::AdamConfig;
    type MyModel = Mlp;
    include!(concat!(env!("OUT_DIR"), "/readme_learner.rs"));
    Ok(())
}

fn main() -> ExitCode {
    burn_ddp::report_panics_as_errors("train-learner");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train-learner: {e}");
            ExitCode::FAILURE
        }
    }
}
