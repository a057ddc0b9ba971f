//! burn-train integration: [`DdpModel`], a model wrapper whose `TrainStep::optimize` averages
//! gradients across ranks before the optimizer steps.
//!
//! # Using it with `SupervisedTraining`
//!
//! Every rank runs the same program and builds the same `Learner`; only the model is
//! wrapped, and each rank's data loader yields its own shard (same number of batches on every
//! rank):
//!
//! ```ignore
//! let ddp = burn_ddp::init()?;
//! let model = ddp.replicate_model(MyModel::new(&device))?;          // same start everywhere
//! let learner = Learner::new(DdpModel::new(&ddp, model), AdamConfig::new().init(), 1e-3);
//! // train/valid: ShardedDataLoaderBuilder … .build_for(dataset, &ddp), each in an Arc
//! // Rank 0 writes the checkpoints; after a restart (ddprun --max-restarts) every rank resumes.
//! let checkpoints =
//!     LearnerCheckpoints::open(&ddp, "runs/checkpoint", burn_ddp::recovery::restarted())?;
//! if let Some(epoch) = checkpoints.resume_epoch() {
//!     train.set_epoch(epoch as u64);                                    // the next epoch's order
//! }
//! let dir = format!("runs/rank{}", ddp.rank());                     // burn-train's logs, per rank
//! let training = SupervisedTraining::new(dir, train, valid).num_epochs(10);
//! let mut training = checkpoints.apply(training);
//! if !ddp.is_main() {
//!     training = training.renderer(Box::new(burn_ddp::SilentRenderer)); // others stay quiet
//! }
//! let result = training.launch(learner);
//! let model: MyModel = result.model.into_inner();
//! ```
//!
//! - **Metrics**: rank 0 renders its own per-rank metrics; to report global values, average
//!   them with [`crate::Ddp::average_scalar`] after `launch` (or inside a metric).
//! - **Checkpoints**: [`LearnerCheckpoints`] (as above): rank 0 writes burn-train's three files
//!   per epoch, the other ranks read them; after a restart every rank resumes after the last
//!   epoch checkpointed whole, bitwise the job never killed (the train loader set to that
//!   epoch). Give each rank its own artifact directory (burn-train writes logs there). `DdpModel`'s record is the inner
//!   model's record (same parameter paths), so checkpoints load into the plain model.
//! - **Gradient accumulation** (`grads_accumulation(n)`): burn-train accumulates locally and
//!   calls `optimize` once per `n` batches, so ranks communicate only then.
//! - Use one device per rank (the default single-device strategy); burn-train's own
//!   multi-device/DDP strategies are threads inside one process and are not combined with this.

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer, MultiGradientsParams};
use burn::tensor::Device;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{InferenceStep, LearnerSummary, TrainOutput, TrainStep};

use std::sync::{Arc, Mutex, MutexGuard};

use crate::context::Ddp;
use crate::grad_sync::{GradientSynchronizer, SyncStats};
pub use crate::learner_checkpoints::LearnerCheckpoints;

/// The synchroniser, whatever a panic elsewhere left it as (a failed sync panics, and the
/// group is broken then anyway).
fn lock(sync: &Mutex<GradientSynchronizer>) -> MutexGuard<'_, GradientSynchronizer> {
    sync.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wraps a model so that burn-train's `Learner` averages gradients across ranks before every
/// optimizer step (see the [module docs](self) for a full `SupervisedTraining` set-up).
///
/// It is transparent as a [`Module`]: visiting, mapping and records see exactly the inner
/// model's parameters and paths.
#[derive(Clone, Debug)]
pub struct DdpModel<M> {
    model: M,
    /// The job's synchroniser (bucket cap, compression, NCCL), shared by the copies
    /// burn-train makes of the model, so its statistics outlive each step.
    sync: Arc<Mutex<GradientSynchronizer>>,
}

impl<M> DdpModel<M> {
    /// Wraps `model`, synchronising gradients as `ddp` is configured (bucket cap,
    /// compression, NCCL: [`Ddp::gradient_synchronizer`]). Call [`Ddp::replicate_model`] on
    /// the model first so every rank starts from the same weights.
    pub fn new(ddp: &Ddp, model: M) -> Self {
        DdpModel {
            model,
            sync: Arc::new(Mutex::new(ddp.gradient_synchronizer())),
        }
    }

    /// Timings of the last gradient synchronisation (zero before the first step).
    pub fn last_sync_stats(&self) -> SyncStats {
        lock(&self.sync).last_stats()
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }

    /// Unwraps the model.
    pub fn into_inner(self) -> M {
        self.model
    }
}

impl<M: Module> Module for DdpModel<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.model.collect_devices(devices)
    }
    fn fork(self, device: &Device) -> Self {
        DdpModel {
            model: self.model.fork(device),
            ..self
        }
    }
    fn to_device(self, device: &Device) -> Self {
        DdpModel {
            model: self.model.to_device(device),
            ..self
        }
    }
    fn train(self) -> Self {
        DdpModel {
            model: self.model.train(),
            ..self
        }
    }
    fn valid(&self) -> Self {
        DdpModel {
            model: self.model.valid(),
            sync: Arc::clone(&self.sync),
        }
    }
    fn materialize(self) -> Self {
        DdpModel {
            model: self.model.materialize(),
            ..self
        }
    }
    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.model.visit(visitor)
    }
    fn map<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        DdpModel {
            model: self.model.map(mapper),
            ..self
        }
    }
}

impl<M: ModuleDisplay> ModuleDisplayDefault for DdpModel<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.model.content(content)
    }
}

impl<M: ModuleDisplay> ModuleDisplay for DdpModel<M> {}

impl<M: ModuleDisplay> core::fmt::Display for DdpModel<M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "DdpModel({})",
            ModuleDisplay::format(&self.model, Default::default())
        )
    }
}

impl<M: TrainStep + Module> TrainStep for DdpModel<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> TrainOutput<Self::Output> {
        self.model.step(item)
    }

    /// Averages `grads` over all ranks, then steps `optim`.
    ///
    /// # Panics
    /// When the synchronisation fails (dead peer, timeout, models differ): training cannot
    /// go on, and burn-train's `optimize` has no error channel.
    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr_module: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        // The flight recorder's phases and step, as `DdpOptimizer::try_step` marks them.
        ddp_comm::doctor::set_phase(ddp_comm::doctor::Phase::Sync);
        let synced = lock(&self.sync).sync(&self, grads);
        let grads = match synced {
            Ok(g) => g,
            Err(e) => {
                tracing::error!("DDP gradient synchronisation failed: {e}");
                panic!("DDP gradient synchronisation failed: {e}")
            }
        };
        ddp_comm::doctor::set_phase(ddp_comm::doctor::Phase::Optimizer);
        let updated = optim.step(lr_module, self, grads);
        ddp_comm::doctor::step_done();
        updated
    }

    /// Merges the per-device gradients of this rank, averages them over all ranks, then
    /// steps `optim`.
    fn optimize_multi(
        self,
        optim: &mut ModuleOptimizer,
        lr_module: ModuleLearningRate,
        grads: MultiGradientsParams,
    ) -> Self {
        let merged = merge_multi(&self, grads);
        self.optimize(optim, lr_module, merged)
    }
}

/// Sums a rank's per-device gradients onto the parameters' devices.
fn merge_multi<M: Module>(module: &M, mut grads: MultiGradientsParams) -> GradientsParams {
    struct Merger<'a> {
        from: &'a mut MultiGradientsParams,
        to: GradientsParams,
    }
    impl ModuleVisitor for Merger<'_> {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            if let Some((g, _device)) = self.from.remove::<D>(param.id) {
                self.to.register::<D>(param.id, g);
            }
        }
    }
    let mut m = Merger {
        from: &mut grads,
        to: GradientsParams::new(),
    };
    module.visit(&mut m);
    m.to
}

impl<M: InferenceStep> InferenceStep for DdpModel<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> Self::Output {
        self.model.step(item)
    }
}

/// A metrics renderer that shows nothing: give it to burn-train on ranks other than 0 so
/// that only rank 0 prints progress and summaries.
#[derive(Debug, Default, Clone, Copy)]
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for SilentRenderer {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _epoch: usize) {}
    fn start_split(&mut self, _split: &str, _total_items: usize) {}
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for SilentRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
