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
//!   host's launcher serves, not rank 0's): `spec/{id}` (a launcher's configuration),
//!   `hb/{id}` (its heartbeat counter), `open` (the round taking joins), `join/{r}` and
//!   `joiner/{r}/{i}` (who joined round `r`, in order), `round/{r}` (the round as the host
//!   closed it, or its refusal), `end/{r}` and `end_claim/{r}` (how it ended, first claim
//!   wins), `done/{r}` (nodes whose ranks all exited 0), `bye/{r}` (launchers that read the
//!   job's end).

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

/// The launchers' rendezvous namespace (in the rendezvous host's store).
pub(crate) const LAUNCHERS: &str = "ddp/launchers";

/// Launcher `id`'s configuration (in [`LAUNCHERS`]).
pub(crate) fn launcher_spec(id: &str) -> String {
    format!("spec/{id}")
}

/// Launcher `id`'s heartbeat counter (in [`LAUNCHERS`]).
pub(crate) fn launcher_heartbeat(id: &str) -> String {
    format!("hb/{id}")
}

/// The number of the round that takes joins now (in [`LAUNCHERS`]).
pub(crate) const OPEN_ROUND: &str = "open";

/// The counter of launchers that joined round `round` (in [`LAUNCHERS`]).
pub(crate) fn round_joins(round: u64) -> String {
    format!("join/{round}")
}

/// The id of the `index`-th launcher (from 1) to join round `round` (in [`LAUNCHERS`]).
pub(crate) fn round_joiner(round: u64, index: i64) -> String {
    format!("joiner/{round}/{index}")
}

/// Round `round` as the host closed it (in [`LAUNCHERS`]).
pub(crate) fn round_info(round: u64) -> String {
    format!("round/{round}")
}

/// How round `round` ended (in [`LAUNCHERS`]).
pub(crate) fn round_end(round: u64) -> String {
    format!("end/{round}")
}

/// The claim counter of [`round_end`]: the claim that makes it 1 writes the end.
pub(crate) fn round_end_claim(round: u64) -> String {
    format!("end_claim/{round}")
}

/// The counter of nodes of round `round` whose ranks all exited 0 (in [`LAUNCHERS`]).
pub(crate) fn round_done(round: u64) -> String {
    format!("done/{round}")
}

/// The counter of launchers that have read the job's end in round `round` (in [`LAUNCHERS`]).
pub(crate) fn round_bye(round: u64) -> String {
    format!("bye/{round}")
}
