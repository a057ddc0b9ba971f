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
    /// Rank 0 failed to write or read the checkpoint; this is its error, as every other rank
    /// reports it.
    #[error("on rank 0: {0}")]
    OnRankZero(String),
}
