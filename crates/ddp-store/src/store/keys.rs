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
//! - The launchers' rendezvous ([`LAUNCHERS`], `ddp/launchers`, in the store the rendezvous
//!   host's launcher serves, not rank 0's): `state` (the whole rendezvous, changed only by
//!   compare-and-set), `hb/{id}` (a launcher's heartbeat counter), `conn/{id}` and `gone/{id}`
//!   (its heartbeat connections opened and ended: gone once they are equal), `hb-coordinator`
//!   (the host's coordinator's heartbeat).

/// The process group's namespace.
pub const PROCESS_GROUP: &str = "ddp/pg";

/// Rank `rank`'s published address (in [`PROCESS_GROUP`]).
pub fn peer_addr(rank: usize) -> String {
    format!("addr/{rank}")
}

/// The trace clock synchronisation's namespace.
pub const TRACE: &str = "ddp/trace";

/// Rank `rank`'s ping of clock round `round` (in [`TRACE`]).
pub fn trace_ping(rank: usize, round: usize) -> String {
    format!("ping/{rank}/{round}")
}

/// Rank 0's answer to [`trace_ping`] (in [`TRACE`]).
pub fn trace_pong(rank: usize, round: usize) -> String {
    format!("pong/{rank}/{round}")
}

/// Rank `rank`'s generation counter (in NCCL's namespace).
pub fn nccl_generation(rank: usize) -> String {
    format!("generation/{rank}")
}

/// Set by rank `rank` when it reaches the rendezvous of `generation` (in NCCL's namespace).
pub fn nccl_arrived(generation: i64, rank: usize) -> String {
    format!("{generation}/arrived/{rank}")
}

/// The unique id of `generation` (in NCCL's namespace).
pub fn nccl_unique_id(generation: i64) -> String {
    format!("{generation}/unique_id")
}

/// The launchers' rendezvous namespace (in the rendezvous host's store).
pub const LAUNCHERS: &str = "ddp/launchers";

/// Launcher `id`'s heartbeat counter (in [`LAUNCHERS`]).
pub fn launcher_heartbeat(id: &str) -> String {
    format!("hb/{id}")
}

/// The launchers' whole rendezvous state, one value changed only by compare-and-set (full
/// key: the namespace is part of it).
pub fn launchers_state() -> String {
    format!("{LAUNCHERS}/state")
}

/// The counter of heartbeat connections launcher `id` opened (in [`LAUNCHERS`]).
pub fn launcher_connections(id: &str) -> String {
    format!("conn/{id}")
}

/// The counter the store adds to when one of launcher `id`'s heartbeat connections ends (in
/// [`LAUNCHERS`]): the launcher is gone once it reaches [`launcher_connections`].
pub fn launcher_gone(id: &str) -> String {
    format!("gone/{id}")
}

/// The coordinator's own heartbeat counter (in [`LAUNCHERS`]): members see a host whose
/// coordinator stopped.
pub const COORDINATOR_BEAT: &str = "hb-coordinator";
