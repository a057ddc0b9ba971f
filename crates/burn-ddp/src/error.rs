//! The error type of burn-ddp's calls.

use ddp_comm::CommError;

/// Result alias for burn-ddp calls.
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

/// An error from setting up data-parallel training or from a gradient synchronisation.
///
/// Errors that come from comparing ranks (a model that differs, a gradient layout that
/// differs) are raised identically on every rank, so every process exits with the same
/// message.
///
/// Its `Debug` is its message and its causes, as anyhow's errors print, so that
/// `fn main() -> Result<(), DdpError>` ends with one readable line, not a dump of the variant.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// A collective, the rendezvous or the launch environment failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The ranks hold models that differ (parameter paths, shapes, dtypes or trainability).
    #[error(
        "the model differs across ranks: tensor #{index} is {expected} on rank 0 but {found} on rank {rank}"
    )]
    ModelMismatch {
        /// The first rank whose model differs from rank 0's.
        rank: usize,
        /// Position of the first differing tensor in module visit order.
        index: usize,
        /// Rank 0's description of that tensor (`path: kind shape dtype`, or `nothing`).
        expected: String,
        /// The differing rank's description of that tensor.
        found: String,
    },
    /// The ranks' trainable parameters differ at the first gradient synchronisation: the
    /// model was not replicated ([`crate::Ddp::replicate_model`]), and each rank would train a
    /// model of its own.
    #[error(
        "the ranks' parameters differ at the first gradient synchronisation (rank {rank}'s are \
         not rank 0's): call `ddp.replicate_model(model)` before training, so that every rank \
         starts from rank 0's parameters (or load the same checkpoint on every rank)"
    )]
    NotReplicated {
        /// The first rank whose parameters differ from rank 0's.
        rank: usize,
    },
    /// The ranks' gradients do not line up (a different number or shape of trainable
    /// parameters, e.g. a model changed on one rank after [`crate::Ddp::replicate_model`]).
    #[error(
        "the trainable parameters differ across ranks at gradient synchronisation: this rank \
         has {parameters} trainable parameters with {values} values in total, and at least one \
         other rank has a different set (same model type and configuration on every rank?)"
    )]
    GradientLayoutMismatch {
        /// This rank's number of trainable parameters.
        parameters: usize,
        /// The number of values of those parameters.
        values: usize,
    },
    /// A tensor could not be read back from the device or converted.
    #[error("tensor data of `{what}`: {msg}")]
    TensorData {
        /// Which tensor.
        what: String,
        /// What went wrong.
        msg: String,
    },
    /// The device this rank should train on can't be used: no CUDA driver, no device, or
    /// more ranks on this node than visible devices. Raised by [`crate::init`] before the
    /// rank joins the group.
    #[error("no usable device for this rank: {0}")]
    Device(CommError),
    /// A checkpoint could not be saved, read or restored ([`crate::checkpoint`]).
    #[error(transparent)]
    Checkpoint(#[from] burn_ddp_checkpoint::CheckpointError),
    /// The sampler or the sharded data loader failed ([`crate::data`]).
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// The sharded optimizer's bookkeeping failed ([`crate::DdpOptimizer::sharded`]).
    #[error(transparent)]
    Sharding(#[from] crate::sharding::error::ShardingError),
    /// A SyncBatchNorm layer failed ([`crate::sync_batch_norm`]).
    #[error(transparent)]
    SyncBatchNorm(#[from] crate::sync_batch_norm::error::SyncBatchNormError),
    /// A setting that cannot work, passed to a builder or read from the environment.
    #[error("invalid setting {setting}: {reason}")]
    InvalidSetting {
        /// The setting: a builder method (`DdpBuilder::bucket_cap_bytes`), an environment
        /// variable (`DDP_COMPRESSION`) or a layer's placement.
        setting: &'static str,
        /// Why it cannot work.
        reason: String,
    },
    /// NCCL was required (`NcclPolicy::Required`) but can't be used on some
    /// rank: no CUDA device, libcuda or libnccl missing, or the communicator failed (feature
    /// `cuda`).
    #[error("NCCL gradient sync was required but is unavailable: {0}")]
    NcclUnavailable(String),
    /// A CUDA toolkit file Burn's CUDA backend needs is missing (libdevice; with `cuda-nvrtc`,
    /// NVRTC and the CUDA headers). Raised by [`crate::init`] before the rank joins the group.
    #[cfg(feature = "cuda")]
    #[error("no usable device for this rank: {0}")]
    Toolkit(#[from] ddp_nccl::cuda_toolkit::ToolkitError),
}

impl std::fmt::Debug for DdpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")?;
        let mut cause = std::error::Error::source(self);
        let mut first = true;
        while let Some(c) = cause {
            if first {
                write!(f, "\n\nCaused by:")?;
                first = false;
            }
            write!(f, "\n    {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `main() -> Result<(), DdpError>` prints is the message, not the variant's fields.
    #[test]
    fn debug_prints_the_message_and_its_causes() {
        let e = DdpError::ModelMismatch {
            rank: 1,
            index: 4,
            expected: "`fc1.weight`: param [8, 4] f32".into(),
            found: "`fc1.weight`: param [8, 5] f32".into(),
        };
        assert_eq!(format!("{e:?}"), e.to_string());
        assert!(!format!("{e:?}").contains("ModelMismatch {"));
        let io = CommError::io(
            "sending",
            Some(2),
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "pipe closed"),
        );
        let e = DdpError::from(io);
        let shown = format!("{e:?}");
        assert!(
            shown.starts_with("I/O error during sending waiting for rank 2")
                && shown.contains("Caused by:\n    pipe closed"),
            "{shown}"
        );
    }
}
