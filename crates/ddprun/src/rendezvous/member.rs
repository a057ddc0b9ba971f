//! A launcher's side of the rendezvous: connect, check its configuration against the job's,
//! heartbeat, join rounds, end them, and read the job's end. Every wait here looks at the
//! launcher's signals, the host's liveness and (on the host) the coordinator, slice by slice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::clock::RunningClock;
use super::messages::{Cause, EndKind, NodeSpec, RoundEnd, RoundInfo};
use super::state::{Joiner, Phase, State};
use super::{RendezvousError, StateError, TICK, Timing, change, read_state, read_written_state};
use crate::net::Listening;
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
    /// The job is over (it ended before this launcher got a round), and whether it
    /// completed: its last round ran with every node's ranks exiting 0.
    Finished(RoundEnd, bool),
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
        // In slices, so that a signal ends the wait for a host that is not up yet. A host that
        // is not listening may still be starting: it gets the join timeout (with a line once
        // the heartbeat timeout has passed). A host that accepts connections but does not
        // answer them for the heartbeat timeout is stopped, or not a ddprun: gone.
        let started = Instant::now();
        let mut said_waiting = false;
        let mut silent_since: Option<Instant> = None;
        let mut client = loop {
            let slice = Duration::from_millis(500);
            match StoreClient::connect(endpoint, Some(token), slice) {
                Ok(c) => break c,
                Err(CommError::Timeout { op, .. }) if started.elapsed() < timing.join_timeout => {
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
                    let listening = crate::net::listening(endpoint);
                    if listening == Listening::Yes
                        || (listening == Listening::Unknown && silent_since.is_some())
                    {
                        let since = *silent_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > timing.heartbeat {
                            return Err(RendezvousError::HostGone {
                                endpoint: endpoint.to_string(),
                                detail: format!(
                                    "it accepts connections but answered none for {:.1} s ({op})",
                                    since.elapsed().as_secs_f64()
                                ),
                            });
                        }
                    } else {
                        silent_since = None;
                        if !said_waiting && started.elapsed() > timing.heartbeat {
                            said_waiting = true;
                            eprintln!(
                                "ddprun: {}: nothing listens at {endpoint} yet (node 0's ddprun not started yet, or gone); waiting up to the join timeout ({:.0} s)",
                                spec.label(),
                                timing.join_timeout.as_secs_f64()
                            );
                        }
                    }
                }
                Err(e) => return Err(unreachable(e)),
            }
        };
        client.set_io_timeout(timing.request());
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

    /// The host is gone, as the heartbeat found (on the host itself: its rendezvous broke).
    pub fn host_gone_error(&self) -> Option<RendezvousError> {
        self.heartbeat.gone().map(|d| self.gone(d))
    }

    /// The rendezvous cannot go on: on the host, its coordinator failed; anywhere, the host
    /// is gone.
    pub fn host_failure(&self) -> Option<RendezvousError> {
        self.coordinator_failure()
            .or_else(|| self.host_gone_error())
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

    /// The state itself is unusable (malformed, missing): one line naming it, on every node.
    fn broken(&self, e: &StateError) -> RendezvousError {
        RendezvousError::Refused {
            line: format!("ddprun: {}: {e}; the job stops", self.spec.label()),
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
        self.coordinator_failure()
            .or_else(|| self.heartbeat.gone().map(|d| self.gone(d)))
    }

    /// On the host: the coordinator's failure, once it failed.
    fn coordinator_failure(&self) -> Option<RendezvousError> {
        let cell = self.coordinator.as_ref()?;
        let line = cell.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        Some(RendezvousError::Refused { line })
    }

    /// Runs `op` on the rendezvous connection. A store error (a timeout, a closed connection)
    /// is tried again on a new connection until the heartbeat gives the host up: whether the
    /// host is gone is the heartbeat's judgement alone, made on this launcher's running time,
    /// so that one slow reply or this launcher's own stop does not decide it. A signal (this
    /// launcher is leaving: [`RendezvousError::Interrupted`]) or the coordinator's failure ends
    /// the retries; a broken state ends them at once.
    fn retrying<T>(
        &mut self,
        mut op: impl FnMut(&mut StoreClient) -> Result<T, StateError>,
    ) -> Result<T, RendezvousError> {
        loop {
            let e = match op(&mut self.client) {
                Ok(v) => return Ok(v),
                Err(StateError::Store(e)) => e,
                Err(e) => return Err(self.broken(&e)),
            };
            if let Some(stop) = self.interrupted("talking to the launchers' rendezvous") {
                return Err(stop);
            }
            tracing::debug!("the launchers' rendezvous did not answer ({e}); trying again");
            std::thread::sleep(POLL);
            let request = self.timing.request();
            if let Ok(mut c) = StoreClient::connect(&self.endpoint, Some(&self.token), request) {
                c.set_io_timeout(request);
                self.client = c;
            }
        }
    }

    fn read(&mut self) -> Result<State, RendezvousError> {
        self.retrying(read_written_state)
    }

    fn change<T>(
        &mut self,
        step: &'static str,
        mut f: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<(Option<T>, State), RendezvousError> {
        self.retrying(|c| change(c, step, &mut f))
    }

    /// Waits for the job's state (the host writes it as it starts) and refuses this launcher
    /// if it differs from the job.
    fn admit(&mut self) -> Result<(), RendezvousError> {
        let deadline = Instant::now() + self.timing.heartbeat;
        let state = loop {
            match self.retrying(read_state)? {
                Some((_, s)) => break s,
                None if Instant::now() < deadline => std::thread::sleep(POLL),
                None => {
                    return Err(self.broken(&StateError::Broken {
                        addr: self.endpoint.clone(),
                        what: "is missing".into(),
                    }));
                }
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
                return Ok(Joined::Finished(end.clone(), state.completed()));
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
                } else if let Some(info) = now.running()
                    && info.node_rank(&self.spec.id).is_some()
                {
                    // A try that landed unanswered, and the round closed with this launcher
                    // before the retry: it is in.
                    joined_round = Some(info.round);
                } else {
                    std::thread::sleep(POLL);
                }
                continue;
            }
            joined_round.get_or_insert(state.round);
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

    /// Notes a failure of this node's ranks in `round` the moment it is seen (see
    /// [`State::note_failure`]); its end is claimed later, once the cause has settled.
    pub fn note_failure(
        &mut self,
        round: u64,
        end: &RoundEnd,
        cause: Cause,
        before_the_end: bool,
    ) -> Result<(), RendezvousError> {
        let id = self.spec.id.clone();
        self.change("note", |s| {
            s.note_failure(round, &id, end.clone(), cause, before_the_end)
                .then_some(())
        })?;
        Ok(())
    }

    /// Charges the live replacement of global rank `rank` of this node, lost in `round`, to
    /// the job's one
    /// budget (see [`State::charge_replacement`]): `Ok(Ok(spent))` with the budget spent after
    /// it, `Ok(Err(why))` when it may not be replaced (the budget spent so far, or `None`
    /// when the round is ending).
    pub fn charge_replacement(
        &mut self,
        round: u64,
        rank: usize,
    ) -> Result<Result<usize, Option<usize>>, RendezvousError> {
        let mut refused = None;
        let (charged, _) = self.change("replace", |s| match s.charge_replacement(round, rank) {
            Ok(spent) => Some(spent),
            Err(why) => {
                refused = Some(why);
                None
            }
        })?;
        Ok(charged.ok_or(refused.flatten()))
    }

    /// The hang doctor's exchange of progress with the other nodes' launchers in `round`
    /// (this launcher is node `node` of `nodes`), over a connection of its own.
    pub fn progress_share(
        &self,
        round: u64,
        node: usize,
        nodes: usize,
    ) -> crate::doctor::share::Share {
        crate::doctor::share::Share::start(
            self.endpoint.clone(),
            self.token.clone(),
            round,
            node,
            nodes,
        )
    }

    /// Reports global rank `rank` of `round`, on another node, as hung (see
    /// [`State::report_hung`]).
    pub fn report_hung(&mut self, round: u64, rank: usize) -> Result<(), RendezvousError> {
        self.change("hung", |s| s.report_hung(round, rank).then_some(()))?;
        Ok(())
    }

    /// Ends `round` with the likeliest cause among the failures noted in it (this node's
    /// `end` if none is) unless the round already ended; returns the round's end as it
    /// stands.
    pub fn claim_failure(
        &mut self,
        round: u64,
        end: &RoundEnd,
    ) -> Result<RoundEnd, RendezvousError> {
        let (_, state) = self.change("claim", |s| {
            s.end_with_failure(round, end.clone()).then_some(())
        })?;
        Ok(state.end_of(round).cloned().unwrap_or_else(|| end.clone()))
    }

    /// How `round` ended as the state says now (a failure noted at the same moment as a
    /// scale-up takes its place), if it has.
    pub fn end_of(&mut self, round: u64) -> Result<Option<RoundEnd>, RendezvousError> {
        Ok(self.read()?.end_of(round).cloned())
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
                return Ok(RoundEnd::new(
                    EndKind::Failed,
                    format!("ddprun: round {round} ended"),
                    1,
                ));
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
        let kind = if self.coordinator.is_some() {
            EndKind::Interrupted
        } else {
            EndKind::Left
        };
        let end = RoundEnd::new(kind, line.to_string(), 128 + signal);
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
        RoundWatch::start(
            &self.endpoint,
            &self.token,
            round,
            self.timing,
            (self.spec.id.clone(), self.spec.label()),
        )
        .map_err(|e| self.gone(e))
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
                    let why = beat_until_gone(&mut client, &stop, &endpoint, &token, &id, timing);
                    if let Some(why) = why {
                        *gone.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
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

/// How much longer than intended a sleep may take before the difference counts as time this
/// launcher was not running (stopped, starved).
const SLEEP_SLACK: Duration = Duration::from_millis(250);

/// The heartbeat loop: adds to this launcher's counter every beat and watches the
/// coordinator's. Returns why the host is gone, or `None` when stopped. Every silence is
/// counted on this launcher's [`RunningClock`] (a sleep that overslept by more than
/// [`SLEEP_SLACK`] counts as intended), against [`Timing::host_silence`]:
/// - the store answers but the coordinator's counter does not move for that long: the
///   coordinator stopped;
/// - nothing answers for that long, and a last try on a new connection fails too: the host
///   was stopped or cut off (this launcher's own stop makes requests fail without the host
///   being gone; the last try, made while this launcher runs, tells the two apart);
/// - the connection breaks and a new one is refused: the host's process is gone (at once).
fn beat_until_gone(
    client: &mut StoreClient,
    stop: &AtomicBool,
    endpoint: &str,
    token: &str,
    id: &str,
    timing: Timing,
) -> Option<String> {
    let key = keys::launcher_heartbeat(id);
    let budget = timing.host_silence();
    let probe = timing.beat();
    let mut clock = RunningClock::start();
    let mut answered = clock.now();
    let mut coordinator = (i64::MIN, clock.now());
    loop {
        std::thread::park_timeout(timing.beat());
        clock.advance(timing.beat() + SLEEP_SLACK);
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        let wait = budget.saturating_sub(clock.now() - answered).max(probe);
        client.set_io_timeout(wait);
        let mut ns = PrefixStore::new(client, keys::LAUNCHERS);
        let beat = ns
            .add(&key, 1)
            .and_then(|_| ns.add(keys::COORDINATOR_BEAT, 0));
        clock.advance(wait + SLEEP_SLACK);
        let e = match beat {
            Ok(c) => {
                answered = clock.now();
                if c != coordinator.0 {
                    coordinator = (c, clock.now());
                } else if clock.now() - coordinator.1 > budget {
                    return Some(format!(
                        "node 0's rendezvous coordinator did not move for {:.1} s while its store answered",
                        (clock.now() - coordinator.1).as_secs_f64()
                    ));
                }
                continue;
            }
            Err(e) => e,
        };
        tracing::debug!("heartbeat to the rendezvous host failed: {e}");
        let broke = !matches!(e, CommError::Timeout { .. });
        let wait = if broke {
            Duration::from_millis(200)
        } else {
            budget.saturating_sub(clock.now() - answered).max(probe)
        };
        let retried = heartbeat_connection(endpoint, token, id, wait);
        // The store's handshake waits at least 1 s.
        clock.advance(wait.max(Duration::from_secs(1)) + SLEEP_SLACK);
        match retried {
            Ok(c) => {
                *client = c;
                answered = clock.now();
            }
            Err(_) if broke => return Some(format!("its heartbeat failed: {e}")),
            Err(_) if clock.now() - answered > budget => {
                return Some(format!(
                    "it did not answer for {:.1} s: {e}",
                    (clock.now() - answered).as_secs_f64()
                ));
            }
            Err(_) => {}
        }
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
    /// The state is unusable (malformed, missing): the line says so.
    Broken(String),
}

/// A thread that reads the state until one round ends, so that the launcher's watch loop
/// learns of it within milliseconds. A read that fails is tried again on a new connection:
/// whether the host is gone is the heartbeat's judgement.
pub(crate) struct RoundWatch {
    seen: Arc<Mutex<Option<Seen>>>,
    /// The ranks of the round reported hung in the state ([`State::hung`]), as last read.
    hung: Arc<Mutex<Vec<usize>>>,
    /// When the last read that found the round still running was sent.
    running_at: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RoundWatch {
    fn start(
        endpoint: &str,
        token: &str,
        round: u64,
        timing: Timing,
        (id, label): (String, String),
    ) -> Result<Self> {
        let request = timing.request();
        let mut client = StoreClient::connect(endpoint, Some(token), timing.heartbeat)?;
        client.set_io_timeout(request);
        let seen = Arc::new(Mutex::new(None));
        let hung = Arc::new(Mutex::new(Vec::new()));
        let running_at = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (endpoint, token) = (endpoint.to_string(), token.to_string());
        let thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            let (running_at, hung) = (Arc::clone(&running_at), Arc::clone(&hung));
            std::thread::Builder::new()
                .name("ddprun-round-watch".into())
                .spawn(move || {
                    let what = loop {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let asked = Instant::now();
                        match read_written_state(&mut client) {
                            Ok(s) => {
                                if let Some(end) = s.end_of(round) {
                                    break Seen::Ended(end.clone());
                                }
                                // Taken for lost (its connections closed for a while) and its
                                // node handed to a spare: its ranks must not run beside the
                                // spare's.
                                if s.running().is_some_and(|info| {
                                    info.round == round && info.node_rank(&id).is_none()
                                }) {
                                    break Seen::Broken(format!(
                                        "ddprun: {label}: the rendezvous took this launcher for \
                                         lost and handed its node to a spare in round {round}; \
                                         it stops its ranks"
                                    ));
                                }
                                *running_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(asked);
                                if s.round == round {
                                    *hung.lock().unwrap_or_else(|p| p.into_inner()) = s.hung;
                                }
                            }
                            Err(StateError::Store(e)) => {
                                tracing::debug!("reading the rendezvous state failed: {e}");
                                if let Ok(mut c) =
                                    StoreClient::connect(&endpoint, Some(&token), request)
                                {
                                    c.set_io_timeout(request);
                                    client = c;
                                }
                            }
                            Err(e) => {
                                break Seen::Broken(format!("ddprun: {label}: {e}; the job stops"));
                            }
                        }
                        std::thread::sleep(TICK);
                    };
                    *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(what);
                })
                .map_err(|e| CommError::io("starting the round watch thread", None, e))?
        };
        Ok(RoundWatch {
            seen,
            hung,
            running_at,
            stop,
            thread: Some(thread),
        })
    }

    /// Whether the store still had the round running after `at`: a read sent after `at`
    /// found it so. (Whatever ended the round was written after that read.)
    pub fn running_after(&self, at: Instant) -> bool {
        self.running_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|asked| asked > at)
    }

    /// The ranks of the round reported hung, as the watch last read them.
    pub fn hung(&self) -> Vec<usize> {
        self.hung.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
