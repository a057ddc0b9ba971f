//! What train-cnn keeps in its checkpoints beside the model and optimizer: the run's settings,
//! the metrics of the finished epochs and, for a checkpoint saved in the middle of an epoch,
//! that epoch's partial sums. The file itself (atomic write, checksum, rank 0 reads and
//! broadcasts) is burn-ddp's [`burn_ddp::checkpoint`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use burn_ddp::checkpoint::CheckpointError;

use crate::metrics::EpochMetrics;
use crate::model::ModelConfig;

/// The file name of the checkpoint under the output directory.
pub const FILE_NAME: &str = burn_ddp::checkpoint::DEFAULT_FILE_NAME;

/// A train-cnn checkpoint: burn-ddp's, with [`CheckpointMeta`] as its metadata.
pub type Checkpoint = burn_ddp::checkpoint::Checkpoint<CheckpointMeta>;

/// The sums of an epoch cut short by a checkpoint, over all ranks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PartialEpoch {
    /// Loss × samples, correct predictions, samples.
    pub sums: [f64; 3],
    /// Training seconds spent in the epoch so far.
    pub seconds: f64,
}

/// Everything in a train-cnn checkpoint besides the tensors and burn-ddp's progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Seed of the data order (the sampler uses `seed + epoch`).
    pub seed: u64,
    /// The network's shape (a resumed run must build the same one).
    pub model: ModelConfig,
    /// The norm layer the model was trained with (informational: the records are compatible).
    pub norm: String,
    /// Per-rank batch size of the run that wrote it.
    pub batch_size: usize,
    /// Learning rate (the peak of the schedule).
    pub lr: f64,
    /// The learning-rate schedule and the total number of epochs it spans (`--lr-schedule`,
    /// `--epochs`).
    pub schedule: (String, usize),
    /// The data source (`--data`).
    pub data: String,
    /// Metrics of the completed epochs.
    pub history: Vec<EpochMetrics>,
    /// The epoch in progress, when the checkpoint was saved in the middle of one.
    pub partial: Option<PartialEpoch>,
    /// The step after which this state's last mid-epoch checkpoint was saved: a run resumed
    /// from it, or a replacement that takes it from the survivors, does not save it again.
    #[serde(default)]
    pub saved_at_step: Option<u64>,
}

/// The parameter values of a checkpoint's model record, in visit order: the record decoded
/// into a BatchNorm network on the CPU (BatchNorm and SyncBatchNorm models have the same records).
/// Records name parameters by per-process ids, so compare these, not the bytes.
///
/// # Errors
/// When the record does not fit the checkpoint's own model shape.
pub fn parameter_values(ck: &Checkpoint) -> Result<Vec<f32>, CheckpointError> {
    let device = burn::tensor::Device::flex();
    let model = ck.metadata.model.init::<burn::nn::BatchNorm>(&device);
    let model = ck.restore_model(model, &PathBuf::from("<model record>"))?;
    Ok(crate::model::parameter_values(&model))
}
