//! The per-channel computations of burn-ddp's `SyncBatchNorm`, on one device, with no
//! communication: every rank's statistics in one pass, their combination into the global mean
//! and variance around a common pivot (Chan's parallel formula), the normalisation, and the
//! backward pass's sums and input gradient.
//!
//! - [`tensor_ops`]: the computations as Burn tensor operations, for any backend (the
//!   reference the kernels are tested against).
//! - `kernels` (feature `cube`): the same as CubeCL kernels for the `Cube` backend (wgpu,
//!   CUDA).
//! - [`stats`]: the host reference in f64 ([`ChannelStats`]) and the combination's settings
//!   ([`CombineOptions`]).
//!
//! `burn-ddp` puts them behind its `SyncBatchNormBackend` extension and makes the cross-rank
//! exchange; use that crate's `SyncBatchNorm` layer rather than these functions.

#![warn(missing_docs)]

#[cfg(feature = "cube")]
pub mod kernels;
pub mod stats;
pub mod tensor_ops;

pub use stats::{ChannelStats, CombineOptions};
