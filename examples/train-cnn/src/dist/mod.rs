//! The seam between the training loop and the process group.
//!
//! Everything the training program needs from distributed training goes through [`Cluster`] and
//! [`StepOptimizer`]. Two implementations:
//! - [`DdpCluster`] (module [`ddp`]): burn-ddp — `burn_ddp::init()`, `Ddp::replicate_model`,
//!   `DdpOptimizer`, the process group's collectives. The program uses it; launched alone it
//!   is a world of one.
//! - [`Local`]: one process, no communication, no process group — for in-process tests.

pub mod ddp;

pub use ddp::{Backend, DdpCluster};

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use burn_ddp::checkpoint::OptimizerState;
use burn_ddp::comm::SharedGroup;
use ddp_comm::ProcessGroup;

/// A failure of a collective operation or of the process group.
#[derive(Debug, thiserror::Error)]
#[error("distributed: {0}")]
pub struct DistError(pub String);

/// An optimizer as the training loop uses it: step, and save / restore its state (burn-ddp's
/// [`OptimizerState`], for checkpoints).
pub trait StepOptimizer: OptimizerState {
    /// Updates `module` from `grads` (after averaging them across ranks, for a distributed one).
    fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, DistError>;

    /// Timings of the last step's gradient synchronisation (`None` without one).
    fn last_sync(&self) -> Option<burn_ddp::SyncStats> {
        None
    }
}

impl StepOptimizer for ModuleOptimizer {
    fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, DistError> {
        Ok(ModuleOptimizer::step(self, lr, module, grads))
    }
}

/// What the training loop needs from the group of rank processes.
pub trait Cluster {
    /// The optimizer type this cluster steps with.
    type Optimizer: StepOptimizer;

    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of rank processes.
    fn world_size(&self) -> usize;
    /// Whether this is rank 0 (which prints, plots and writes checkpoints).
    fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// The device this rank trains on (with autodiff enabled).
    fn device(&self) -> Device;
    /// Returns `model` with rank 0's parameters and buffers on every rank.
    fn broadcast_model<M: Module>(&mut self, model: M) -> Result<M, DistError>;
    /// Wraps a plain optimizer into the one this cluster steps with.
    fn optimizer(&mut self, inner: ModuleOptimizer) -> Self::Optimizer;
    /// Element-wise sum of `values` over all ranks, in place.
    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<(), DistError>;
    /// The process group (for burn-ddp's collective checkpoint calls).
    fn group(&self) -> &SharedGroup;
    /// Waits for every rank.
    fn barrier(&mut self) -> Result<(), DistError>;
}

/// One process, no communication.
#[derive(Debug, Clone)]
pub struct Local {
    device: Device,
    group: SharedGroup,
}

impl Local {
    /// A single-process cluster training on `device` (autodiff is turned on).
    pub fn new(device: Device) -> Self {
        Self {
            device: device.autodiff(),
            group: Arc::new(Mutex::new(ProcessGroup::single())),
        }
    }
}

impl Cluster for Local {
    type Optimizer = ModuleOptimizer;

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn broadcast_model<M: Module>(&mut self, model: M) -> Result<M, DistError> {
        Ok(model)
    }

    fn optimizer(&mut self, inner: ModuleOptimizer) -> ModuleOptimizer {
        inner
    }

    fn all_reduce_sum(&mut self, _values: &mut [f64]) -> Result<(), DistError> {
        Ok(())
    }

    fn group(&self) -> &SharedGroup {
        &self.group
    }

    fn barrier(&mut self) -> Result<(), DistError> {
        Ok(())
    }
}
