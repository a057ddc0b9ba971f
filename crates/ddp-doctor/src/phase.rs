//! The phases of a training step, as the library knows them.

use serde::{Deserialize, Serialize};

/// Where in a step a rank is. The library marks the ones it sees (`burn-ddp`'s loaders mark
/// [`Phase::Data`] while they fetch and [`Phase::Forward`] when they hand a batch out; its
/// optimizers [`Phase::Sync`] and [`Phase::Optimizer`]; its checkpoints
/// [`Phase::Checkpoint`]); a program marks the others with [`crate::set_phase`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the first step: starting, forming the group, loading.
    Setup,
    /// Fetching the next batch.
    Data,
    /// The forward pass (the library cannot see where it ends: everything from a batch's
    /// hand-out to the optimizer is marked forward unless the program marks backward).
    Forward,
    /// The backward pass.
    Backward,
    /// Synchronising gradients.
    Sync,
    /// The optimizer's update.
    Optimizer,
    /// Saving or loading a checkpoint.
    Checkpoint,
    /// Anything else the program marks (evaluation, logging).
    Other,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 8] = [
        Phase::Setup,
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Sync,
        Phase::Optimizer,
        Phase::Checkpoint,
        Phase::Other,
    ];

    /// The lower-case name (`data`, `forward` …).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Sync => "sync",
            Phase::Optimizer => "optimizer",
            Phase::Checkpoint => "checkpoint",
            Phase::Other => "other",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
