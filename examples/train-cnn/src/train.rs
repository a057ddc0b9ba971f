//! The training loop: epochs of sharded batches, evaluation, metrics, plot and checkpoints.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use burn_ddp::data::ShardedDataLoaderBuilder;
use burn_ddp::{Ddp, DdpError, DdpOptimizer};
use ddp_comm::ReduceOp;

use burn_ddp::checkpoint::{Checkpointer, Progress};
use burn_ddp::data::LoaderState;

use crate::checkpoint::{self, CheckpointError, CheckpointMeta, PartialEpoch};
use crate::data::{self, DataError, DataSpec, ImageBatch, ImageBatcher, ImageSet, Splits};
use crate::metrics::{self, EpochMetrics};
use crate::model::{ModelConfig, ModelKind, Net, NormLayer};
use crate::plot::{self, PlotError};

/// Settings of one training run (the program's arguments).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Samples per batch on each rank (the global batch is this × world size).
    pub batch_size: usize,
    /// Total number of epochs (a resumed run continues up to this number).
    pub epochs: usize,
    /// SGD learning rate (momentum 0.9): the peak of the schedule.
    pub lr: f64,
    /// How the learning rate changes over the run.
    pub schedule: LrSchedule,
    /// Seed of the model initialisation, the synthetic data and the data order.
    pub seed: u64,
    /// The dataset.
    pub data: DataSpec,
    /// Sizes of the synthetic train and eval splits.
    pub synthetic_sizes: (usize, usize),
    /// The network.
    pub model: ModelKind,
    /// Output channels of the small CNN's conv blocks.
    pub channels: Vec<usize>,
    /// Directory for metrics, plot and checkpoint.
    pub out: PathBuf,
    /// Continue from `out/checkpoint.bin`.
    pub resume: bool,
    /// Also save a checkpoint every this many optimizer steps (0: only after each epoch); a
    /// run resumed from one continues at the exact batch.
    pub checkpoint_every_steps: u64,
    /// Continue from `out/checkpoint.bin` when rank 0 finds one there, start afresh otherwise
    /// (set when a launcher restarted the job: the failed attempt's checkpoint is resumed).
    pub resume_if_present: bool,
    /// Show the progress bar (rank 0 only, and only on a terminal).
    pub progress: bool,
    /// Print nothing on stdout (the metrics files, plot and checkpoint are still written):
    /// for programs that run many trainings, such as `cargo xtask compare`.
    pub quiet: bool,
    /// Evaluate after the last epoch only (the others' eval columns are NaN): a large eval
    /// split then costs one pass, not one per epoch.
    pub eval_last_only: bool,
    /// Shard the optimizer state across the ranks (ZeRO stage 1, [`DdpOptimizer::sharded`]):
    /// the same training, each rank holding the momentum of its own parameters only.
    pub shard_optimizer: bool,
}

impl TrainConfig {
    /// Small defaults for the synthetic dataset.
    pub fn new(out: impl Into<PathBuf>) -> Self {
        Self {
            batch_size: 32,
            epochs: 4,
            lr: 0.02,
            schedule: LrSchedule::Cosine,
            seed: 42,
            data: DataSpec::Synthetic,
            synthetic_sizes: (10000, 2000),
            model: ModelKind::Cnn,
            channels: vec![16, 32, 32],
            out: out.into(),
            resume: false,
            checkpoint_every_steps: 0,
            resume_if_present: false,
            progress: true,
            quiet: false,
            eval_last_only: false,
            shard_optimizer: false,
        }
    }
}

/// How the learning rate changes over a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LrSchedule {
    /// Cosine decay from `lr` at the first step towards 0 after the last one
    /// (`lr · (1 + cos(π · step / steps)) / 2`), a pure function of the global step, so a
    /// resumed run continues the same curve.
    #[default]
    Cosine,
    /// `lr` at every step.
    Constant,
}

impl LrSchedule {
    /// The name `--lr-schedule` takes.
    pub fn name(self) -> &'static str {
        match self {
            LrSchedule::Cosine => "cosine",
            LrSchedule::Constant => "constant",
        }
    }

    /// The learning rate at 0-based global step `step` of `steps`.
    ///
    /// ```
    /// use train_cnn::train::LrSchedule;
    /// assert_eq!(LrSchedule::Cosine.at(0.1, 0, 10), 0.1);
    /// assert!((LrSchedule::Cosine.at(0.1, 5, 10) - 0.05).abs() < 1e-12);
    /// assert_eq!(LrSchedule::Constant.at(0.1, 9, 10), 0.1);
    /// ```
    pub fn at(self, lr: f64, step: usize, steps: usize) -> f64 {
        match self {
            LrSchedule::Constant => lr,
            LrSchedule::Cosine => {
                let progress = step as f64 / steps.max(1) as f64;
                lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad settings.
    #[error("invalid settings: {0}")]
    Config(String),
    /// Dataset problem.
    #[error(transparent)]
    Data(#[from] DataError),
    /// Checkpoint problem.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The job failed: a collective, a peer, the device or the process group.
    #[error("distributed: {0}")]
    Ddp(DdpError),
    /// The sharded loader (a bad setting, or a batch that didn't arrive in time).
    #[error("training data: {0}")]
    Loader(#[from] burn_ddp::data::DataError),
    /// Output files.
    #[error("writing {path}: {source}")]
    Output {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The plot.
    #[error(transparent)]
    Plot(#[from] PlotError),
}

impl TrainError {
    /// Whether a peer's loss caused this error: what live recovery recovers from
    /// ([`DdpError::lost_a_peer`]).
    pub fn lost_a_peer(&self) -> bool {
        matches!(self, TrainError::Ddp(e) if e.lost_a_peer())
    }
}

impl burn_ddp::recovery::MaybeLostPeer for TrainError {
    fn lost_a_peer(&self) -> bool {
        TrainError::lost_a_peer(self)
    }
}

impl From<burn_ddp::DdpError> for TrainError {
    fn from(e: burn_ddp::DdpError) -> Self {
        match e {
            burn_ddp::DdpError::Checkpoint(e) => TrainError::Checkpoint(e),
            e => TrainError::Ddp(e),
        }
    }
}

/// Where a run wrote its outputs.
#[derive(Debug, Clone)]
pub struct OutputPaths {
    /// Per-epoch metrics as CSV.
    pub csv: PathBuf,
    /// Per-epoch metrics as JSON.
    pub json: PathBuf,
    /// Loss and accuracy curves.
    pub plot: PathBuf,
    /// The latest checkpoint.
    pub checkpoint: PathBuf,
}

impl OutputPaths {
    /// The files under `out`.
    pub fn under(out: &Path) -> Self {
        Self {
            csv: out.join("metrics.csv"),
            json: out.join("metrics.json"),
            plot: out.join("curves.svg"),
            checkpoint: out.join(checkpoint::FILE_NAME),
        }
    }
}

/// The result of a run.
#[derive(Debug)]
pub struct Trained<N> {
    /// The trained model.
    pub model: Net<N>,
    /// Metrics of every epoch (including those before a resume).
    pub history: Vec<EpochMetrics>,
    /// The epoch the run resumed after, if it resumed.
    pub resumed_after: Option<usize>,
    /// The output files.
    pub paths: OutputPaths,
}

/// Trains the network `cfg.model` with norm layer `N` on this rank of the job `ddp` as `cfg` says (a world of
/// one when the program was started alone).
///
/// Every rank calls this; rank 0 alone shows progress and writes files.
///
/// The model is initialised on the CPU from Burn's generator seeded with `cfg.seed`, whatever
/// the training device (each backend's generator draws other numbers, and a run on CUDA must
/// start from the weights of the same run on the CPU), then moved to the device and replaced by
/// rank 0's weights on every rank. Another thread drawing random numbers at the same time
/// perturbs that stream, so run one training per process when reproducibility matters.
pub fn train<N: NormLayer>(ddp: &Ddp, cfg: &TrainConfig) -> Result<Trained<N>, TrainError> {
    if cfg.batch_size == 0 {
        return Err(TrainError::Config("--batch-size must be at least 1".into()));
    }
    if !(cfg.lr.is_finite() && cfg.lr > 0.0) {
        return Err(TrainError::Config(format!(
            "--lr {} must be positive",
            cfg.lr
        )));
    }
    let splits = data::open(&cfg.data, cfg.seed, cfg.synthetic_sizes)?;
    let (rows, cols) = splits.dims();
    let model_cfg = ModelConfig::new(
        cfg.model,
        &cfg.channels,
        (data::CHANNELS, rows, cols),
        splits.num_classes(),
    );
    model_cfg.validate().map_err(TrainError::Config)?;
    let world = ddp.world_size();
    let shard_len = splits.train.0.len().div_ceil(world);
    let batches_per_epoch = shard_len / cfg.batch_size;
    if batches_per_epoch == 0 {
        return Err(TrainError::Config(format!(
            "--batch-size {} is larger than this rank's {shard_len} training samples",
            cfg.batch_size
        )));
    }

    let device = ddp.device().clone().autodiff();
    device.seed(cfg.seed);
    let init_device = Device::flex().autodiff();
    init_device.seed(cfg.seed);
    let mut model: Net<N> = model_cfg.init(&init_device);
    if init_device != device {
        // Parameters are drawn lazily, on first use: draw them here, on the CPU, first; then
        // `fork` moves them as trainable leaves (`to_device` would record the move in the
        // autodiff graph, which the first backward pass then consumes).
        initialise_now(&model);
        model = model.fork(&device);
    }
    let sgd = SgdConfig::new().with_momentum(Some(MomentumConfig {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
    }));
    let mut optim = if cfg.shard_optimizer {
        DdpOptimizer::sharded(ddp, sgd.init())
    } else {
        DdpOptimizer::new(ddp, sgd.init())
    };
    let paths = OutputPaths::under(&cfg.out);
    if ddp.is_main() {
        std::fs::create_dir_all(&cfg.out).map_err(|source| TrainError::Output {
            path: cfg.out.clone(),
            source,
        })?;
    }

    // Every rank starts from rank 0's model; a resume then gives every rank the checkpoint's
    // parameters and its own buffers (per-rank BatchNorm statistics).
    let mut model = ddp.replicate_model(model)?;
    let ckpt = Checkpointer::new(&cfg.out).every_steps(cfg.checkpoint_every_steps);
    let meta_of = |seed: u64,
                   history: Vec<EpochMetrics>,
                   partial: Option<PartialEpoch>,
                   saved_at_step: Option<u64>| CheckpointMeta {
        seed,
        model: model_cfg.clone(),
        norm: N::NAME.to_string(),
        batch_size: cfg.batch_size,
        lr: cfg.lr,
        schedule: (cfg.schedule.name().to_string(), cfg.epochs),
        data: cfg.data.to_string(),
        history,
        partial,
        saved_at_step,
    };
    // A process started in place of a lost rank (`ddprun --recover live`) takes the survivors'
    // state from their memory (in `LiveStart::start` below), not from the checkpoint.
    let resume = !ddp.is_replacement()
        && (cfg.resume || (cfg.resume_if_present && ckpt.exists(ddp.group())?));
    let mut resumed_at = None;
    let mut meta = meta_of(cfg.seed, Vec::new(), None, None);
    if resume {
        let Some(ck) = ckpt.read::<CheckpointMeta>(ddp.group())? else {
            return Err(CheckpointError::Io {
                path: paths.checkpoint.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "--resume: rank 0 finds no checkpoint there",
                ),
            }
            .into());
        };
        if ck.metadata.model != model_cfg {
            return Err(TrainError::Config(format!(
                "the checkpoint holds {}, but these settings build {}",
                ck.metadata.model, model_cfg
            )));
        }
        let (restored, r) = ckpt.restore(ck, model, &mut optim)?;
        model = restored;
        warn_if_settings_differ(cfg, &r.metadata, r.world_size, world);
        tracing::info!(
            "resumed after {} epochs and {} steps",
            r.progress.epochs_done,
            r.progress.step
        );
        resumed_at = Some(r.progress);
        meta = r.metadata;
    }
    let resumed_after = resumed_at.map(|p| p.epochs_done as usize);
    let start_progress = resumed_at.unwrap_or(Progress {
        step: 0,
        epochs_done: 0,
        loader: Some(LoaderState::at_epoch(0)),
    });
    // From here on the run's state — model, optimizer, progress (step, loader position) and
    // `CheckpointMeta` (the metrics so far) — is `live`'s: under `ddprun --recover live` a lost
    // rank's replacement takes it from the survivors, and every step lost with a rank is redone.
    let mut live = ddp.live(model, optim).start(start_progress, meta)?;
    if ddp.is_main() && live.recoveries() > 0 {
        tracing::info!(
            step = live.progress().step,
            "took the survivors' state in place of a lost rank"
        );
    }
    let seed = live.state().seed;
    let start = live.state().history.len();
    let remaining = cfg.epochs.saturating_sub(start);
    let per_epoch_global = (batches_per_epoch * cfg.batch_size * world) as u64;
    let bar = progress_bar(
        ddp.is_main() && cfg.progress,
        per_epoch_global * remaining as u64,
    );
    if ddp.is_main() && !cfg.quiet {
        say(
            &bar,
            format!(
                "train-cnn: {} ranks × batch {} ({} with {} {}), {} train / {} eval images of {rows}×{cols}, {} parameters",
                world,
                cfg.batch_size,
                cfg.model.name(),
                N::NAME,
                cfg.data,
                splits.train.0.len(),
                splits.eval.0.len(),
                crate::model::trainable_params(live.model())
            ),
        );
        if remaining == 0 {
            say(
                &bar,
                format!(
                    "nothing to do: {start} of {} epochs already done",
                    cfg.epochs
                ),
            );
        }
    }

    let batcher = ImageBatcher { rows, cols };
    // burn-ddp's sharded loader: PyTorch's DistributedSampler order (seed + epoch, padded,
    // rank-strided), batches built by a background worker. Every rank has the same number of
    // items, so the same number of full batches; the partial batch at the end is dropped (a
    // batch of 1 has no BatchNorm statistics).
    let loader = ShardedDataLoaderBuilder::new(batcher)
        .batch_size(cfg.batch_size)
        .seed(seed)
        .drop_last_batch(true)
        .num_workers(1)
        .build(splits.train.clone(), ddp.rank(), world, device.clone())?;
    debug_assert_eq!(loader.num_batches(), batches_per_epoch);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    if let Some(state) = live.progress().loader {
        // A checkpoint from the middle of an epoch, or the survivors' position: continue that
        // epoch at its next batch.
        loader.load_state(state);
    }
    let mut header_printed = false;
    let mut printed = start;
    while live.state().history.len() < cfg.epochs {
        let epoch = live.state().history.len();
        let t0 = Instant::now();
        if loader.epoch() != epoch as u64 {
            loader.set_epoch(epoch as u64);
        }
        // Batches of this epoch done before this pass, counted at this world size from the
        // epoch's global sample position (a checkpoint of another world size continues the
        // epoch's data order from there, and the schedule from the same point).
        let state = loader.state();
        let skip = state.samples_done.map_or(state.batches_done, |done| {
            (done / (cfg.batch_size * world) as u64) as usize
        });
        let seconds_before = match live.state().partial {
            Some(p) if skip > 0 => p.seconds,
            _ => 0.0,
        };
        bar.set_position(
            (epoch - start) as u64 * per_epoch_global + (skip * cfg.batch_size * world) as u64,
        );
        let (mut sync_time, mut wait_time) = (Duration::ZERO, Duration::ZERO);
        for (j, batch) in loader.batches().enumerate() {
            let i = skip + j;
            let batch = batch?;
            // Between steps, at the top of the loop (where a replacement starts): the
            // checkpoint due after the step before, unless this state's was saved there.
            let step = live.progress().step;
            if i > 0 && ckpt.due_after_step(step) && live.state().saved_at_step != Some(step) {
                live.collective(|l| {
                    let meta = CheckpointMeta {
                        saved_at_step: Some(step),
                        ..l.state().clone()
                    };
                    ckpt.save(ddp.group(), l.model(), l.optimizer(), *l.progress(), &meta)
                })?;
                live.state_mut().saved_at_step = Some(step);
            }
            let lr = cfg
                .schedule
                .at(cfg.lr, step as usize, cfg.epochs * batches_per_epoch);
            let items = batch.targets.dims()[0];
            let n = items as f64;
            let mut loss_value = f64::NAN;
            // Forward and backward (SyncBatchNorm's exchange inside them), this step's sums over
            // all ranks, the gradients' synchronisation and the update; redone after a lost
            // rank. The sums are added in step order: the epoch's metrics are the same bits
            // whether or not a rank was replaced on the way.
            let summed = live.step(lr, |model, _| {
                let logits = model.forward(batch.images.clone());
                let correct = count_correct(logits.clone(), batch.targets.clone());
                let loss = loss_fn.forward(logits, batch.targets.clone());
                loss_value = loss.clone().into_scalar::<f32>() as f64;
                let grads = GradientsParams::from_grads(loss.backward(), model);
                (grads, [loss_value * n, correct as f64, n])
            })?;
            let st = live.optimizer().last_sync_stats();
            sync_time += st.total;
            wait_time += st.presence;
            if let Some(step_sums) = summed {
                let state = live.state_mut();
                let mut sums = state.partial.map_or([0.0; 3], |p| p.sums);
                for (sum, add) in sums.iter_mut().zip(step_sums) {
                    *sum += add;
                }
                state.partial = Some(PartialEpoch {
                    sums,
                    seconds: seconds_before + t0.elapsed().as_secs_f64(),
                });
            }
            let progress = live.progress_mut();
            progress.epochs_done = epoch as u64;
            progress.loader = Some(loader.state());
            bar.inc(items as u64 * world as u64);
            bar.set_message(format!(
                "epoch {}/{} loss {loss_value:.4} {:.0} samples/s",
                epoch + 1,
                cfg.epochs,
                bar.per_sec()
            ));
        }
        let train_seconds = seconds_before + t0.elapsed().as_secs_f64();
        let sums = live.state().partial.map_or([0.0; 3], |p| p.sums);
        let end = Progress {
            step: ((epoch + 1) * batches_per_epoch) as u64,
            epochs_done: epoch as u64 + 1,
            loader: Some(LoaderState::at_epoch(epoch as u64 + 1)),
        };
        // The epoch's end, between steps: every rank's time in the gradient sync, the
        // evaluation, the metrics files and the checkpoint, as one collective of the program's
        // (made once whatever rank is lost in it).
        let ended = live.collective(|l| {
            // Mean over ranks of this epoch's time in gradient sync and in waiting.
            let mut comm = [sync_time.as_secs_f64(), wait_time.as_secs_f64()];
            sum_over_ranks(ddp, &mut comm)?;
            let (eval_loss, eval_accuracy) = if cfg.eval_last_only && epoch + 1 < cfg.epochs {
                (f64::NAN, f64::NAN)
            } else {
                evaluate(ddp, l.model(), &splits, &batcher, &device)?
            };
            let m = EpochMetrics {
                epoch: epoch + 1,
                train_loss: sums[0] / sums[2],
                train_accuracy: sums[1] / sums[2],
                eval_loss,
                eval_accuracy,
                samples_per_sec: sums[2] / train_seconds,
                seconds: t0.elapsed().as_secs_f64(),
                sync_seconds: comm[0] / world as f64,
                wait_seconds: comm[1] / world as f64,
            };
            let mut history = l.state().history.clone();
            history.push(m.clone());
            if ddp.is_main() {
                write_outputs(&paths, &history)?;
            }
            let meta = CheckpointMeta {
                history,
                partial: None,
                ..l.state().clone()
            };
            ckpt.save(ddp.group(), l.model(), l.optimizer(), end, &meta)?;
            Ok::<_, TrainError>(m)
        })?;
        if let Some(m) = ended {
            let state = live.state_mut();
            state.history.push(m);
            state.partial = None;
        }
        *live.progress_mut() = end;
        let history = &live.state().history;
        // Rank 0 prints each epoch's line once (a rank that had finished the epoch's end
        // before a loss took its metrics from the state).
        if ddp.is_main() && !cfg.quiet && history.len() > printed {
            let table = metrics::table(history);
            let mut lines = table.lines();
            let header = lines.next().unwrap_or_default();
            if !header_printed {
                say(&bar, header);
                header_printed = true;
            }
            say(&bar, lines.last().unwrap_or_default());
            printed = history.len();
        }
    }
    let (model, _, _, meta) = live.into_parts();
    let history = meta.history;
    bar.finish_and_clear();
    if ddp.is_main() && remaining == 0 {
        write_outputs(&paths, &history)?;
    }
    ddp.barrier()?;
    Ok(Trained {
        model,
        history,
        resumed_after,
        paths,
    })
}

/// Warns when a resumed run's settings differ from the checkpoint's (`meta`, written by
/// `saved_world` ranks): the optimisation then differs from an uninterrupted run.
fn warn_if_settings_differ(
    cfg: &TrainConfig,
    meta: &CheckpointMeta,
    saved_world: usize,
    world: usize,
) {
    // (schedule, epochs it spans); a constant rate spans nothing.
    let span = |name: &str, epochs: usize| {
        let epochs = if name == LrSchedule::Constant.name() {
            0
        } else {
            epochs
        };
        (name.to_string(), epochs)
    };
    let saved = span(&meta.schedule.0, meta.schedule.1);
    let now = span(cfg.schedule.name(), cfg.epochs);
    if meta.lr != cfg.lr || saved != now {
        tracing::warn!(
            "resuming a run trained with lr {} ({} schedule over {} epochs) with lr {} ({} over {} epochs): the learning rates differ from an uninterrupted run",
            meta.lr,
            saved.0,
            saved.1,
            cfg.lr,
            now.0,
            now.1
        );
    }
    if meta.batch_size != cfg.batch_size || saved_world != world {
        tracing::warn!(
            "resuming a run of {saved_world} ranks × batch {} with {world} ranks × batch {}: the global batch, so the optimisation, differs from an uninterrupted run (the epoch's data continues at its global sample position)",
            meta.batch_size,
            cfg.batch_size
        );
    }
}

/// Prints a line on stdout without tearing the progress bar.
fn say(bar: &ProgressBar, line: impl AsRef<str>) {
    bar.suspend(|| println!("{}", line.as_ref()));
}

fn progress_bar(show: bool, total: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("[{bar:20}] {percent:>3}% {msg} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

fn make_batch(
    batcher: &ImageBatcher,
    set: &dyn ImageSet,
    idx: &[usize],
    device: &Device,
) -> ImageBatch {
    let items = idx.iter().map(|&i| set.item(i)).collect();
    batcher.batch(items, device)
}

fn count_correct(
    logits: burn::tensor::Tensor<2>,
    targets: burn::tensor::Tensor<1, burn::tensor::Int>,
) -> i64 {
    let pred = logits.argmax(1).flatten::<1>(0, 1);
    pred.equal(targets).int().sum().into_scalar::<i64>()
}

/// Eval loss and accuracy over the whole eval split: rank `r` takes items `r, r + W, …` (no
/// padding, so nothing is counted twice) and the sums are added across ranks.
fn evaluate<N: NormLayer>(
    ddp: &Ddp,
    model: &Net<N>,
    splits: &Splits,
    batcher: &ImageBatcher,
    device: &Device,
) -> Result<(f64, f64), TrainError> {
    let model = model.valid();
    let device = device.clone().without_autodiff();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mine: Vec<usize> = (ddp.rank()..splits.eval.0.len())
        .step_by(ddp.world_size())
        .collect();
    let mut sums = [0f64; 3];
    for chunk in mine.chunks(256) {
        let batch = make_batch(batcher, &*splits.eval.0, chunk, &device);
        let logits = model.forward(batch.images);
        sums[1] += count_correct(logits.clone(), batch.targets.clone()) as f64;
        let loss = loss_fn.forward(logits, batch.targets).into_scalar::<f32>() as f64;
        sums[0] += loss * chunk.len() as f64;
        sums[2] += chunk.len() as f64;
    }
    sum_over_ranks(ddp, &mut sums)?;
    Ok((sums[0] / sums[2], sums[1] / sums[2]))
}

/// Element-wise sum of `values` over all ranks, in place (rank order: the same bits on every
/// rank).
fn sum_over_ranks(ddp: &Ddp, values: &mut [f64]) -> Result<(), TrainError> {
    ddp.with_group(|pg| pg.all_reduce(values, ReduceOp::Sum))
        .map_err(|e| TrainError::Ddp(e.into()))
}

fn write_outputs(paths: &OutputPaths, history: &[EpochMetrics]) -> Result<(), TrainError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::Output { path, source }
    };
    metrics::write_csv(&paths.csv, history).map_err(io(&paths.csv))?;
    metrics::write_json(&paths.json, history).map_err(io(&paths.json))?;
    plot::write_svg(&paths.plot, history)?;
    Ok(())
}

/// Draws every lazily initialised parameter of `model` now, on the device it was built on.
fn initialise_now<M: Module>(model: &M) {
    struct Touch;
    impl burn::module::ModuleVisitor for Touch {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            let _ = param.val();
        }
    }
    model.visit(&mut Touch);
}
