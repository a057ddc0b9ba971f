//! Burn's `RunningState` buffers (BatchNorm's and SyncBatchNorm's running mean and variance)
//! committed before a module's tensors are read or replaced: [`commit_running_states`].
//!
//! `RunningState::update` leaves the newest value pending on its thread, and the value a
//! `Module::visit` reads — what `into_record`, a checkpoint and rank 0's broadcast see — is
//! the one before it ("might be outdated by one update", Burn's docs say). The next forward
//! commits it. So a checkpoint saved after step K held the running statistics of step K − 1,
//! and a run resumed from it never applied batch K's update (measured before the fix: running
//! statistics up to 0.06 off the uninterrupted run's while every parameter was bitwise equal);
//! and a record loaded into a module with a pending update was overwritten by that update at
//! the next forward.

use burn::module::Module;

/// Commits every pending `RunningState` update of `module` in place, so that a visit reads
/// the newest values and a value mapped in (a loaded record, rank 0's broadcast) is not
/// overwritten by an older pending one.
///
/// `Module::valid` is the one public operation of Burn 0.22 that commits them (each
/// `RunningState` syncs its shared state, then copies it); the copy it returns is dropped.
/// Committing averages the pending values of every thread into the state, as the next forward
/// would have; with one training thread per rank that is exactly the last update.
pub fn commit_running_states<M: Module>(module: &M) {
    let _committed = module.valid();
}
