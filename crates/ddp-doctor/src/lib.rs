//! The hang doctor's parts that live in every rank and in the launcher.
//!
//! - **The flight recorder** ([`recorder`]): every rank keeps, always on, a ring of its last
//!   [`RING_SIZE`] collectives — call number, operation, element type and count, the caller's
//!   [`Label`] ("gradient bucket 3"), the step and phase it was issued in, issued and finished
//!   times — plus its step, its phase ([`Phase`]) and where its last steps' time went (own
//!   work by phase, time inside collectives). `ddp-comm` records every collective of a
//!   process group; `burn-ddp` marks the phases it sees and labels its collectives.
//! - **Publishing** ([`publisher`]): when the launcher sets `DDP_PROGRESS_FILE`, a thread of the
//!   rank writes its [`RankSnapshot`] there every `DDP_PROGRESS_MS` (500 ms), whole, from the
//!   moment its process group forms ([`publisher::start`]).
//! - **Verdicts** ([`verdict`]): from the snapshots, [`verdict::hang`] (no collective finished
//!   for a while, ranks wait in one: which ranks wait, in what, and where each other rank is)
//!   and [`verdict::stragglers`] (a rank whose own work per step is a multiple of the others').
//! - **Dumps** ([`dump`]): the snapshots as JSON files, written by `ddprun` on SIGUSR1 or at a
//!   hang and read by `ddprun doctor`.
//!
//! The recorder's cost: two clock reads and two uncontended lock round trips per collective;
//! `DDP_RECORDER=0` turns it off (`cargo xtask bench ddp` measures both).

pub mod dump;
pub mod phase;
pub mod publisher;
pub mod recorder;
pub mod snapshot;
pub mod verdict;

pub use phase::Phase;
pub use recorder::{Label, PhaseGuard, RING_SIZE, enter, label_next, set_phase, step_done};
pub use snapshot::{CollectiveRecord, Observed, RankSnapshot, StepRecord};

#[cfg(test)]
mod tests;
