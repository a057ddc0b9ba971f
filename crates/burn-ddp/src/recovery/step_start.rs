//! The model as a step found it, to redo the step from after a lost peer: [`StepStart`].
//!
//! Parameters are immutable tensors, so the model a loop kept before
//! [`crate::DdpOptimizer::try_step`] still holds them; running statistics (BatchNorm's,
//! SyncBatchNorm's) are not: a clone shares them, and the failed step's forward already updated
//! them. Redone from there, the step would apply its update twice.

use std::marker::PhantomData;

use burn::module::Module;
use burn::store::ModuleRecord;
use burn_ddp_checkpoint::commit_running_states;

/// A model's parameters and running statistics at the start of a step: a record of their values
/// (read to the host: for a large model, a copy of it per step, so take one only when
/// [`crate::Ddp::recovers_live`]).
///
/// ```ignore
/// let start = ddp.recovers_live().then(|| StepStart::take(&model));
/// // ... forward, backward, optim.try_step(lr, model.clone(), grads) fails with a lost peer:
/// let before = match start {
///     Some(s) => s.restore(model),
///     None => model,
/// };
/// (model, progress) = ddp.recover(before, &mut optim, progress)?;
/// ```
#[derive(Debug)]
pub struct StepStart<M: Module> {
    record: ModuleRecord,
    model: PhantomData<fn() -> M>,
}

impl<M: Module> StepStart<M> {
    /// The values of `model` now (pending running-statistics updates committed first).
    pub fn take(model: &M) -> Self {
        commit_running_states(model);
        StepStart {
            record: model.clone().into_record(),
            model: PhantomData,
        }
    }

    /// `model` with the values [`StepStart::take`] saw: a failed step's updates of the running
    /// statistics undone.
    pub fn restore(self, model: M) -> M {
        // A pending update of the failed step would overwrite the loaded values at the next
        // forward.
        commit_running_states(&model);
        model.load_record(self.record)
    }
}
