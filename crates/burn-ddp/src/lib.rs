//! Distributed data-parallel training for Burn 0.22: run one training program as N rank
//! processes, each on its own shard of the data, and get the same optimisation as one process
//! with an N-times larger batch.
//!
//! Launch the program with `ddprun --nproc-per-node N prog …` (or torchrun / `srun`); run
//! alone, it is a world of one and behaves as before.
//!
//! # Adoption: a hand-written loop
//!
//! Before (one process):
//!
//! ```no_run
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
//! # use burn::tensor::{Device, Tensor};
//! # fn batches(_: &Device) -> Vec<(Tensor<2>, Tensor<2>)> { vec![] }
//! let device = Device::flex().autodiff();
//! let mut model: Linear = LinearConfig::new(8, 1).init(&device);
//! let mut optim: ModuleOptimizer = AdamConfig::new().init();
//! for (x, y) in batches(&device) {
//!     let loss = (model.forward(x) - y).powi_scalar(2).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optim.step(1e-3, model, grads);
//! }
//! ```
//!
//! After (N processes; the changed lines are marked):
//!
//! ```no_run
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::optim::{AdamConfig, GradientsParams};
//! # use burn::tensor::{Device, Tensor};
//! # fn shard_batches(_: usize, _: usize, _: &Device) -> Vec<(Tensor<2>, Tensor<2>)> { vec![] }
//! # fn main() -> Result<(), burn_ddp::DdpError> {
//! let ddp = burn_ddp::init()?;                                        // + join the job
//! let device = ddp.device().clone().autodiff();                       // ~ this rank's device
//! let model: Linear = LinearConfig::new(8, 1).init(&device);
//! let mut model = ddp.replicate_model(model)?;                        // + rank 0's weights
//! let mut optim = burn_ddp::DdpOptimizer::new(&ddp, AdamConfig::new().init()); // ~ one line
//! for (x, y) in shard_batches(ddp.rank(), ddp.world_size(), &device) { // ~ this rank's shard
//!     let loss = (model.forward(x) - y).powi_scalar(2).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optim.step(1e-3, model, grads);                         // averaged over ranks
//! }
//! ddp.run_on_main(|| { /* save the model, print metrics */ })?;       // + rank 0 only
//! # Ok(()) }
//! ```
//!
//! Every rank must take the same number of optimizer steps (give every rank the same number
//! of batches: pad or drop the tail of the data set).
//!
//! # What happens
//!
//! - [`init`] reads torchrun's (or Slurm's) launch variables, joins the process group and
//!   installs it process-wide ([`comm`]), and picks the rank's device.
//! - [`Ddp::replicate_model`] checks that every rank built the same model and copies rank
//!   0's parameters and buffers to all ranks.
//! - [`DdpOptimizer::step`] averages the gradients over ranks ([`GradientSynchronizer`]: a
//!   presence exchange for parameters unused on some ranks, fixed-order buckets of at most
//!   25 MiB, host copies overlapped with all-reduces on a comm thread) and then runs the
//!   wrapped Burn optimizer. Gradient accumulation communicates only at the step.
//!   With the `cuda` feature, buckets on CUDA devices are instead all-reduced by NCCL in
//!   device memory when every rank can (module `nccl`; built and linked in CI, not yet run on a GPU).
//! - With burn-train (feature `learner`), wrap the model in `DdpModel` instead; see the
//!   `learner` module.
//! - [`checkpoint::Checkpointer`] saves model, optimizer, progress and metadata from rank 0
//!   atomically and resumes every rank from it (after a restart by `ddprun --max-restarts`).
//! - [`Ddp::average_scalar`] / [`Ddp::average_tensor`] average metrics; [`Ddp::barrier`] and
//!   [`Ddp::run_on_main`] order work across ranks.
//! - A collective inside Burn's forward or backward (SyncBatchNorm) can only fail by
//!   panicking; [`report_panics_as_errors`] at the start of `main` turns that panic into one
//!   `PROGRAM: error: …` line.

// docs.rs: label feature-gated items with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod checkpoint;
mod clip;
pub mod comm;
mod context;
mod cuda;
/// Sharded data: the `burn-ddp-data` crate (`DistributedSampler`, `ShardedDataLoader`).
pub use burn_ddp_data as data;
/// The hang doctor's flight recorder: mark the phases the library cannot see
/// ([`doctor::set_phase`]`(Phase::Backward)`, an evaluation as [`doctor::Phase::Other`]) and
/// label your own collectives ([`doctor::label_next`]); `ddprun` reads the rest.
pub use ddp_comm::doctor;
#[cfg(feature = "learner")]
mod epoch_renderer;
mod error;
pub mod grad_sync;
#[cfg(feature = "learner")]
#[cfg_attr(docsrs, doc(cfg(feature = "learner")))]
pub mod learner;
#[cfg(feature = "learner")]
mod learner_checkpoints;
mod optimizer;
mod panic_report;
pub mod recovery;
mod replicate;
pub mod sharding;
pub mod sync_batch_norm;
#[cfg(test)]
mod test_ranks;

pub use context::{Ddp, DdpBuilder, init};
#[cfg(feature = "cuda")]
pub use cuda::nccl;
pub use cuda::{NCCL_POLICY_VAR, NcclPolicy};
/// The communication layer burn-ddp is built on (process groups, launch environment,
/// rendezvous store, launcher), for the types in [`DdpBuilder`]'s signatures.
pub use ddp_comm;
#[cfg(feature = "learner")]
#[cfg_attr(docsrs, doc(cfg(feature = "learner")))]
pub use epoch_renderer::EpochLineRenderer;
pub use error::{DdpError, Result};
pub use grad_sync::{DEFAULT_BUCKET_CAP_BYTES, GradientSynchronizer, SyncStats};
#[cfg(feature = "learner")]
pub use learner::{DdpModel, SilentRenderer};
pub use optimizer::DdpOptimizer;
pub use panic_report::report_panics_as_errors;

/// A `tracing` filter directive that silences wgpu's probe of the GL backend
/// (`wgpu_hal::gles::egl`), which logs `ERROR … DRI2: failed to load driver` on a machine
/// without a GL driver although wgpu goes on with Vulkan. wgpu's other errors still show.
/// Add it to a program's default filter, e.g.
/// `EnvFilter::new(format!("warn,{}", burn_ddp::QUIET_WGPU_PROBE))`.
pub const QUIET_WGPU_PROBE: &str = "wgpu_hal::gles::egl=off";

// The README's Rust snippets compile as doctests (the adoption example above all).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}
