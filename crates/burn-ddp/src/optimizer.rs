//! [`DdpOptimizer`]: Burn's [`ModuleOptimizer`] with gradient averaging across ranks.

use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};

use ddp_comm::ReduceOp;

use crate::clip;
use crate::comm;
use crate::context::Ddp;
use crate::error::Result;
use crate::grad_sync::{GradientSynchronizer, SyncStats};
use crate::sharding::{ShardStats, Sharding};

/// A [`ModuleOptimizer`] that first averages the gradients over all ranks, then steps.
///
/// Its [`step`](Self::step) has `ModuleOptimizer::step`'s shape, so adopting DDP in a
/// hand-written loop is one changed line:
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::nn::{Linear, LinearConfig};
/// # use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
/// # use burn::tensor::{Device, Tensor};
/// # fn main() -> Result<(), burn_ddp::DdpError> {
/// let ddp = burn_ddp::init()?;
/// let device = ddp.device().clone().autodiff();
/// let model = ddp.replicate_model(LinearConfig::new(4, 1).init(&device))?;
/// // before: let mut optim: ModuleOptimizer = AdamConfig::new().init();
/// let mut optim = burn_ddp::DdpOptimizer::new(&ddp, AdamConfig::new().init());
/// # let mut model: Linear = model;
/// for _ in 0..10 {
///     let x = Tensor::<2>::ones([8, 4], &device);
///     let loss = model.forward(x).powi_scalar(2).mean();
///     let grads = GradientsParams::from_grads(loss.backward(), &model);
///     model = optim.step(1e-3, model, grads); // averaged over ranks, then Adam
/// }
/// # Ok(()) }
/// ```
///
/// **Gradient accumulation** needs nothing special: sum the `GradientsParams` of several
/// micro-batches yourself (or use Burn's `GradientsAccumulator`) and call `step` once; only
/// that call communicates. This is PyTorch's `no_sync()` by construction. Divide the loss by
/// the number of micro-batches if the reference is the mean over the large batch.
///
/// Every rank must call `step` the same number of times (equal batch counts per rank — use
/// a distributed sampler that pads or drops the tail).
///
/// **Sharded optimizer state** (ZeRO stage 1, PyTorch's `ZeroRedundancyOptimizer`):
/// [`DdpOptimizer::sharded`] keeps each parameter's optimizer state on one rank only, so
/// Adam's moments take 1/N of the memory per rank, and trains bitwise as this one does; see
/// [`crate::sharding`].
#[derive(Clone)]
pub struct DdpOptimizer {
    optim: ModuleOptimizer,
    sync: GradientSynchronizer,
    sharding: Option<Sharding>,
    /// Clip the averaged gradients to this global norm ([`Self::with_global_norm_clipping`]).
    max_grad_norm: Option<f64>,
    /// The global norm of the last step's averaged gradients, before clipping.
    last_grad_norm: Option<f64>,
    /// Sharded, keep a copy of each rank's shard on its successor (the program recovers live:
    /// [`Ddp::recovers_live`]).
    keep_shard_copies: bool,
}

/// The state `optim` holds, serialised, when it holds any (an optimizer that has not stepped
/// holds none). A state that cannot be serialised is left where it is: the next checkpoint
/// save reports that error.
fn held_state(optim: &ModuleOptimizer) -> Option<Vec<u8>> {
    let bytes = optim.into_bytes().ok()?.to_vec();
    crate::sharding::state::ids_in(&bytes)
        .ok()
        .filter(|ids| !ids.is_empty())
        .map(|_| bytes)
}

/// `grads` clipped to the global norm `max_norm` given their per-parameter sums of squares
/// `squared` (visit order), and the norm before clipping.
fn clip_to<M: Module>(
    module: &M,
    grads: GradientsParams,
    squared: &[f64],
    max_norm: f64,
) -> (GradientsParams, f64) {
    let (norm, factor) = clip::clip_factor(squared, max_norm);
    let grads = match factor {
        Some(f) => clip::scale_gradients(module, grads, f),
        None => grads,
    };
    (grads, norm)
}

impl DdpOptimizer {
    /// Wraps `optim` (any Burn optimizer, e.g. `AdamConfig::new().init()` or
    /// `SgdConfig::new().init()`) with the bucket cap configured on `ddp`.
    pub fn new(ddp: &Ddp, optim: impl Into<ModuleOptimizer>) -> Self {
        DdpOptimizer {
            optim: optim.into(),
            sync: ddp.gradient_synchronizer(),
            sharding: None,
            max_grad_norm: None,
            last_grad_norm: None,
            keep_shard_copies: ddp.recovers_live(),
        }
    }

    /// Wraps `optim` with its state sharded across the ranks (ZeRO stage 1): each rank keeps
    /// and updates the state of the parameters it owns only, and the updated parameters are
    /// all-gathered from their owners after every step. For element-wise optimizers (SGD,
    /// momentum, Adam, AdamW) the training is bitwise that of [`Self::new`] on the host path
    /// (on NCCL, whose reduction order is its own, it is not promised); see
    /// [`crate::sharding`] for the rule, the exceptions and checkpoints. When `ddp` recovers live
    /// ([`Ddp::recovers_live`]), each rank also keeps a copy of its predecessor's shard after
    /// every step, for [`Ddp::recover`].
    ///
    /// ```no_run
    /// # use burn::optim::AdamConfig;
    /// # fn main() -> Result<(), burn_ddp::DdpError> {
    /// let ddp = burn_ddp::init()?;
    /// // before: burn_ddp::DdpOptimizer::new(&ddp, AdamConfig::new().init());
    /// let mut optim = burn_ddp::DdpOptimizer::sharded(&ddp, AdamConfig::new().init());
    /// # Ok(()) }
    /// ```
    pub fn sharded(ddp: &Ddp, optim: impl Into<ModuleOptimizer>) -> Self {
        Self::new(ddp, optim).into_sharded()
    }

    /// The same optimizer with its state sharded across the ranks, as [`Self::sharded`] makes
    /// it, keeping this one's synchroniser (e.g. one built by [`Self::with_synchronizer`]).
    /// A state the optimizer already holds (it has stepped, or loaded a checkpoint) is kept
    /// whole until the next step, then cut down to the parameters this rank owns, as a
    /// checkpoint's is.
    pub fn into_sharded(self) -> Self {
        if self.sharding.is_some() {
            return self;
        }
        let mut sharding = Sharding::new(
            self.sync.group().clone(),
            self.sync.bucket_cap_bytes(),
            self.keep_shard_copies,
        );
        if let Some(whole) = held_state(&self.optim) {
            sharding.load_whole(whole);
        }
        DdpOptimizer {
            sharding: Some(sharding),
            ..self
        }
    }

    /// Clips the averaged gradients by their global norm before every step: PyTorch's
    /// `clip_grad_norm_(model.parameters(), max_norm)` after DDP's all-reduce. When the norm
    /// of all trainable parameters' gradients together exceeds `max_norm`, every gradient is
    /// scaled by `max_norm / (norm + 1e-6)`. Sharded or not, the clipped training is bitwise
    /// the same (every rank adds the same per-parameter sums of squares in the model's order); [`Self::last_grad_norm`] gives the norm before clipping.
    ///
    /// Burn's own `with_grad_clipping(GradientClippingConfig::Norm(x))` clips each parameter's
    /// gradient by its own norm; this clips all of them together by one factor, as PyTorch does.
    ///
    /// # Errors
    /// [`crate::DdpError::InvalidSetting`] unless `max_norm` is finite and above 0.
    ///
    /// ```no_run
    /// # use burn::optim::AdamConfig;
    /// # fn main() -> Result<(), burn_ddp::DdpError> {
    /// let ddp = burn_ddp::init()?;
    /// let optim = burn_ddp::DdpOptimizer::sharded(&ddp, AdamConfig::new().init())
    ///     .with_global_norm_clipping(1.0)?;
    /// # Ok(()) }
    /// ```
    pub fn with_global_norm_clipping(self, max_norm: f64) -> Result<Self> {
        clip::check_max_norm(max_norm)?;
        Ok(DdpOptimizer {
            max_grad_norm: Some(max_norm),
            ..self
        })
    }

    /// The global norm of the last step's averaged gradients before clipping (what PyTorch's
    /// `clip_grad_norm_` returns); `None` without [`Self::with_global_norm_clipping`].
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_grad_norm
    }

    /// Whether the optimizer state is sharded ([`Self::sharded`]).
    pub fn is_sharded(&self) -> bool {
        self.sharding.is_some()
    }

    /// Whether this sharded optimizer keeps live recovery's copies of the shards (built on a
    /// [`Ddp`] that [`Ddp::recovers_live`]); `false` unsharded.
    pub fn recovers_with_copies(&self) -> bool {
        self.sharding
            .as_ref()
            .is_some_and(|s| s.finished_steps().is_some())
    }

    /// What the last step of a sharded optimizer did on this rank (`None` unsharded).
    pub fn last_shard_stats(&self) -> Option<ShardStats> {
        self.sharding.as_ref().map(Sharding::last_stats)
    }

    /// Bytes of the optimizer state this rank holds (its burnpack encoding: the state tensors
    /// plus a few bytes per parameter). Serialises the state, so call it to measure, not
    /// every step.
    ///
    /// # Errors
    /// [`crate::DdpError::Sharding`] when the state can't be serialised.
    pub fn state_size_bytes(&self) -> Result<usize> {
        let bytes = self
            .optim
            .into_bytes()
            .map_err(|e| crate::sharding::error::ShardingError::State(e.to_string()))?;
        Ok(bytes.len())
    }

    /// Wraps `optim` with an explicit synchroniser (e.g. a different bucket cap).
    pub fn with_synchronizer(
        optim: impl Into<ModuleOptimizer>,
        sync: GradientSynchronizer,
    ) -> Self {
        DdpOptimizer {
            optim: optim.into(),
            sync,
            sharding: None,
            max_grad_norm: None,
            last_grad_norm: None,
            keep_shard_copies: false,
        }
    }

    /// Averages `grads` over all ranks, then updates `module` as
    /// [`ModuleOptimizer::step`] does.
    ///
    /// # Panics
    /// When the synchronisation fails (a peer died, a collective timed out, the ranks'
    /// models differ). Training cannot go on after that; the panic message is the error.
    /// Use [`Self::try_step`] to handle it yourself.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> M {
        match self.try_step(lr, module, grads) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("DDP gradient synchronisation failed: {e}");
                panic!("DDP gradient synchronisation failed: {e}")
            }
        }
    }

    /// [`Self::step`] returning the synchronisation error instead of panicking.
    ///
    /// # Errors
    /// See [`GradientSynchronizer::sync`].
    pub fn try_step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> Result<M> {
        // The flight recorder's phases: sync until the gradients are in, then the update; the
        // step ends with it (a failed step ends in its phase: where it failed).
        ddp_comm::doctor::set_phase(ddp_comm::doctor::Phase::Sync);
        let updated = self.sync_and_update(lr, module, grads)?;
        ddp_comm::doctor::step_done();
        Ok(updated)
    }

    fn sync_and_update<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> Result<M> {
        match &mut self.sharding {
            Some(sharding) => {
                let owners = sharding.prepare(&module, &mut self.optim)?;
                let mut owned = self.sync.sync_to_owners(&module, grads, owners)?;
                if let Some(max_norm) = self.max_grad_norm {
                    // Each owner's sums; the others add exact zeros.
                    let mut squared = clip::squared_norms(&module, &owned.grads)?;
                    let mut group = comm::lock(self.sync.group());
                    if group.world_size() > 1 {
                        ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new("gradient norm"));
                        group.all_reduce(&mut squared, ReduceOp::Sum)?;
                    }
                    drop(group);
                    let (grads, norm) = clip_to(&module, owned.grads, &squared, max_norm);
                    owned.grads = grads;
                    self.last_grad_norm = Some(norm);
                }
                ddp_comm::doctor::set_phase(ddp_comm::doctor::Phase::Optimizer);
                sharding.step(
                    &mut self.optim,
                    lr.into(),
                    module,
                    owned,
                    self.sync.device_comm.as_ref(),
                )
            }
            None => {
                let mut grads = self.sync.sync(&module, grads)?;
                if let Some(max_norm) = self.max_grad_norm {
                    let squared = clip::squared_norms(&module, &grads)?;
                    let (clipped, norm) = clip_to(&module, grads, &squared, max_norm);
                    grads = clipped;
                    self.last_grad_norm = Some(norm);
                }
                ddp_comm::doctor::set_phase(ddp_comm::doctor::Phase::Optimizer);
                Ok(self.optim.step(lr, module, grads))
            }
        }
    }

    /// Timings of the last synchronisation.
    pub fn last_sync_stats(&self) -> SyncStats {
        self.sync.last_stats()
    }

    /// The wrapped optimizer (its state, for records and checkpoints; sharded, this rank's
    /// shard only: checkpoints gather the whole state, see [`crate::sharding`]).
    pub fn optimizer(&self) -> &ModuleOptimizer {
        &self.optim
    }

    /// The wrapped optimizer, mutably (e.g. to load a record).
    pub fn optimizer_mut(&mut self) -> &mut ModuleOptimizer {
        &mut self.optim
    }

    /// The gradient synchroniser.
    pub fn synchronizer_mut(&mut self) -> &mut GradientSynchronizer {
        &mut self.sync
    }

    /// Unwraps into the plain optimizer (sharded: with this rank's shard of the state).
    pub fn into_inner(self) -> ModuleOptimizer {
        self.optim
    }

    /// The sharding bookkeeping, for checkpoints.
    pub(crate) fn sharding_mut(&mut self) -> Option<&mut Sharding> {
        self.sharding.as_mut()
    }

    /// See [`Self::sharding_mut`].
    pub(crate) fn sharding(&self) -> Option<&Sharding> {
        self.sharding.as_ref()
    }

    /// Live recovery, sharded, on every rank once `module` is the same everywhere: this rank's
    /// shard `own` loaded and the shards' copies started again at `finished` steps
    /// (collective; see `Sharding::restore`).
    pub(crate) fn restore_shard<M: Module>(
        &mut self,
        module: &M,
        own: Vec<u8>,
        finished: u64,
    ) -> Result<()> {
        let sharding = self
            .sharding
            .as_mut()
            .expect("restore_shard is called for a sharded optimizer");
        sharding.restore(module, &mut self.optim, own, finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{ModuleVisitor, Param};
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, ModuleOptimizer};
    use burn::tensor::{Distribution, Tensor};

    struct Flat(Vec<f32>);
    impl ModuleVisitor for Flat {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0
                .extend(p.val().into_data().try_to_vec::<f32>().unwrap());
        }
    }
    fn flat(m: &Linear) -> Vec<f32> {
        let mut f = Flat(vec![]);
        m.visit(&mut f);
        f.0
    }

    /// Alone (no launch variables), `DdpOptimizer` is exactly the wrapped optimizer and
    /// `replicate_model` returns the model unchanged.
    #[test]
    fn alone_it_is_the_plain_optimizer() {
        let ddp = crate::init().unwrap();
        assert_eq!((ddp.rank(), ddp.world_size()), (0, 1));
        assert!(ddp.is_main());
        let device = ddp.device().clone().autodiff();
        let model: Linear = LinearConfig::new(5, 3).init(&device);
        let model = ddp.replicate_model(model).unwrap();
        let mut plain_model = model.clone();
        let mut ddp_model = model;
        let mut plain: ModuleOptimizer = AdamConfig::new().init();
        let mut wrapped = DdpOptimizer::new(&ddp, AdamConfig::new().init());
        for _ in 0..3 {
            let x = Tensor::<2>::random([4, 5], Distribution::Default, &device);
            let l1 = plain_model.forward(x.clone()).powi_scalar(2).mean();
            let g1 = GradientsParams::from_grads(l1.backward(), &plain_model);
            plain_model = plain.step(0.01, plain_model, g1);
            let l2 = ddp_model.forward(x).powi_scalar(2).mean();
            let g2 = GradientsParams::from_grads(l2.backward(), &ddp_model);
            ddp_model = wrapped.step(0.01, ddp_model, g2);
        }
        assert_eq!(flat(&plain_model), flat(&ddp_model));
        assert_eq!(ddp.average_scalar(2.5).unwrap(), 2.5);
        assert_eq!(ddp.run_on_main(|| 7).unwrap(), Some(7));
        ddp.barrier().unwrap();
    }

    #[derive(burn::module::Module, Debug)]
    struct TwoLayers {
        a: Linear,
        b: Linear,
    }

    /// The sharded optimizer with a device communicator (here the host-staged stand-in for
    /// NCCL): gradients reduce-scattered and parameters all-gathered as tensors, on two CPU
    /// ranks, three Adam steps. Every rank ends with bitwise the parameters of the sharded
    /// optimizer on the host path, and the same on both ranks.
    #[test]
    fn the_sharded_step_on_the_device_communicator_is_the_host_paths_bitwise() {
        use burn::nn::Initializer;
        let results = crate::test_ranks::run_ranks(2, |group, rank| {
            let device = burn::tensor::Device::flex().autodiff();
            let init = |i, o, v| {
                LinearConfig::new(i, o)
                    .with_initializer(Initializer::Constant { value: v })
                    .init(&device)
            };
            let run = |device_comm: bool| {
                let mut model = TwoLayers {
                    a: init(5, 4, 0.25),
                    b: init(4, 3, -0.5),
                };
                let mut sync = GradientSynchronizer::new(group.clone(), 40).with_overlap(false);
                if device_comm {
                    sync = sync.with_device_comm(Some(crate::cuda::DeviceComm::host_staged(
                        group.clone(),
                    )));
                }
                let mut optim =
                    DdpOptimizer::with_synchronizer(AdamConfig::new().init(), sync).into_sharded();
                for step in 0..3 {
                    let x = Tensor::<2>::from_data(
                        burn::tensor::TensorData::new(
                            (0..20)
                                .map(|i| ((i * 7 + step * 3 + rank * 11) % 13) as f32 * 0.1 - 0.6)
                                .collect::<Vec<f32>>(),
                            [4, 5],
                        ),
                        &device,
                    );
                    let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).mean();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optim.try_step(0.05, model, grads).unwrap();
                }
                assert_eq!(optim.sync.last_sync_on_device(), device_comm);
                let mut all = flat(&model.a);
                all.extend(flat(&model.b));
                all
            };
            let on_host = run(false);
            let on_device = run(true);
            assert!(
                on_host
                    .iter()
                    .zip(&on_device)
                    .all(|(h, d)| h.to_bits() == d.to_bits()),
                "rank {rank}: {on_host:?} vs {on_device:?}"
            );
            on_device
        });
        assert_eq!(results[0], results[1], "the ranks' parameters differ");
    }

    /// A forgotten `replicate_model` (each rank with parameters of its own) fails the first
    /// step with one line naming it, on every rank, plain and sharded; replicated parameters
    /// pass, and the check is made once.
    #[test]
    fn a_forgotten_replicate_model_fails_the_first_step_on_every_rank() {
        use crate::error::DdpError;
        use burn::nn::Initializer;
        let results = crate::test_ranks::run_ranks(2, |group, rank| {
            let device = burn::tensor::Device::flex().autodiff();
            let model = |v: f64| -> Linear {
                LinearConfig::new(5, 3)
                    .with_initializer(Initializer::Constant { value: v })
                    .init(&device)
            };
            let step = |optim: &mut DdpOptimizer, m: Linear| {
                let x = Tensor::<2>::ones([4, 5], &device);
                let loss = m.forward(x).powi_scalar(2).mean();
                let grads = GradientsParams::from_grads(loss.backward(), &m);
                optim.try_step(0.05, m, grads)
            };
            let new = |sharded: bool| {
                let o = DdpOptimizer::with_synchronizer(
                    AdamConfig::new().init(),
                    GradientSynchronizer::new(group.clone(), 40).with_overlap(false),
                );
                if sharded { o.into_sharded() } else { o }
            };
            let mut lines = Vec::new();
            for sharded in [false, true] {
                // Each rank's own parameters.
                let err = step(&mut new(sharded), model(0.1 + rank as f64))
                    .expect_err("parameters of its own on each rank");
                assert!(matches!(err, DdpError::NotReplicated { rank: 1 }), "{err}");
                lines.push(err.to_string());
                // The same parameters: steps go on.
                let mut optim = new(sharded);
                let mut m = model(0.1);
                for _ in 0..2 {
                    m = step(&mut optim, m).unwrap();
                }
            }
            lines
        });
        assert_eq!(results[0], results[1]);
        assert!(
            results[0][0].contains("replicate_model"),
            "{}",
            results[0][0]
        );
    }
}
