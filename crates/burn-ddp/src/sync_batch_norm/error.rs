//! The error type of SyncBatchNorm's forward pass.

/// An error from [`SyncBatchNorm::try_forward`](super::SyncBatchNorm::try_forward).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SyncBatchNormError {
    /// The input has rank < 2.
    #[error(
        "SyncBatchNorm expects an input of shape [batch, channels, ...] (rank >= 2), got rank {0}"
    )]
    Rank(usize),
    /// The input's channel axis doesn't match `num_features`.
    #[error("SyncBatchNorm has {expected} features but the input has {got} channels (axis 1)")]
    Channels {
        /// `num_features` of the layer.
        expected: usize,
        /// Size of the input's axis 1.
        got: usize,
    },
    /// No rank had any sample.
    #[error("SyncBatchNorm: no rank has any sample in this batch (total count 0)")]
    NoSamples,
    /// The device's backend has no SyncBatchNorm implementation and the world size is > 1.
    #[error(
        "SyncBatchNorm with world size {world_size}: the backend of {device} has no SyncBatchNorm implementation (Flex and CubeCL devices do)"
    )]
    UnsupportedBackend {
        /// The input's device.
        device: String,
        /// The process group's world size.
        world_size: usize,
    },
    /// A collective failed (the process group is broken on every rank).
    #[error("SyncBatchNorm: collective failed: {0}")]
    Comm(#[from] ddp_comm::CommError),
    /// Device memory could not be read or handed to NCCL, or an NCCL collective failed.
    #[error("SyncBatchNorm: {0}")]
    Device(String),
}

/// A lost peer's [`SyncBatchNormError::Comm`] unwinds to an enclosing
/// [`Ddp::catch_lost_peer`](crate::Ddp::catch_lost_peer); any other error is returned.
pub(crate) fn unwind_if_lost_peer(error: SyncBatchNormError) -> SyncBatchNormError {
    match error {
        SyncBatchNormError::Comm(e) => {
            SyncBatchNormError::Comm(crate::recovery::unwind::unwind_if_caught(e))
        }
        other => other,
    }
}
