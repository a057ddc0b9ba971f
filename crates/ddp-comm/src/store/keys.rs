//! Every key ddp-comm writes to the rendezvous store, built in one place.
//!
//! Each user of the store works inside a [`PrefixStore`](super::PrefixStore) namespace; the
//! functions here build the keys relative to it.
//!
//! - Process group ([`PROCESS_GROUP`], `ddp/pg`): `addr/{rank}`, each rank's listener address
//!   and host identity.
//! - NCCL (a prefix of the caller's choosing, `nccl` by default): `generation/{rank}`, a
//!   counter whose new value is the generation `g` of a communicator creation;
//!   `{g}/arrived/{rank}`, set by each rank before it creates its communicator;
//!   `{g}/unique_id`, the id rank 0 publishes.
//! - Trace clock synchronisation ([`TRACE`], `ddp/trace`, only with `DDP_TRACE` set):
//!   `ping/{rank}/{round}`, set by a rank, and `pong/{rank}/{round}`, rank 0's clock in answer.

/// The process group's namespace.
pub(crate) const PROCESS_GROUP: &str = "ddp/pg";

/// Rank `rank`'s published address (in [`PROCESS_GROUP`]).
pub(crate) fn peer_addr(rank: usize) -> String {
    format!("addr/{rank}")
}

/// The trace clock synchronisation's namespace.
pub(crate) const TRACE: &str = "ddp/trace";

/// Rank `rank`'s ping of clock round `round` (in [`TRACE`]).
pub(crate) fn trace_ping(rank: usize, round: usize) -> String {
    format!("ping/{rank}/{round}")
}

/// Rank 0's answer to [`trace_ping`] (in [`TRACE`]).
pub(crate) fn trace_pong(rank: usize, round: usize) -> String {
    format!("pong/{rank}/{round}")
}

/// Rank `rank`'s generation counter (in NCCL's namespace).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn nccl_generation(rank: usize) -> String {
    format!("generation/{rank}")
}

/// Set by rank `rank` when it reaches the rendezvous of `generation` (in NCCL's namespace).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn nccl_arrived(generation: i64, rank: usize) -> String {
    format!("{generation}/arrived/{rank}")
}

/// The unique id of `generation` (in NCCL's namespace).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn nccl_unique_id(generation: i64) -> String {
    format!("{generation}/unique_id")
}
