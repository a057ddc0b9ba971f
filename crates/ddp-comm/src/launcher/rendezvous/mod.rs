//! The launchers' rendezvous: how the `ddprun`s of a job over several nodes agree on every
//! round (torchrun's c10d rendezvous, in this crate's store).
//!
//! The launcher started with `--node-rank 0` is the **rendezvous host**: it serves a store at
//! the rendezvous endpoint (`--rdzv-endpoint`, default `MASTER_ADDR:MASTER_PORT`) that outlives
//! every rank, and runs the coordinator ([`host`]). Every launcher, the host's too, is a
//! **member** ([`member`]): it connects with the job token, publishes its configuration,
//! heartbeats, and joins rounds.
//!
//! A **round** is one start of the whole group. The host closes round `r` when `MAX` launchers
//! have joined, or when at least `MIN` have and the last call (`--rdzv-last-call`) has passed
//! since the `MIN`-th; it assigns node ranks (the host first, then by `--node-rank`, then by
//! arrival), picks a fresh port for the round's rank 0 and writes the round. Each round's ranks
//! get `DDP_RESTART_COUNT = TORCHELASTIC_RESTART_COUNT = r` and a job token of the round's own,
//! so a rank or launcher left over from an earlier round can never join.
//!
//! A round **ends** once, by the first claim: a rank failed on some node (its launcher claims
//! it the moment it sees the exit), a launcher stopped heartbeating for `--rdzv-heartbeat-secs`
//! (the host claims it: a SIGKILLed or SIGSTOPped ddprun, a node cut off), a launcher got
//! SIGINT/SIGTERM, a launcher is waiting and the round has room (scale-up: torchrun's policy,
//! the group restarts to admit it), or every node's ranks exited 0. Every launcher watches the
//! end, stops its ranks (SIGTERM, grace, SIGKILL) and applies one rule ([`messages::after`]):
//! failures and lost nodes restart while `--max-restarts` allows (counted for the whole job),
//! scale-ups always restart, the rest ends the job with the end's exit code on every node.
//!
//! When the host's launcher itself dies, the other members' heartbeats fail (at once for a
//! closed connection, within the heartbeat timeout for a stopped host) and every node exits 1
//! with one line naming the host.

pub(super) mod host;
pub(super) mod member;
pub(crate) mod messages;

use std::time::Duration;

use crate::error::{CommError, Result};
use crate::store::{PrefixStore, Store, keys};
use messages::{RoundEnd, encode};

/// The launchers' rendezvous timings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Timing {
    /// A launcher whose heartbeat did not advance for this long is lost; a member whose
    /// heartbeat to the host fails for this long has lost the host.
    pub heartbeat: Duration,
    /// With `MIN` launchers joined (and fewer than `MAX`), how long the host waits for more.
    pub last_call: Duration,
    /// How long a round may take to gather `MIN` launchers before the job fails.
    pub join_timeout: Duration,
}

impl Timing {
    /// How often a member heartbeats: five beats per timeout, between 50 ms and 2 s.
    pub fn beat(&self) -> Duration {
        (self.heartbeat / 5).clamp(Duration::from_millis(50), Duration::from_secs(2))
    }
}

/// How often the host's coordinator looks at the store.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// Why the launchers' rendezvous failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The rendezvous host could not serve its store.
    #[error("cannot serve the launchers' rendezvous at {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The underlying error.
        #[source]
        source: CommError,
    },
    /// This launcher could not reach the host (or was refused by it).
    #[error("cannot join the launchers' rendezvous at {endpoint} (node 0's ddprun): {source}")]
    Unreachable {
        /// The endpoint.
        endpoint: String,
        /// The underlying error.
        #[source]
        source: CommError,
    },
    /// The host stopped answering while the job ran.
    #[error(
        "lost the launchers' rendezvous host at {endpoint} (node 0's ddprun: killed, stopped or cut off?): {detail}"
    )]
    HostGone {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        detail: String,
    },
    /// The host refused to start a round (too few nodes, a node that differs): the message
    /// names the nodes.
    #[error("{line}")]
    Refused {
        /// The host's line.
        line: String,
    },
    /// No round admitted this launcher in time.
    #[error(
        "no round of the job admitted this node within {after:.0?} (the job was full: --nnodes MAX launchers were running)"
    )]
    NotAdmitted {
        /// How long it waited.
        after: Duration,
    },
}

/// Writes `end` as the end of `round` unless another launcher claimed it first; returns
/// whether this claim won.
pub(crate) fn claim_end(store: &mut impl Store, round: u64, end: &RoundEnd) -> Result<bool> {
    let mut ns = PrefixStore::new(store, keys::LAUNCHERS);
    if ns.add(&keys::round_end_claim(round), 1)? != 1 {
        return Ok(false);
    }
    ns.set(&keys::round_end(round), &encode(end))?;
    Ok(true)
}

#[cfg(test)]
mod tests;
