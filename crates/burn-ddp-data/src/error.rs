//! Errors of the distributed sampler and the sharded data loader.

use std::time::Duration;

/// Everything that can go wrong when configuring or running the sharded data pipeline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The world size (number of replicas) was 0.
    #[error("invalid data-parallel config: world size (num_replicas) must be at least 1, got 0")]
    ZeroReplicas,

    /// The rank is not smaller than the world size.
    #[error(
        "invalid data-parallel config: rank {rank} is out of range for world size {world_size} \
         (ranks are 0..{world_size})"
    )]
    RankOutOfRange {
        /// The rank that was given.
        rank: usize,
        /// The world size that was given.
        world_size: usize,
    },

    /// The per-rank batch size was 0.
    #[error("invalid data loader config: batch size must be at least 1, got 0")]
    ZeroBatchSize,

    /// The requested slice of the rank's items is not a valid range.
    #[error("invalid data loader slice {start}..{end} of a rank shard with {len} items")]
    InvalidSlice {
        /// Start of the requested range (inclusive).
        start: usize,
        /// End of the requested range (exclusive).
        end: usize,
        /// Items per rank and epoch.
        len: usize,
    },

    /// The dataset returned an error while fetching the items of a batch.
    #[error("dataset failed while loading batch {batch} of epoch {epoch}: {message}")]
    Dataset {
        /// Epoch of the pass.
        epoch: u64,
        /// Position of the batch in the epoch.
        batch: usize,
        /// The dataset's error, rendered.
        message: String,
    },

    /// The dataset or the batcher panicked while building a batch.
    #[error("data loader panicked while building batch {batch} of epoch {epoch}: {message}")]
    Panicked {
        /// Epoch of the pass.
        epoch: u64,
        /// Position of the batch in the epoch.
        batch: usize,
        /// The panic message.
        message: String,
    },

    /// A worker thread went away without delivering a batch it owed.
    #[error("data loader worker {worker} stopped before delivering batch {batch} of epoch {epoch}")]
    WorkerLost {
        /// Index of the worker thread.
        worker: usize,
        /// Position of the batch in the epoch.
        batch: usize,
        /// Epoch of the pass.
        epoch: u64,
    },

    /// A newer pass over the same loader was started while this one was still being read.
    #[error("pass over epoch {epoch} was superseded by a newer pass over the same loader")]
    Superseded {
        /// Epoch of the abandoned pass.
        epoch: u64,
    },

    /// No batch arrived within the configured batch timeout.
    #[error("timed out after {timeout:?} waiting for batch {batch} of epoch {epoch}")]
    Timeout {
        /// Position of the batch in the epoch.
        batch: usize,
        /// Epoch of the pass.
        epoch: u64,
        /// The timeout that elapsed.
        timeout: Duration,
    },

    /// A worker thread could not be started.
    #[error("could not spawn data loader worker thread: {0}")]
    Spawn(#[source] std::io::Error),
}
