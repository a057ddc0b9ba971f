//! The normalisation layer the networks are generic over ([`NormLayer`]): Burn's
//! [`BatchNorm`] (per-rank statistics) or burn-ddp's [`SyncBatchNorm`] (statistics over all
//! ranks). Both share BatchNorm's record layout (`gamma`, `beta`, `running_mean`,
//! `running_var`), so a checkpoint of one loads into the other.

use burn::module::{Module, ModuleDisplay};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{Device, Tensor};
use burn_ddp::sync_batch_norm::{SyncBatchNorm, SyncBatchNormConfig};

/// A normalisation layer over `[batch, channels, h, w]` activations.
///
/// Implemented for Burn's [`BatchNorm`] (per-rank statistics) and burn-ddp's [`SyncBatchNorm`]
/// (statistics over all ranks).
pub trait NormLayer: Module + ModuleDisplay + Sized {
    /// Short name for logs and reports.
    const NAME: &'static str;
    /// A fresh layer over `num_features` channels.
    fn init(num_features: usize, device: &Device) -> Self;
    /// Normalises `x`.
    fn forward(&self, x: Tensor<4>) -> Tensor<4>;
}

impl NormLayer for BatchNorm {
    const NAME: &'static str = "BatchNorm";

    fn init(num_features: usize, device: &Device) -> Self {
        BatchNormConfig::new(num_features).init(device)
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        BatchNorm::forward(self, x)
    }
}

impl NormLayer for SyncBatchNorm {
    const NAME: &'static str = "SyncBatchNorm";

    fn init(num_features: usize, device: &Device) -> Self {
        SyncBatchNormConfig::new(num_features).init(device)
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        SyncBatchNorm::forward(self, x)
    }
}
