//! The SyncBatchNorm equivalence case a test hands to `syncbn_worker` ranks, and what each rank
//! reports back. Shared by `ddp-tests`' `syncbn_worker` and `tests/sync_batch_norm.rs`.

use serde::{Deserialize, Serialize};

/// One equivalence case: per-rank inputs for a few training steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Case {
    /// "flex", "wgpu" or "cuda" (CUDA device `LOCAL_RANK`, or 0 when one is visible).
    pub device: String,
    /// On CUDA: the statistics travel through NCCL (`NcclPolicy::Required`; in a world of one
    /// a one-rank communicator), otherwise host-staged over the process group.
    #[serde(default)]
    pub nccl: bool,
    /// Use the tensor-op path even where kernels exist.
    pub tensor_ops: bool,
    /// PyTorch's unbiased running variance.
    pub unbiased: bool,
    /// Channels (axis 1).
    pub channels: usize,
    /// Spatial dims after the channel axis (empty for `[N, C]`, `[H, W]` for 4-D inputs).
    pub spatial: Vec<usize>,
    /// Rows (samples) of each rank.
    pub rows: Vec<usize>,
    /// Initial γ and β.
    pub gamma: Vec<f32>,
    /// Initial β.
    pub beta: Vec<f32>,
    /// Training steps.
    pub steps: Vec<Step>,
}

/// One step: every rank's input and loss weights (row-major `[rows, C, spatial…]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Step {
    /// Input per rank.
    pub x: Vec<Vec<f32>>,
    /// Loss weights per rank: the rank's loss is `Σ w ⊙ y` (sum reduction).
    pub w: Vec<Vec<f32>>,
}

/// What one rank reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RankResult {
    /// Per-step results.
    pub steps: Vec<StepResult>,
    /// Running mean after the last step.
    pub running_mean: Vec<f32>,
    /// Running variance after the last step.
    pub running_var: Vec<f32>,
}

/// One step's outputs on one rank.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StepResult {
    /// Forward output.
    pub y: Vec<f32>,
    /// Gradient of the (global) loss with respect to this rank's input.
    pub x_grad: Vec<f32>,
    /// γ gradient after DDP averaging (mean over ranks).
    pub gamma_grad: Vec<f32>,
    /// β gradient after DDP averaging (mean over ranks).
    pub beta_grad: Vec<f32>,
}

impl Case {
    /// Shape of rank `rank`'s input.
    pub fn shape(&self, rows: usize) -> Vec<usize> {
        let mut shape = vec![rows, self.channels];
        shape.extend(&self.spatial);
        shape
    }
}
