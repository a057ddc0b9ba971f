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

/// Rank `rank`'s published address in the group's generation `generation` (in
/// [`PROCESS_GROUP`]): [`peer_addr`] for the first (0), `{generation}/addr/{rank}` for each
/// re-forming after a lost rank.
pub fn peer_addr_in(generation: u64, rank: usize) -> String {
    if generation == 0 {
        peer_addr(rank)
    } else {
        format!("{generation}/addr/{rank}")
    }
}

/// The group's latest generation (in [`PROCESS_GROUP`]; absent: 0), moved on by the survivors
/// of a lost rank with a compare-and-set. A forward-only counter ([`forward_only`]): the store
/// accepts no other change to it than [`forward_step`].
pub const MESH_GENERATION: &str = "mesh_generation";

/// Whether `key` (a full key, namespace included) is a forward-only counter: a decimal count
/// that the store lets any client move on by exactly one with a compare-and-set
/// ([`forward_step`]) and never otherwise — no `set`, `set_once`, `add`, end-of-connection count
/// or other compare-and-set (the store has no delete). So that no rank's key can move it back
/// (a rank writing the process group's generation to 0 would leave a replacement waiting for a
/// generation that never comes). One today: the process group's generation
/// (`ddp/pg/mesh_generation`, [`MESH_GENERATION`] in [`PROCESS_GROUP`]). The store keeps room
/// of its own for these counters: no rank's entries can fill it.
pub fn forward_only(key: &str) -> bool {
    key.strip_prefix(PROCESS_GROUP)
        .and_then(|rest| rest.strip_prefix('/'))
        == Some(MESH_GENERATION)
}

/// The one change the store accepts to a [`forward_only`] counter: a compare-and-set expecting
/// `expected` (`None`: absent, which counts as 0; else a count in decimal ASCII, as ddp-comm
/// writes it) and writing `desired`, exactly that count plus one (`(n + 1).to_string()`). A
/// count written otherwise (`"+1"`, `"01"`, not a number) is no step.
pub fn forward_step(expected: Option<&[u8]>, desired: &[u8]) -> bool {
    let count = |bytes: &[u8]| -> Option<u64> {
        let n: u64 = std::str::from_utf8(bytes).ok()?.parse().ok()?;
        (n.to_string().as_bytes() == bytes).then_some(n)
    };
    let from = match expected {
        None => Some(0),
        Some(e) => count(e),
    };
    from.and_then(|n| n.checked_add(1))
        .is_some_and(|next| next.to_string().as_bytes() == desired)
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

/// The rank that alone may change `key` (a full key, namespace included) in a store whose
/// ranks hold keys of their own ([`super::StoreServer::bind_per_rank`]): rank `r` for its
/// address (`…/addr/{r}`), its NCCL generation and arrival (`…/generation/{r}`,
/// `…/{g}/arrived/{r}`) and its trace pings (`…/ping/{r}/{n}`); rank 0 for NCCL's unique id
/// (`…/{g}/unique_id`) and the trace clock's answers (`…/pong/{r}/{n}`). `None`: any rank
/// may (counters and keys of the program's own).
pub fn owner(key: &str) -> Option<usize> {
    let parts: Vec<&str> = key.split('/').collect();
    let rank = |s: &str| s.parse::<usize>().ok();
    match parts.as_slice() {
        [.., "addr" | "generation" | "arrived", r] => rank(r),
        [.., "unique_id"] => Some(0),
        [.., "ping", r, n] if rank(n).is_some() => rank(r),
        [.., "pong", _, n] if rank(n).is_some() => Some(0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_owns_the_entries_it_publishes() {
        let full = |ns: &str, k: String| format!("{ns}/{k}");
        assert_eq!(owner(&full(PROCESS_GROUP, peer_addr(3))), Some(3));
        assert_eq!(owner(&full(PROCESS_GROUP, peer_addr_in(2, 3))), Some(3));
        assert_eq!(owner(&full(PROCESS_GROUP, MESH_GENERATION.into())), None);
        assert_eq!(owner(&full("nccl", nccl_generation(2))), Some(2));
        assert_eq!(owner(&full("nccl", nccl_arrived(7, 5))), Some(5));
        assert_eq!(owner(&full("nccl", nccl_unique_id(7))), Some(0));
        assert_eq!(owner(&full(TRACE, trace_ping(4, 1))), Some(4));
        assert_eq!(owner(&full(TRACE, trace_pong(4, 1))), Some(0));
        assert_eq!(owner(&launchers_state()), None);
        assert_eq!(owner("my/own/counter"), None);
        assert_eq!(owner(&full(PROCESS_GROUP, "addr/x".into())), None);
    }

    #[test]
    fn the_generation_counter_moves_forward_by_one_only() {
        let generation = format!("{PROCESS_GROUP}/{MESH_GENERATION}");
        assert!(forward_only(&generation));
        assert!(
            !forward_only(MESH_GENERATION),
            "only in the process group's namespace"
        );
        assert!(!forward_only("ddp/pgx/mesh_generation"));
        assert!(!forward_only(&format!("{generation}/1")));
        // As ddp-comm steps it: from absent to 1, then n to n + 1.
        assert!(forward_step(None, b"1"));
        assert!(forward_step(Some(b"1"), b"2"));
        assert!(forward_step(Some(b"41"), b"42"));
        assert!(forward_step(Some(b"0"), b"1"));
        for (expected, desired) in [
            (None, &b"0"[..]),
            (None, b"2"),
            (Some(&b"1"[..]), b"1"),
            (Some(b"2"), b"1"),
            (Some(b"2"), b"0"),
            (Some(b"1"), b"02"),
            (Some(b"1"), b"+2"),
            (Some(b"01"), b"2"),
            (Some(b"x"), b"1"),
            (Some(b""), b"1"),
            (Some(b"18446744073709551615"), b"18446744073709551616"),
        ] {
            assert!(
                !forward_step(expected, desired),
                "{expected:?} -> {desired:?}"
            );
        }
    }
}
