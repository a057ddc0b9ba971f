//! What `data_worker` (the sharded-loader rank program) reports per epoch, as one JSON line.

use serde::{Deserialize, Serialize};

/// One epoch of one rank: the batches it read and the dataset ids in them, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochReport {
    /// The rank.
    pub rank: usize,
    /// The epoch.
    pub epoch: u64,
    /// Batches read.
    pub batches: usize,
    /// Size of each batch.
    pub batch_sizes: Vec<usize>,
    /// The dataset ids, in the order read.
    pub ids: Vec<i64>,
}

/// One batch of `data_worker`'s elastic mode (`STATE_FILE` set), as one JSON line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumedBatch {
    /// The restart round (`DDP_RESTART_COUNT`).
    pub attempt: u64,
    /// The world size of that round.
    pub world: usize,
    /// The epoch.
    pub epoch: u64,
    /// The epoch's global sample position before the batch.
    pub before: Option<u64>,
    /// The dataset ids of the batch.
    pub ids: Vec<i64>,
}
