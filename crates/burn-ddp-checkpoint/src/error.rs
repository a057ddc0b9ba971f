//! The error type of checkpoint saves, reads and restores.

use std::path::PathBuf;

/// Errors of saving, reading and restoring checkpoints.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The bytes are not a complete, undamaged checkpoint.
    #[error("checkpoint {path} is not usable: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint is fine but was written for another model or optimizer.
    #[error("checkpoint {path} does not fit this run: {reason}")]
    DoesNotFit {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A record or the metadata could not be serialised.
    #[error("cannot encode the checkpoint: {0}")]
    Encode(String),
    /// The other ranks waited for rank 0's save or read longer than the checkpoint deadline
    /// (burn-ddp's `Checkpointer::io_timeout`, `DDP_CHECKPOINT_TIMEOUT_SECS`).
    #[error(
        "checkpoint {path}: rank 0's {what} did not finish within {after:.0?} (the checkpoint \
         deadline: Checkpointer::io_timeout or DDP_CHECKPOINT_TIMEOUT_SECS, not the collective \
         deadline DDP_TIMEOUT_SECS); a slow file system, or rank 0 is stuck"
    )]
    Timeout {
        /// The file.
        path: PathBuf,
        /// `save` or `read`.
        what: &'static str,
        /// How long the ranks waited.
        after: std::time::Duration,
    },
    /// Rank 0 failed to write or read the checkpoint; this is its error, as every other rank
    /// reports it.
    #[error("on rank 0: {0}")]
    OnRankZero(String),
}
