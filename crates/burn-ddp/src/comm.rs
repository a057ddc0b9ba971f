//! The communicator registry: the process-wide process group that burn-ddp's modules and
//! helpers communicate through (the NCCL communicator's is `nccl::installed`, feature
//! `cuda`).
//!
//! [`crate::init`] installs them once; layers such as `SyncBatchNorm` reach the group with
//! [`group`] and make no collective call when there is none or its world size is 1. This
//! module depends on no other module of the crate: everything that communicates depends on it.

use std::sync::{Arc, Mutex, OnceLock};

use ddp_comm::ProcessGroup;

/// A process group shared by everything in this process that communicates.
pub type SharedGroup = Arc<Mutex<ProcessGroup>>;

static GROUP: OnceLock<SharedGroup> = OnceLock::new();

/// Makes `pg` the process-wide group. Returns the installed group; if one was installed
/// before, `pg` is dropped and the earlier one is returned with `false`.
pub(crate) fn install(pg: ProcessGroup) -> (SharedGroup, bool) {
    let mut fresh = false;
    let g = GROUP.get_or_init(|| {
        fresh = true;
        Arc::new(Mutex::new(pg))
    });
    (g.clone(), fresh)
}

/// What [`crate::Ddp`] joined the process-wide group with, to refuse a second `init` with other
/// settings.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct JoinedWith {
    /// `rank/world_size@master_addr:master_port`.
    pub(crate) job: String,
    /// The group's options.
    pub(crate) options: ddp_comm::GroupOptions,
}

static JOINED_WITH: OnceLock<JoinedWith> = OnceLock::new();

/// Records the settings of the group [`crate::Ddp`] installed; the first call wins.
pub(crate) fn record_joined_with(joined: JoinedWith) {
    let _ = JOINED_WITH.set(joined);
}

/// The settings [`record_joined_with`] recorded, if any.
pub(crate) fn joined_with() -> Option<&'static JoinedWith> {
    JOINED_WITH.get()
}

/// The process-wide group, if `install` has been called.
pub fn group() -> Option<SharedGroup> {
    GROUP.get().cloned()
}

/// The world size of the process-wide group (1 when none is installed).
pub fn world_size() -> usize {
    group().map_or(1, |g| lock(&g).world_size())
}

/// Locks a shared group, recovering from a poisoned mutex (the group itself tracks errors).
pub(crate) fn lock(g: &SharedGroup) -> std::sync::MutexGuard<'_, ProcessGroup> {
    g.lock().unwrap_or_else(|e| e.into_inner())
}

/// Anything that names a process group to run a collective in: a [`Ddp`](crate::Ddp), or a
/// [`SharedGroup`] itself (e.g. `Arc::new(Mutex::new(ProcessGroup::single()))` in a program
/// that runs alone).
pub trait GroupHandle {
    /// The group.
    fn process_group(&self) -> &SharedGroup;
}

impl GroupHandle for SharedGroup {
    fn process_group(&self) -> &SharedGroup {
        self
    }
}
