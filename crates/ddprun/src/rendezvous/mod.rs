//! The launchers' rendezvous: how the `ddprun`s of a job over several nodes agree on every
//! round (torchrun's c10d rendezvous, in this crate's store).
//!
//! The launcher started with `--node-rank 0` is the **rendezvous host**: it serves a store at
//! the rendezvous endpoint (`--rdzv-endpoint`, default `MASTER_ADDR:MASTER_PORT`) that outlives
//! every rank, and runs the coordinator ([`host`]). Every launcher, the host's too, is a
//! **member** ([`member`]): it connects with the job token, publishes its configuration,
//! heartbeats, and joins rounds.
//!
//! The whole rendezvous is **one state** ([`state::State`]) under one store key: the job's
//! configuration, the round, who waits, the running round and which of its nodes are done,
//! how the latest rounds ended and, at the end, the job's outcome and who has read it. Every
//! change is one compare-and-set of the whole state ([`change`]), by the host's coordinator or
//! by any launcher: a launcher that dies at any moment leaves the old state or the new one.
//!
//! A **round** is one start of the whole group. The coordinator closes round `r` when `MAX`
//! launchers wait, or when at least `MIN` do and the last call (`--rdzv-last-call`) has passed
//! since the `MIN`-th arrived; node ranks follow `--node-rank`, then arrival. The round's
//! node 0 is whichever launcher comes first, and the round's `MASTER_ADDR:MASTER_PORT` is its
//! own address and a port it found free on it: a round never points at a launcher outside it.
//! Each round's ranks get a job token of the round's own, so a rank or launcher left over
//! from an earlier round can never join, and `TORCHELASTIC_RESTART_COUNT` = the failed rounds
//! before it (torchrun's meaning: scale-ups do not count).
//!
//! A round **ends** once, by the first end written: a rank failed on some node, a launcher
//! is lost (its connection to the host closed — killed — or its heartbeat stopped for
//! `--rdzv-heartbeat-secs` — stopped, cut off), a launcher left (SIGINT/SIGTERM), a launcher
//! waits and the round has room (a scale-up), or every node's ranks exited 0. Every launcher
//! stops its ranks and applies one rule ([`messages::after`]): failures restart while
//! `--max-restarts` allows, scale-ups always do, the rest finishes the job with the end's
//! line and exit code on every node. The host keeps its store until every launcher has read
//! the job's end or is gone.
//!
//! A rank's failure is **noted** in the state the moment its launcher sees it, before its
//! cause settles (0.5 s): from then on only a failure can end the round, so a scale-up or a
//! joiner at the same moment never erases it. The end names the likeliest cause noted: a
//! rank killed by a signal, then a rank's own error, then a rank that only relayed a peer's.
//!
//! When the host's launcher itself dies, the other members' heartbeats fail (at once for a
//! closed connection; for a stopped host once it went unheard for [`Timing::host_silence`] and
//! a last try failed) and every node exits 1 with one line naming the host. Liveness is judged
//! on each judge's own running time ([`clock`]); a host that finds it was not running for
//! longer than the heartbeat timeout ends the job as lost itself, so every node still there
//! gets the same line and code.

mod clock;
pub(crate) mod fault;
pub(super) mod host;
pub(super) mod member;
pub(crate) mod messages;
pub(crate) mod state;

use std::time::Duration;

use ddp_comm::error::CommError;
use ddp_comm::store::{CompareSet, StoreClient, keys};
use messages::{decode, encode};
use state::State;

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
    /// How long stopped ranks get between SIGTERM and SIGKILL (the host waits that long, and
    /// more, for the others to read the job's end).
    pub grace: Duration,
}

impl Timing {
    /// How often a member heartbeats: five beats per timeout, between 50 ms and 2 s.
    pub fn beat(&self) -> Duration {
        (self.heartbeat / 5).clamp(Duration::from_millis(50), Duration::from_secs(2))
    }

    /// How long a member waits for one reply of the store before it tries again (a beat,
    /// between 250 ms and 1 s): short, so that a signal is acted on within a second; whether
    /// the host is gone is the heartbeat's judgement, not one reply's.
    pub fn request(&self) -> Duration {
        self.beat()
            .clamp(Duration::from_millis(250), Duration::from_secs(1))
    }

    /// How long a member lets the host go unheard, on its own running time, before it gives
    /// the host up: the heartbeat timeout and one and a half beats. The margin makes the two
    /// sides agree: a member hears the host at least every beat while it runs, so when a
    /// member gives the host up, the host was not running for longer than the heartbeat
    /// timeout (by half a beat at least), and it finds so itself when it runs again (it then
    /// ends the job; see `host`); a host stopped for less than the timeout is given up by
    /// nobody. A stopped host is given up within this, and a last try of a beat or the
    /// store's 1 s handshake floor, whichever is longer.
    pub fn host_silence(&self) -> Duration {
        self.heartbeat + self.beat() * 3 / 2
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
    /// The rendezvous stopped moving while this launcher waited in it.
    #[error(
        "the launchers' rendezvous at {endpoint} did not move for {after:.0?} while this node waited for round {round}"
    )]
    Stalled {
        /// The endpoint.
        endpoint: String,
        /// The round waited for.
        round: u64,
        /// How long nothing changed.
        after: Duration,
    },
    /// This launcher got SIGINT or SIGTERM while it had no ranks running: it left the job.
    #[error("{line}")]
    Interrupted {
        /// The signal.
        signal: i32,
        /// The line naming this node and what it was waiting for.
        line: String,
    },
}

impl RendezvousError {
    /// The exit code a launcher ends with for this error: 128 + the signal for an
    /// interruption, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            RendezvousError::Interrupted { signal, .. } => 128 + signal,
            _ => 1,
        }
    }
}

/// Why the state could not be read or changed: the store did not answer as it should (the
/// host may be slow, stopped or gone: the heartbeat judges), or what it holds is not a state
/// this launcher can read (the job cannot go on).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
    /// The store: a timeout, a closed connection, a refusal.
    #[error(transparent)]
    Store(#[from] CommError),
    /// The state is malformed, missing or vanished.
    #[error("the launchers' rendezvous state at {addr} {what}")]
    Broken {
        /// The store's address.
        addr: String,
        /// What is wrong with it.
        what: String,
    },
}

impl StateError {
    fn broken(client: &StoreClient, what: impl Into<String>) -> Self {
        StateError::Broken {
            addr: client.endpoint().to_string(),
            what: what.into(),
        }
    }
}

/// Decodes the state's bytes.
fn decode_state(client: &StoreClient, bytes: &[u8]) -> Result<State, StateError> {
    decode(client.endpoint(), &keys::launchers_state(), bytes)
        .map_err(|e| StateError::broken(client, format!("is malformed ({e})")))
}

/// The state as the store holds it now, with its bytes (what a compare-and-set expects);
/// `None` before the host wrote it.
pub(crate) fn read_state(client: &mut StoreClient) -> Result<Option<(Vec<u8>, State)>, StateError> {
    let Some(bytes) = client.try_get(&keys::launchers_state())? else {
        return Ok(None);
    };
    let state = decode_state(client, &bytes)?;
    Ok(Some((bytes, state)))
}

/// [`read_state`] once the host has written it: a missing state is broken.
pub(crate) fn read_written_state(client: &mut StoreClient) -> Result<State, StateError> {
    match read_state(client)? {
        Some((_, s)) => Ok(s),
        None => Err(StateError::broken(client, "is missing")),
    }
}

/// Changes the state by `f` in one compare-and-set: reads it, lets `f` change a copy (`None`:
/// nothing to change, nothing written), writes it if nobody changed it meanwhile, else reads
/// again and retries. Returns what `f` returned and the state as it is now. `step` names the
/// change for the test-only fault knob ([`fault`]). Every change may be tried again after a
/// store error: `f` is applied to the state as it is then, and each change is one that says
/// `None` once it is already made.
pub(crate) fn change<T>(
    client: &mut StoreClient,
    step: &'static str,
    mut f: impl FnMut(&mut State) -> Option<T>,
) -> Result<(Option<T>, State), StateError> {
    let key = keys::launchers_state();
    let Some((mut bytes, mut current)) = read_state(client)? else {
        return Err(StateError::broken(client, "is missing"));
    };
    loop {
        let mut next = current.clone();
        let Some(out) = f(&mut next) else {
            return Ok((None, current));
        };
        next.seq = current.seq + 1;
        let encoded = encode(&next);
        match client.compare_set(&key, Some(&bytes), &encoded)? {
            CompareSet::Swapped => {
                fault::after(step);
                return Ok((Some(out), next));
            }
            CompareSet::Current(Some(now)) => {
                current = decode_state(client, &now)?;
                bytes = now;
            }
            CompareSet::Current(None) => {
                return Err(StateError::broken(client, "vanished"));
            }
        }
    }
}

#[cfg(test)]
mod tests;
