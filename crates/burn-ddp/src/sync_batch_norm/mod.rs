//! Batch normalisation with statistics synchronised across ranks (PyTorch's `SyncBatchNorm`).
//!
//! With small per-rank batches, per-rank BatchNorm statistics turn into noise; [`SyncBatchNorm`]
//! normalises with the mean and variance of *every* rank's samples, so N ranks × batch b
//! normalise like one process with batch N·b (to float rounding).
//!
//! # Algorithm (PyTorch's)
//!
//! - **Forward (training)**: each rank computes per-channel (pivot, mean, M2) of its samples in
//!   one pass, all-gathers them with its count (4C values), and combines them on the device
//!   with the parallel form of Chan's formula around a common pivot (no sum / sum-of-squares
//!   cancellation on data with a large mean). A rank with no samples still takes part. The
//!   output is `(x − μ) / sqrt(σ² + ε) · γ + β` with the global μ and biased σ².
//! - **Backward**: each rank computes per-channel `Σdy` and `Σdy·(x − μ)` and all-reduces these
//!   2C sums in **one** call; the input gradient uses the global sums, the γ/β gradients are the
//!   local ones (DDP averages them like any other parameter gradient).
//! - **Eval** uses the running statistics and makes no collective call. World size 1 (or no
//!   process group installed, see [`crate::comm`]) makes no collective call either.
//!
//! # Where the statistics travel
//!
//! The statistics stay on the input's device from the statistics pass to the normalisation:
//! the combination, `1/sqrt(σ² + ε)`, the backward coefficients and the running-statistics
//! update are all tensor operations, so at world size 1 a training step reads nothing back to
//! the host. Between ranks they go through NCCL in CUDA device memory when [`crate::Ddp`] has
//! set up an NCCL communicator (feature `cuda`), and through the process group's host
//! collectives otherwise (CPU, wgpu): 4C values read back and all-gathered per layer in
//! forward, 2C all-reduced in backward.
//!
//! A batch in which no rank has a sample is an error ([`SyncBatchNormError::NoSamples`]) where
//! the counts pass through the host; on the NCCL path (which never reads them back) such a
//! batch leaves the running statistics unchanged. A single sample per channel over all ranks
//! with [`RunningVariance::Unbiased`] (whose `M2 / (n − 1)` is then undefined) leaves the
//! running statistics unchanged on every path, as the output is still defined (β).
//!
//! # Paths
//!
//! The per-channel work goes through the backend extension [`SyncBatchNormBackend`]:
//! CubeCL kernels on the `Cube` backend (wgpu, CUDA; the `wgpu`/`cuda` features) and a
//! tensor-op implementation on Flex (CPU) — and on Cube when
//! [`SyncBatchNormImpl::TensorOps`] is chosen. Other backends (NdArray, LibTorch, Remote) run
//! Burn's own `batch_norm_train` at world size 1 and return
//! [`SyncBatchNormError::UnsupportedBackend`] at larger world sizes.
//!
//! # Converting a model
//!
//! Burn 0.22 records are keyed by parameter path, and [`SyncBatchNorm`] has exactly
//! [`BatchNorm`]'s parameters (`gamma`, `beta`, `running_mean`, `running_var`). So:
//!
//! 1. **Declare** `SyncBatchNorm` where the model had `BatchNorm` (same field names). At world
//!    size 1 it computes what `BatchNorm` computes (to float rounding), so one model
//!    definition serves both single-process and distributed runs.
//! 2. **Load** an existing BatchNorm model's record (or checkpoint file) into it with
//!    [`Module::load_record`] — nothing to rename.
//! 3. For a layer you already hold, `SyncBatchNorm::from(batch_norm)` moves its parameters
//!    (keeping their ids, so optimizer state stays attached) and `BatchNorm::from(sync)` goes back,
//!    e.g. to export a model for single-device inference.
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{BatchNorm, BatchNormConfig};
//! use burn::tensor::Device;
//! use burn_ddp::sync_batch_norm::{SyncBatchNorm, SyncBatchNormConfig};
//!
//! #[derive(Module, Debug)]
//! struct Net { norm: BatchNorm }
//! #[derive(Module, Debug)]
//! struct SyncNet { norm: SyncBatchNorm } // the same model with SyncBatchNorm
//!
//! let device = Device::flex();
//! let trained = Net { norm: BatchNormConfig::new(4).init(&device) };
//! // Whole model: load the BatchNorm model's record into the SyncBatchNorm model.
//! let synced = SyncNet { norm: SyncBatchNormConfig::new(4).init(&device) }
//!     .load_record(trained.clone().into_record());
//! // One layer: move it.
//! let layer: SyncBatchNorm = trained.norm.into();
//! # let _ = (synced, layer);
//! ```
//!
//! Models whose type must not change can hold the norm layer as a Module enum
//! (`enum Norm { Batch(BatchNorm), Sync(SyncBatchNorm) }` with `#[derive(Module)]`) and convert
//! per layer with `From`.

mod autodiff;
mod backend;
#[cfg(test)]
mod combine_tests;
#[cfg(feature = "cube")]
mod cube;
pub(crate) mod error;
mod exchange;
mod transfer;

pub use backend::SyncBatchNormBackend;
pub use burn_ddp_batchnorm::{ChannelStats, CombineOptions};
pub use error::SyncBatchNormError;

use burn_ddp_batchnorm::stats;

use burn::backend::{Dispatch, DispatchDevice};
use burn::config::Config;
use burn::module::{Content, DisplaySettings, Flag, Module, ModuleDisplay, Param, RunningState};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

/// Which variance feeds `running_var`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RunningVariance {
    /// Burn's `BatchNorm` convention: the biased batch variance `M2 / n` (the default; world
    /// size 1 matches `BatchNorm`).
    #[default]
    Biased,
    /// PyTorch's convention: the unbiased batch variance `M2 / (n − 1)` over all ranks' samples.
    Unbiased,
}

/// How the per-channel work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SyncBatchNormImpl {
    /// CubeCL kernels where the device runs CubeCL (and the crate has the `wgpu`/`cuda`
    /// feature), tensor operations elsewhere.
    #[default]
    Auto,
    /// Tensor operations on every device (for comparison with the kernels).
    TensorOps,
}

/// [`SyncBatchNorm`] configuration: [`BatchNormConfig`]'s fields plus the running-variance
/// convention and the implementation choice.
#[derive(Config, Debug)]
pub struct SyncBatchNormConfig {
    /// The number of features (channels). Must be greater than zero.
    pub num_features: usize,
    /// A finite, positive value added to the variance. Default: 1e-5.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Momentum of the running statistics, in `[0, 1]`. Default: 0.1.
    #[config(default = 0.1)]
    pub momentum: f64,
    /// Which batch variance feeds `running_var`. Default: Burn's biased one.
    #[config(default = "RunningVariance::Biased")]
    pub running_variance: RunningVariance,
    /// Kernels or tensor operations. Default: kernels where available.
    #[config(default = "SyncBatchNormImpl::Auto")]
    pub implementation: SyncBatchNormImpl,
}

impl From<&BatchNormConfig> for SyncBatchNormConfig {
    fn from(config: &BatchNormConfig) -> Self {
        SyncBatchNormConfig::new(config.num_features)
            .with_epsilon(config.epsilon)
            .with_momentum(config.momentum)
    }
}

/// Batch normalisation whose training statistics cover every rank's samples.
///
/// The same parameters, record layout and results (at world size 1) as [`BatchNorm`]; see the
/// [module docs](self) for the algorithm and for converting a model.
///
/// # Shapes
/// - input and output: `[batch, channels, ...]` (rank ≥ 2)
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct SyncBatchNorm {
    /// The learnable weight γ.
    pub gamma: Param<Tensor<1>>,
    /// The learnable bias β.
    pub beta: Param<Tensor<1>>,
    /// Whether training behaviour is enabled for this layer.
    pub training: Param<Flag>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance.
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum used to update the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// Which batch variance feeds `running_var`.
    #[module(skip)]
    pub running_variance: RunningVariance,
    /// Kernels or tensor operations.
    #[module(skip)]
    pub implementation: SyncBatchNormImpl,
}

impl SyncBatchNormConfig {
    /// Initialises a [`SyncBatchNorm`] (γ = 1, β = 0, running mean 0, running variance 1).
    ///
    /// # Panics
    /// As [`BatchNormConfig::init`]: `num_features` zero, `epsilon` not finite and positive, or
    /// `momentum` not finite and within `[0, 1]`.
    pub fn init(&self, device: &Device) -> SyncBatchNorm {
        let bn = BatchNormConfig::new(self.num_features)
            .with_epsilon(self.epsilon)
            .with_momentum(self.momentum)
            .init(device);
        SyncBatchNorm::from_batch_norm(bn, self.running_variance, self.implementation)
    }
}

impl From<BatchNorm> for SyncBatchNorm {
    /// Moves a [`BatchNorm`]'s parameters and state (ids included) into a [`SyncBatchNorm`] with
    /// the default options.
    fn from(bn: BatchNorm) -> Self {
        SyncBatchNorm::from_batch_norm(bn, RunningVariance::Biased, SyncBatchNormImpl::Auto)
    }
}

impl From<SyncBatchNorm> for BatchNorm {
    /// Moves the parameters back into a plain [`BatchNorm`] (e.g. for single-device export).
    fn from(sbn: SyncBatchNorm) -> Self {
        BatchNorm {
            gamma: sbn.gamma,
            beta: sbn.beta,
            training: sbn.training,
            running_mean: sbn.running_mean,
            running_var: sbn.running_var,
            momentum: sbn.momentum,
            epsilon: sbn.epsilon,
        }
    }
}

/// How this call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Through [`SyncBatchNormBackend`] (`kernels` on Cube devices unless tensor ops are asked).
    Extension { kernels: bool },
    /// Burn's `batch_norm_train` (world size 1 on backends without the extension).
    Plain,
}

impl SyncBatchNorm {
    /// Moves a [`BatchNorm`]'s parameters and state into a [`SyncBatchNorm`] with the given
    /// options.
    pub fn from_batch_norm(
        bn: BatchNorm,
        running_variance: RunningVariance,
        implementation: SyncBatchNormImpl,
    ) -> Self {
        SyncBatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
            running_variance,
            implementation,
        }
    }

    /// Returns the layer with another implementation choice.
    pub fn with_implementation(mut self, implementation: SyncBatchNormImpl) -> Self {
        self.implementation = implementation;
        self
    }

    /// Applies the layer: synchronised batch statistics on an autodiff device with training
    /// enabled (also updating the running statistics), running statistics otherwise.
    ///
    /// # Panics
    /// On any [`SyncBatchNormError`]; use [`try_forward`](Self::try_forward) to handle them. Inside
    /// [`Ddp::catch_lost_peer`](crate::Ddp::catch_lost_peer), a lost peer returns there instead.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.try_forward(input).unwrap_or_else(|e| {
            let e = error::unwind_if_lost_peer(e);
            tracing::error!("SyncBatchNorm forward failed: {e}");
            panic!("SyncBatchNorm forward failed: {e}")
        })
    }

    /// [`forward`](Self::forward) returning errors instead of panicking.
    ///
    /// In training mode every rank must call this the same number of times in the same order
    /// (it makes one all-gather, and its backward one all-reduce).
    pub fn try_forward<const D: usize>(
        &self,
        input: Tensor<D>,
    ) -> Result<Tensor<D>, SyncBatchNormError> {
        if D < 2 {
            return Err(SyncBatchNormError::Rank(D));
        }
        let [num_features] = self.gamma.shape().dims();
        let dims = input.dims();
        if dims[1] != num_features {
            return Err(SyncBatchNormError::Channels {
                expected: num_features,
                got: dims[1],
            });
        }
        if input.device().is_autodiff() && self.training.is_enabled() {
            self.forward_train(input)
        } else {
            Ok(self.forward_inference(input))
        }
    }

    fn forward_inference<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        burn::tensor::module::batch_norm(
            input,
            self.gamma.val(),
            self.beta.val(),
            self.running_mean.value().to_device(&device),
            self.running_var.value().to_device(&device),
            self.epsilon,
        )
    }

    fn path(&self, device: &Device) -> Path {
        let kernels = self.implementation == SyncBatchNormImpl::Auto;
        match device.clone().inner().as_dispatch() {
            #[cfg(feature = "cube")]
            DispatchDevice::Cube(_) => Path::Extension { kernels },
            DispatchDevice::Flex(_) => Path::Extension { kernels: false },
            #[allow(unreachable_patterns)]
            _ => {
                let _ = kernels;
                Path::Plain
            }
        }
    }

    fn forward_train<const D: usize>(
        &self,
        input: Tensor<D>,
    ) -> Result<Tensor<D>, SyncBatchNormError> {
        let device = input.device();
        let exchange = exchange::Exchange::current();
        let kernels = match self.path(&device) {
            Path::Extension { kernels } => kernels,
            Path::Plain if exchange.world_size() == 1 => {
                return Ok(self.forward_train_plain(input));
            }
            Path::Plain => {
                return Err(SyncBatchNormError::UnsupportedBackend {
                    device: format!("{device:?}"),
                    world_size: exchange.world_size(),
                });
            }
        };

        let dims = input.dims();
        let (n, channels) = (dims[0], dims[1]);
        let spatial: usize = dims[2..].iter().product();
        let count = n * spatial;
        let x = input.reshape([n, channels, spatial]);

        // Local (pivot, mean relative to the pivot, M2, count) per channel in one pass: the
        // [4, C] every rank contributes, in f32 whatever the input's dtype (so are all the
        // per-channel values below). Nothing is read back here.
        let local = if count == 0 {
            Tensor::zeros([stats::ROWS, channels], (&device, DType::F32))
        } else {
            Tensor::<2>::from_dispatch(Dispatch::sync_bn_stats(
                x.clone().detach().into_dispatch(),
                kernels,
            ))
        };

        let gathered = exchange.all_gather(local.clone(), stats::ROWS - 1, count)?;
        if gathered.total_count == Some(0.0) {
            return Err(SyncBatchNormError::NoSamples);
        }
        // [6, C]: the channel parameters (rows 0–3) and the new running mean and variance.
        let (running_mean, running_var) = (
            self.running_mean.value_sync(),
            self.running_var.value_sync(),
        );
        let running_dtype = running_mean.dtype();
        let running = |state: Tensor<1>| state.to_device(&device).cast(DType::F32).into_dispatch();
        let global = Tensor::<2>::from_dispatch(Dispatch::sync_bn_combine(
            gathered.stats.into_dispatch(),
            local.into_dispatch(),
            running(running_mean),
            running(running_var),
            CombineOptions {
                epsilon: self.epsilon,
                momentum: self.momentum,
                unbiased: self.running_variance == RunningVariance::Unbiased,
            },
            kernels,
        ));
        let output = Tensor::<3>::from_dispatch(Dispatch::sync_bn_normalize(
            x.into_dispatch(),
            global.clone().narrow(0, 0, stats::ROWS).into_dispatch(),
            // γ and β in f32 whatever the input's dtype, as PyTorch keeps them (a no-op for f32
            // parameters; the gradients flow back through the cast).
            self.gamma.val().cast(DType::F32).into_dispatch(),
            self.beta.val().cast(DType::F32).into_dispatch(),
            kernels,
        ));
        let row = |r: usize| global.clone().narrow(0, r, 1).reshape([channels]);
        self.running_mean
            .update(row(4).cast(running_dtype).detach());
        self.running_var.update(row(5).cast(running_dtype).detach());
        Ok(output.reshape(dims))
    }

    fn forward_train_plain<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        let result = burn::tensor::module::batch_norm_train(
            input,
            self.gamma.val(),
            self.beta.val(),
            self.epsilon,
        );
        let variance = match self.running_variance {
            RunningVariance::Biased => result.variance.detach(),
            RunningVariance::Unbiased => {
                let n = result.output.dims().iter().product::<usize>() / result.mean.dims()[0];
                if n < 2 {
                    // `M2 / (n − 1)` is undefined: the running statistics stay, as on the
                    // other paths.
                    return result.output;
                }
                result
                    .variance
                    .detach()
                    .mul_scalar(n as f64 / (n as f64 - 1.0))
            }
        };
        self.update_running(result.mean.detach(), variance, &device);
        result.output
    }

    /// Moves the running statistics towards the batch's by `momentum` (BatchNorm's update).
    fn update_running(&self, mean: Tensor<1>, var: Tensor<1>, device: &Device) {
        let blend = |old: Tensor<1>, new: Tensor<1>| {
            old.mul_scalar(1.0 - self.momentum)
                .add(new.mul_scalar(self.momentum))
        };
        let running_mean = blend(self.running_mean.value_sync().to_device(device), mean);
        let running_var = blend(self.running_var.value_sync().to_device(device), var);
        self.running_mean.update(running_mean.detach());
        self.running_var.update(running_var.detach());
    }
}

impl ModuleDisplay for SyncBatchNorm {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        let [num_features] = self.beta.shape().dims();
        content
            .add("num_features", &num_features)
            .add("momentum", &self.momentum)
            .add("epsilon", &self.epsilon)
            .optional()
    }
}
