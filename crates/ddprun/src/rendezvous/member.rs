//! A launcher's side of the rendezvous: connect, check its configuration against the job's,
//! heartbeat, join rounds, end them, and read the job's end. Every wait here looks at the
//! launcher's signals, the host's liveness and (on the host) the coordinator, slice by slice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::messages::{EndKind, NodeSpec, RoundEnd, RoundInfo};
use super::state::{Joiner, Phase, State};
use super::{RendezvousError, TICK, Timing, change, read_state};
use crate::signals::{caught, signal_name};
use ddp_comm::error::{CommError, Result};
use ddp_comm::store::{PrefixStore, Store, StoreClient, keys};

/// How often a waiting member reads the state.
const POLL: Duration = Duration::from_millis(25);

/// What a [`Member::join`] got.
#[derive(Debug)]
pub(crate) enum Joined {
    /// A round with this launcher in it.
    Started(RoundInfo),
    /// The job is over (it ended before this launcher got a round).
    Finished(RoundEnd),
    /// A round with this launcher in it started and ended before this launcher looked.
    Missed(RoundInfo, RoundEnd),
}

/// One launcher's membership of the job's rendezvous.
pub(crate) struct Member {
    endpoint: String,
    token: String,
    spec: NodeSpec,
    timing: Timing,
    client: StoreClient,
    heartbeat: Heartbeat,
    /// This launcher's address as the host sees it (where its rank 0 serves when it is node
    /// 0 of a round).
    addr: String,
    /// Whether SIGINT/SIGTERM are caught for this launcher (then every wait looks at them).
    signals: bool,
    /// On the host: the coordinator's failure, once it failed.
    coordinator: Option<Arc<Mutex<Option<String>>>>,
}

impl Member {
    /// Connects to the host at `endpoint` (waiting up to the join timeout for it to come
    /// up; `signals`: a caught SIGINT/SIGTERM ends every wait), starts heartbeating, and checks `spec` against the job's configuration: a launcher
    /// that differs is refused with one line naming what differs (the job goes on).
    pub fn connect(
        endpoint: &str,
        token: &str,
        spec: NodeSpec,
        timing: Timing,
        signals: bool,
        local_addr: Option<&str>,
        coordinator: Option<Arc<Mutex<Option<String>>>>,
    ) -> Result<Self, RendezvousError> {
        let unreachable = |source| RendezvousError::Unreachable {
            endpoint: endpoint.to_string(),
            source,
        };
        // In slices, so that a signal ends the wait for a host that is not up yet.
        let started = Instant::now();
        let mut client = loop {
            let slice = Duration::from_millis(500);
            match StoreClient::connect(endpoint, Some(token), slice) {
                Ok(c) => break c,
                Err(CommError::Timeout { .. }) if started.elapsed() < timing.join_timeout => {
                    if signals && let Some((sig, _)) = caught() {
                        return Err(RendezvousError::Interrupted {
                            signal: sig,
                            line: format!(
                                "ddprun: {} received {} while connecting to the launchers' rendezvous at {endpoint}",
                                spec.label(),
                                signal_name(sig)
                            ),
                        });
                    }
                }
                Err(e) => return Err(unreachable(e)),
            }
        };
        client.set_io_timeout(timing.heartbeat);
        let addr = match local_addr {
            Some(a) => a.to_string(),
            None => client
                .local_addr()
                .map_err(|e| unreachable(CommError::io("reading this end's address", None, e)))?
                .ip()
                .to_string(),
        };
        let heartbeat = Heartbeat::start(endpoint, token, &spec.id, timing).map_err(unreachable)?;
        let mut member = Member {
            endpoint: endpoint.to_string(),
            token: token.to_string(),
            spec,
            timing,
            client,
            heartbeat,
            addr,
            signals,
            coordinator,
        };
        member.admit()?;
        Ok(member)
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
        if self.coordinator.is_some() {
            // This launcher is the host: its own rendezvous broke.
            return RendezvousError::Refused {
                line: format!(
                    "ddprun: the launchers' rendezvous on {} (the host) broke: {detail}; the job stops",
                    self.spec.label()
                ),
            };
        }
        RendezvousError::HostGone {
            endpoint: self.endpoint.clone(),
            detail: self.heartbeat.gone().unwrap_or_else(|| detail.to_string()),
        }
    }

    /// What ends a wait besides its own condition: a signal, the host gone, the coordinator
    /// failed. `what` says what was waited for.
    fn interrupted(&self, what: &str) -> Option<RendezvousError> {
        if self.signals
            && let Some((sig, _)) = caught()
        {
            return Some(RendezvousError::Interrupted {
                signal: sig,
                line: format!(
                    "ddprun: {} received {} while {what}; it leaves the job",
                    self.spec.label(),
                    signal_name(sig)
                ),
            });
        }
        if let Some(cell) = &self.coordinator
            && let Some(line) = cell.lock().unwrap_or_else(|p| p.into_inner()).clone()
        {
            return Some(RendezvousError::Refused { line });
        }
        self.heartbeat.gone().map(|d| self.gone(d))
    }

    fn read(&mut self) -> Result<State, RendezvousError> {
        match read_state(&mut self.client) {
            Ok(Some((_, s))) => Ok(s),
            Ok(None) => Err(self.gone("the launchers' rendezvous state is missing")),
            Err(e) => Err(self.gone(e)),
        }
    }

    fn change<T>(
        &mut self,
        step: &'static str,
        f: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<(Option<T>, State), RendezvousError> {
        change(&mut self.client, step, f).map_err(|e| self.gone(e))
    }

    /// Waits for the job's state (the host writes it as it starts) and refuses this launcher
    /// if it differs from the job.
    fn admit(&mut self) -> Result<(), RendezvousError> {
        let deadline = Instant::now() + self.timing.heartbeat;
        let state = loop {
            match read_state(&mut self.client) {
                Ok(Some((_, s))) => break s,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                Ok(None) => return Err(self.gone("the launchers' rendezvous state is missing")),
                Err(e) => return Err(self.gone(e)),
            }
        };
        let why = if self.spec.id != state.job.id && self.spec.requested_node_rank == 0 {
            Some(format!(
                "ddprun: {} was also started with --node-rank 0; only the rendezvous host may be (give every other node a rank from 1)",
                self.spec.label()
            ))
        } else {
            let differs = self.spec.differences(&state.job);
            (!differs.is_empty()).then(|| {
                format!(
                    "ddprun: {} differs from the job (node 0's ddprun): {}; it is refused and the job goes on without it",
                    self.spec.label(),
                    differs.join(", ")
                )
            })
        };
        let Some(line) = why else { return Ok(()) };
        // Only logged by the host: the refused launcher exits with the line.
        let logged = line.clone();
        self.change("refuse", |s| {
            s.refuse(logged.clone());
            Some(())
        })?;
        Err(RendezvousError::Refused { line })
    }

    /// Waits for a round with this launcher in it (or the job's end). Joins the queue, and
    /// joins again if the host dropped it (it looked lost) or a round closed without it.
    pub fn join(&mut self) -> Result<Joined, RendezvousError> {
        let mut last_change = (u64::MAX, Instant::now());
        let mut joined_round = None;
        loop {
            let state = self.read()?;
            if let Phase::Finished { end, .. } = &state.phase {
                return Ok(Joined::Finished(end.clone()));
            }
            if let Some(info) = state.running()
                && info.node_rank(&self.spec.id).is_some()
                && joined_round.is_some_and(|r| info.round >= r)
            {
                return Ok(Joined::Started(info.clone()));
            }
            if let Some(r) = joined_round
                && let Some((info, end)) = state.ended_with(&self.spec.id, r)
            {
                return Ok(Joined::Missed(info.clone(), end.clone()));
            }
            if !state.is_waiting(&self.spec.id) {
                let port = crate::net::free_port(&self.addr).map_err(|e| {
                    self.gone(CommError::io(
                        format!("finding a free port on {} for a round's rank 0", self.addr),
                        None,
                        e,
                    ))
                })?;
                let joiner = Joiner {
                    id: self.spec.id.clone(),
                    label: self.spec.label(),
                    requested_node_rank: self.spec.requested_node_rank,
                    arrival: 0,
                    master_addr: self.addr.clone(),
                    master_port: port,
                    stop_within_ms: u64::try_from(
                        (self.timing.grace + crate::OUTPUT_DRAIN).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                };
                let (done, now) = self.change("join", |s| s.join(joiner.clone()).then_some(()))?;
                if done.is_some() {
                    joined_round = Some(now.round);
                    tracing::debug!(round = now.round, "waiting for a round");
                }
                continue;
            }
            let what = format!("waiting for round {}", state.round);
            if let Some(e) = self.interrupted(&what) {
                if let RendezvousError::Interrupted { signal, line } = &e {
                    self.leave_after_signal(None, *signal, line);
                }
                return Err(e);
            }
            // A gathering that does not move: the coordinator ends it at the join timeout; this
            // is the safety net if it cannot.
            if state.seq != last_change.0 {
                last_change = (state.seq, Instant::now());
            } else if state.phase == Phase::Gathering
                && last_change.1.elapsed() > self.timing.join_timeout + 2 * self.timing.heartbeat
            {
                return Err(RendezvousError::Stalled {
                    endpoint: self.endpoint.clone(),
                    round: state.round,
                    after: last_change.1.elapsed(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Writes `end` as the end of `round` unless the round already ended; returns the
    /// round's end as it stands (this one, or the one written first).
    pub fn claim(&mut self, round: u64, end: &RoundEnd) -> Result<RoundEnd, RendezvousError> {
        let (_, state) = self.change("claim", |s| s.end_round(round, end.clone()).then_some(()))?;
        Ok(state.end_of(round).cloned().unwrap_or_else(|| end.clone()))
    }

    /// Counts this node's ranks as done in `round` (the last node ends the round as done).
    pub fn mark_done(&mut self, round: u64) -> Result<(), RendezvousError> {
        let id = self.spec.id.clone();
        self.change("done", |s| s.mark_done(round, &id).then_some(()))?;
        Ok(())
    }

    /// Waits for the end of `round`: as long as the host is there. A signal meanwhile makes
    /// this node leave the round (its end, if it is the first).
    pub fn wait_end(&mut self, round: u64) -> Result<RoundEnd, RendezvousError> {
        loop {
            let state = self.read()?;
            if let Some(end) = state.end_of(round) {
                return Ok(end.clone());
            }
            if state.round > round {
                return Ok(RoundEnd {
                    kind: EndKind::Failed,
                    line: format!("ddprun: round {round} ended"),
                    exit_code: 1,
                });
            }
            if let Some(e) = self.interrupted(&format!("waiting for the end of round {round}")) {
                if let RendezvousError::Interrupted { signal, line } = &e {
                    self.leave_after_signal(Some(round), *signal, line);
                }
                return Err(e);
            }
            std::thread::sleep(POLL);
        }
    }

    /// After a signal: this launcher leaves — the round it is in ends (its end, if the first),
    /// or it leaves the queue; the host's launcher ends the whole job instead (without it there
    /// is no rendezvous). Errors are ignored: it is leaving.
    fn leave_after_signal(&mut self, round: Option<u64>, signal: i32, line: &str) {
        let end = RoundEnd {
            kind: if self.coordinator.is_some() {
                EndKind::Interrupted
            } else {
                EndKind::Left
            },
            line: line.to_string(),
            exit_code: 128 + signal,
        };
        if self.coordinator.is_some() {
            let _ = self.finish_job(&end);
        } else if let Some(round) = round {
            let _ = self.claim(round, &end);
        } else {
            self.leave();
        }
    }

    /// Ends the whole job with `end` (the host's launcher was interrupted: without it there
    /// is no rendezvous).
    pub fn finish_job(&mut self, end: &RoundEnd) -> Result<(), RendezvousError> {
        self.change("finish", |s| s.finish(end.clone()).then_some(()))?;
        Ok(())
    }

    /// Leaves the queue (a signal between rounds). Errors are ignored: it is leaving.
    pub fn leave(&mut self) {
        let id = self.spec.id.clone();
        let _ = self.change("leave", |s| s.leave(&id).then_some(()));
    }

    /// Says that this launcher read the job's end (the host waits for every member's before
    /// it closes the store). Errors are ignored: the job is over.
    pub fn ack(&mut self) {
        let id = self.spec.id.clone();
        let _ = self.change("ack", |s| s.ack(&id).then_some(()));
    }

    /// Starts watching for the end of `round` on a connection of its own.
    pub fn watch(&self, round: u64) -> Result<RoundWatch, RendezvousError> {
        RoundWatch::start(&self.endpoint, &self.token, round, self.timing).map_err(|e| self.gone(e))
    }
}

/// A thread that adds to this launcher's heartbeat counter every [`Timing::beat`] and watches
/// the coordinator's. Missed beats are tolerated until the heartbeat timeout (a fresh
/// connection replaces a broken one); a host whose store refuses connections is gone at once.
struct Heartbeat {
    stop: Arc<AtomicBool>,
    gone: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

/// A heartbeat connection: counted, and counted again by the store when it ends.
fn heartbeat_connection(
    endpoint: &str,
    token: &str,
    id: &str,
    timeout: Duration,
) -> Result<StoreClient> {
    let mut client = StoreClient::connect(endpoint, Some(token), timeout)?;
    client.set_io_timeout(timeout);
    let mut ns = PrefixStore::new(&mut client, keys::LAUNCHERS);
    ns.add(&keys::launcher_connections(id), 1)?;
    drop(ns);
    client.add_on_close(&format!("{}/{}", keys::LAUNCHERS, keys::launcher_gone(id)))?;
    Ok(client)
}

impl Heartbeat {
    fn start(endpoint: &str, token: &str, id: &str, timing: Timing) -> Result<Self> {
        let mut client = heartbeat_connection(endpoint, token, id, timing.heartbeat)?;
        let key = keys::launcher_heartbeat(id);
        PrefixStore::new(&mut client, keys::LAUNCHERS).add(&key, 1)?;
        let stop = Arc::new(AtomicBool::new(false));
        let gone = Arc::new(Mutex::new(None));
        let (endpoint, token, id) = (endpoint.to_string(), token.to_string(), id.to_string());
        let thread = {
            let (stop, gone) = (Arc::clone(&stop), Arc::clone(&gone));
            std::thread::Builder::new()
                .name("ddprun-heartbeat".into())
                .spawn(move || {
                    let mut last_ok = Instant::now();
                    let mut coordinator = (i64::MIN, Instant::now());
                    let why = loop {
                        std::thread::park_timeout(timing.beat());
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let mut ns = PrefixStore::new(&mut client, keys::LAUNCHERS);
                        let beat = ns
                            .add(&key, 1)
                            .and_then(|_| ns.add(keys::COORDINATOR_BEAT, 0));
                        match beat {
                            Ok(c) => {
                                last_ok = Instant::now();
                                if c != coordinator.0 {
                                    coordinator = (c, Instant::now());
                                } else if coordinator.1.elapsed() > timing.heartbeat {
                                    break "node 0's rendezvous coordinator stopped".to_string();
                                }
                            }
                            Err(e) => {
                                tracing::debug!("heartbeat to the rendezvous host failed: {e}");
                                let left = timing.heartbeat.saturating_sub(last_ok.elapsed());
                                let refused_at_once = !matches!(e, CommError::Timeout { .. });
                                let retry = if refused_at_once {
                                    Duration::from_millis(200).min(left)
                                } else {
                                    left
                                };
                                match heartbeat_connection(
                                    &endpoint,
                                    &token,
                                    &id,
                                    retry.max(Duration::from_millis(1)),
                                ) {
                                    Ok(c) => client = c,
                                    Err(_) if !refused_at_once && !left.is_zero() => {}
                                    Err(_) => break format!("its heartbeat failed: {e}"),
                                }
                            }
                        }
                    };
                    *gone.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
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

/// A thread that reads the state until one round ends, so that the launcher's watch loop
/// learns of it within milliseconds.
pub(crate) struct RoundWatch {
    seen: Arc<Mutex<Option<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RoundWatch {
    fn start(endpoint: &str, token: &str, round: u64, timing: Timing) -> Result<Self> {
        let mut client = StoreClient::connect(endpoint, Some(token), timing.heartbeat)?;
        client.set_io_timeout(timing.heartbeat);
        let seen = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("ddprun-round-watch".into())
                .spawn(move || {
                    let what = loop {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        match read_state(&mut client) {
                            Ok(Some((_, s))) => {
                                if let Some(end) = s.end_of(round) {
                                    break Seen::Ended(end.clone());
                                }
                            }
                            Ok(None) => {
                                break Seen::HostGone("the rendezvous state is missing".into());
                            }
                            Err(e) => break Seen::HostGone(e.to_string()),
                        }
                        std::thread::sleep(TICK);
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
