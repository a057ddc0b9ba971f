//! A launcher's side of the rendezvous: connect, publish, heartbeat, join rounds, watch and
//! claim their ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::messages::{NodeSpec, RoundEnd, RoundOutcome, decode, encode};
use super::{RendezvousError, Timing, claim_end};
use crate::error::CommError;
use crate::store::{PrefixStore, Store, StoreClient, keys};

/// How long one blocking read waits before the member looks at its heartbeat again.
const SLICE: Duration = Duration::from_millis(250);

/// One launcher's membership of the job's rendezvous.
pub(crate) struct Member {
    endpoint: String,
    token: String,
    spec: NodeSpec,
    timing: Timing,
    client: StoreClient,
    heartbeat: Heartbeat,
}

impl Member {
    /// Connects to the host at `endpoint` (waiting up to the join timeout for it to come up),
    /// publishes `spec` and starts heartbeating.
    pub fn connect(
        endpoint: &str,
        token: &str,
        spec: NodeSpec,
        timing: Timing,
    ) -> Result<Self, RendezvousError> {
        let unreachable = |source| RendezvousError::Unreachable {
            endpoint: endpoint.to_string(),
            source,
        };
        let mut client = StoreClient::connect(endpoint, Some(token), timing.join_timeout)
            .map_err(unreachable)?;
        client.set_io_timeout(timing.heartbeat);
        PrefixStore::new(&mut client, keys::LAUNCHERS)
            .set(&keys::launcher_spec(&spec.id), &encode(&spec))
            .map_err(unreachable)?;
        let heartbeat = Heartbeat::start(endpoint, token, &spec.id, timing).map_err(unreachable)?;
        Ok(Member {
            endpoint: endpoint.to_string(),
            token: token.to_string(),
            spec,
            timing,
            client,
            heartbeat,
        })
    }

    /// This launcher's configuration.
    pub fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    /// Why the host is gone, if the heartbeat found out.
    pub fn host_gone(&self) -> Option<String> {
        self.heartbeat.gone()
    }

    fn gone(&self, detail: impl std::fmt::Display) -> RendezvousError {
        RendezvousError::HostGone {
            endpoint: self.endpoint.clone(),
            detail: self.heartbeat.gone().unwrap_or_else(|| detail.to_string()),
        }
    }

    fn ns(&mut self) -> PrefixStore<'_, StoreClient> {
        PrefixStore::new(&mut self.client, keys::LAUNCHERS)
    }

    /// Blocks until `key` exists, in slices, failing when the host is gone or after `limit`
    /// without `keep_waiting` saying so.
    fn wait_for(
        &mut self,
        key: &str,
        mut keep_waiting: impl FnMut(&mut Self) -> bool,
        limit: Duration,
    ) -> Result<Vec<u8>, RendezvousError> {
        let mut since = Instant::now();
        loop {
            match self.ns().get(key, SLICE) {
                Ok(v) => return Ok(v),
                Err(CommError::Timeout { .. }) if self.client.is_usable() => {}
                Err(e) => return Err(self.gone(e)),
            }
            if let Some(why) = self.heartbeat.gone() {
                return Err(self.gone(why));
            }
            if keep_waiting(self) {
                since = Instant::now();
            } else if since.elapsed() > limit {
                return Err(RendezvousError::NotAdmitted { after: limit });
            }
        }
    }

    /// The round that takes joins now (the host sets it before anyone can join).
    pub fn open_round(&mut self) -> Result<u64, RendezvousError> {
        let limit = self.timing.join_timeout;
        let v = self.wait_for(keys::OPEN_ROUND, |_| false, limit)?;
        let endpoint = self.endpoint.clone();
        decode(&endpoint, keys::OPEN_ROUND, &v).map_err(|e| self.gone(e))
    }

    /// Joins `round` and waits until the host closed it. While an earlier round is still
    /// running (this launcher came late, or the round was full), it waits as long as that round
    /// runs; otherwise up to the join timeout and twice the heartbeat timeout.
    pub fn join(&mut self, round: u64) -> Result<RoundOutcome, RendezvousError> {
        let id = self.spec.id.clone();
        let index = self
            .ns()
            .add(&keys::round_joins(round), 1)
            .map_err(|e| self.gone(e))?;
        self.ns()
            .set(&keys::round_joiner(round, index), id.as_bytes())
            .map_err(|e| self.gone(e))?;
        tracing::debug!(round, index, "joined the launchers' rendezvous round");
        let limit = self.timing.join_timeout + 2 * self.timing.heartbeat;
        let running_before = |m: &mut Self| {
            round > 0 && {
                let mut ns = m.ns();
                matches!(ns.try_get(&keys::round_info(round - 1)), Ok(Some(_)))
                    && matches!(ns.try_get(&keys::round_end(round - 1)), Ok(None))
            }
        };
        let key = keys::round_info(round);
        let v = self.wait_for(&key, running_before, limit)?;
        let endpoint = self.endpoint.clone();
        decode(&endpoint, &key, &v).map_err(|e| self.gone(e))
    }

    /// Claims `end` as the end of `round` (a later claim of another launcher loses).
    pub fn claim(&mut self, round: u64, end: &RoundEnd) -> Result<bool, RendezvousError> {
        claim_end(&mut self.client, round, end).map_err(|e| self.gone(e))
    }

    /// Counts this node's ranks as done in `round`; the last of `nodes` to do so claims the
    /// round's end as done.
    pub fn mark_done(&mut self, round: u64, nodes: usize) -> Result<(), RendezvousError> {
        let done = self
            .ns()
            .add(&keys::round_done(round), 1)
            .map_err(|e| self.gone(e))?;
        if done as usize >= nodes {
            let end = RoundEnd {
                kind: super::messages::EndKind::Done,
                line: format!("ddprun: every rank of all {nodes} nodes exited 0"),
                exit_code: 0,
            };
            self.claim(round, &end)?;
        }
        Ok(())
    }

    /// Waits for the end of `round`: as long as the host is there (its coordinator ends a round
    /// whose launchers stop heartbeating).
    pub fn wait_end(&mut self, round: u64) -> Result<RoundEnd, RendezvousError> {
        let key = keys::round_end(round);
        let v = self.wait_for(&key, |_| true, Duration::MAX)?;
        let endpoint = self.endpoint.clone();
        decode(&endpoint, &key, &v).map_err(|e| self.gone(e))
    }

    /// Says that this launcher read the job's end in `round` (the host waits for every
    /// member's before it closes the store). Errors are ignored: the job is over.
    pub fn bye(&mut self, round: u64) {
        let _ = self.ns().add(&keys::round_bye(round), 1);
    }

    /// Starts watching for the end of `round` on a connection of its own.
    pub fn watch(&self, round: u64) -> Result<RoundWatch, RendezvousError> {
        RoundWatch::start(&self.endpoint, &self.token, round, self.timing).map_err(|e| self.gone(e))
    }
}

/// A thread that adds to this launcher's heartbeat counter every [`Timing::beat`].
struct Heartbeat {
    stop: Arc<AtomicBool>,
    gone: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    fn start(endpoint: &str, token: &str, id: &str, timing: Timing) -> crate::Result<Self> {
        let mut client = StoreClient::connect(endpoint, Some(token), timing.heartbeat)?;
        client.set_io_timeout(timing.heartbeat);
        let key = keys::launcher_heartbeat(id);
        PrefixStore::new(&mut client, keys::LAUNCHERS).add(&key, 1)?;
        let stop = Arc::new(AtomicBool::new(false));
        let gone = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, gone) = (Arc::clone(&stop), Arc::clone(&gone));
            std::thread::Builder::new()
                .name("ddprun-heartbeat".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::park_timeout(timing.beat());
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        if let Err(e) = PrefixStore::new(&mut client, keys::LAUNCHERS).add(&key, 1)
                        {
                            tracing::debug!("heartbeat to the rendezvous host failed: {e}");
                            *gone.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("its heartbeat failed: {e}"));
                            break;
                        }
                    }
                })
                .map_err(|e| CommError::io("starting the heartbeat thread", None, e))?
        };
        Ok(Heartbeat {
            stop,
            gone,
            thread: Some(thread),
        })
    }

    fn gone(&self) -> Option<String> {
        self.gone.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// What a [`RoundWatch`] saw.
#[derive(Debug, Clone)]
pub(crate) enum Seen {
    /// The round ended.
    Ended(RoundEnd),
    /// The host stopped answering.
    HostGone(String),
}

/// A thread blocked on the end of one round, so that the launcher's watch loop learns of it
/// within milliseconds.
pub(crate) struct RoundWatch {
    seen: Arc<Mutex<Option<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RoundWatch {
    fn start(endpoint: &str, token: &str, round: u64, timing: Timing) -> crate::Result<Self> {
        let mut client = StoreClient::connect(endpoint, Some(token), timing.heartbeat)?;
        client.set_io_timeout(timing.heartbeat);
        let seen = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let endpoint = endpoint.to_string();
        let thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("ddprun-round-watch".into())
                .spawn(move || {
                    let key = keys::round_end(round);
                    let what = loop {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let mut ns = PrefixStore::new(&mut client, keys::LAUNCHERS);
                        match ns.get(&key, SLICE) {
                            Ok(v) => match decode::<RoundEnd>(&endpoint, &key, &v) {
                                Ok(end) => break Seen::Ended(end),
                                Err(e) => break Seen::HostGone(e.to_string()),
                            },
                            Err(CommError::Timeout { .. }) if client.is_usable() => {}
                            Err(e) => break Seen::HostGone(e.to_string()),
                        }
                    };
                    *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(what);
                })
                .map_err(|e| CommError::io("starting the round watch thread", None, e))?
        };
        Ok(RoundWatch {
            seen,
            stop,
            thread: Some(thread),
        })
    }

    /// What the watch has seen so far.
    pub fn seen(&self) -> Option<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for RoundWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
