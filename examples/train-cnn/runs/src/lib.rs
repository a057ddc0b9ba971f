//! Runs of the train-cnn example from the workspace, behind `cargo xtask`:
//!
//! - [`train`]: `cargo xtask train`, which builds train-cnn and launches N ranks of it with
//!   ddprun's library (CPU ranks, or one per GPU with `--gpus N`).
//! - [`compare`]: `cargo xtask compare`, the BatchNorm sweep: one process with the global batch
//!   against N ranks with per-rank BatchNorm and with SyncBatchNorm, over seeds and batch sizes.

pub mod compare;
pub mod train;
