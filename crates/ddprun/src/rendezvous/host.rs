//! The rendezvous host: serves the launchers' store and runs the coordinator, which closes
//! rounds, watches the launchers' liveness, ends rounds for lost nodes and scale-ups, and ends
//! the job when a round cannot gather. Every change it makes is one compare-and-set of the
//! state ([`super::change`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::clock::RunningClock;
use super::messages::{EndKind, NodeSpec, RoundEnd, RoundInfo};
use super::state::{Phase, State};
use super::{RendezvousError, StateError, TICK, Timing, change, read_state, read_written_state};
use crate::signals::caught;
use ddp_comm::error::{CommError, Result};
use ddp_comm::store::{CompareSet, PrefixStore, Store, StoreClient, StoreServer, keys};

/// What a member's ranks may take to stop after the job's end besides the grace period: the
/// output drain, and a margin.
const STOP_SLACK: Duration = Duration::from_secs(3);

/// The rendezvous host: the store and its coordinator thread.
pub(crate) struct Host {
    endpoint: String,
    token: String,
    timing: Timing,
    server: Option<StoreServer>,
    stop: Arc<AtomicBool>,
    failure: Arc<Mutex<Option<String>>>,
    coordinator: Option<JoinHandle<()>>,
}

impl Host {
    /// Serves the store at `endpoint`, writes the first state (the job is `spec`, the host's
    /// own configuration) and starts coordinating.
    pub fn start(
        endpoint: &str,
        token: &str,
        spec: NodeSpec,
        timing: Timing,
    ) -> Result<Self, RendezvousError> {
        let bind = |source| RendezvousError::Bind {
            endpoint: endpoint.to_string(),
            source,
        };
        let server = StoreServer::bind(endpoint, Some(token.to_string())).map_err(bind)?;
        let mut client =
            StoreClient::connect(endpoint, Some(token), timing.heartbeat).map_err(bind)?;
        client.set_io_timeout(timing.heartbeat);
        let first = super::messages::encode(&State::new(spec.clone()));
        match client
            .compare_set(&keys::launchers_state(), None, &first)
            .map_err(bind)?
        {
            CompareSet::Swapped => super::fault::after("start"),
            CompareSet::Current(_) => {
                return Err(bind(CommError::Store {
                    addr: endpoint.to_string(),
                    msg: "a rendezvous state is already there".into(),
                }));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let failure = Arc::new(Mutex::new(None));
        let coordinator = {
            let (stop, failure) = (Arc::clone(&stop), Arc::clone(&failure));
            let (endpoint_owned, token_owned) = (endpoint.to_string(), token.to_string());
            std::thread::Builder::new()
                .name("ddprun-rendezvous".into())
                .spawn(move || {
                    let mut c = Coordinator {
                        store: client,
                        host_id: spec.id.clone(),
                        host_label: spec.label(),
                        timing,
                        clock: RunningClock::start(),
                        stop,
                        liveness: Liveness::default(),
                        logged_refusals: 0,
                        gathering: None,
                        last_running: None,
                        previous: None,
                        closed_since: HashMap::new(),
                    };
                    if let Err(e) = c.run() {
                        // A request that timed out while this process was stopped is the
                        // stop, not a failure of the store: the host's loss, as every member
                        // sees it.
                        let gap = c.clock.advance(timing.beat());
                        let end = if gap > timing.heartbeat {
                            c.stalled_end(gap)
                        } else {
                            RoundEnd::new(EndKind::Refused, format!(
                                    "ddprun: the launchers' rendezvous coordinator on {} failed: {e}; the job stops",
                                    spec.label()
                                ), 1)
                        };
                        tracing::error!("{}", end.line);
                        // Tell every node, on a new connection (the coordinator's may be what
                        // broke), if the store still takes it; the host's own launcher also
                        // sees `failure`.
                        if let Ok(mut store) =
                            StoreClient::connect(&endpoint_owned, Some(&token_owned), timing.request())
                        {
                            store.set_io_timeout(timing.request());
                            let _ = change(&mut store, "finish", |s| s.finish(end.clone()).then_some(()));
                        }
                        *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(end.line);
                    }
                })
                .map_err(|e| bind(CommError::io("starting the coordinator thread", None, e)))?
        };
        Ok(Host {
            endpoint: endpoint.to_string(),
            token: token.to_string(),
            timing,
            server: Some(server),
            stop,
            failure,
            coordinator: Some(coordinator),
        })
    }

    /// The coordinator's failure, once it has failed (the job is over then).
    pub fn failure_cell(&self) -> Arc<Mutex<Option<String>>> {
        Arc::clone(&self.failure)
    }

    /// After the job's end: waits until every member owed the end has read it or is gone (at
    /// most the longest any of them takes to stop its ranks, the heartbeat timeout and a
    /// margin; `quick`: one second), then stops the coordinator and the store. With
    /// `signals` (how many SIGINT/SIGTERM the job's outcome already took into account), one
    /// more — arrived since the outcome was decided, or while waiting — ends the wait at once
    /// and is returned.
    pub fn finish(mut self, quick: bool, signals: Option<u32>) -> Option<i32> {
        let signal = self.wait_for_acks(quick, signals);
        self.shut_down();
        signal
    }

    fn wait_for_acks(&self, quick: bool, signals: Option<u32>) -> Option<i32> {
        let (signals, before) = (signals.is_some(), signals.unwrap_or(0));
        let signal = || {
            caught()
                .filter(|(_, n)| signals && *n > before)
                .map(|(sig, _)| sig)
        };
        self.wait_for_acks_until(quick, &signal);
        signal()
    }

    fn wait_for_acks_until(&self, quick: bool, signal: &dyn Fn() -> Option<i32>) {
        let Ok(mut client) =
            StoreClient::connect(&self.endpoint, Some(&self.token), Duration::from_secs(1))
        else {
            return;
        };
        client.set_io_timeout(Duration::from_secs(1));
        let started = Instant::now();
        let mut watch = Liveness::default();
        let mut clock = RunningClock::start();
        loop {
            clock.advance(self.timing.beat());
            let Ok(Some((_, state))) = read_state(&mut client) else {
                return;
            };
            let limit = if quick {
                Duration::from_secs(1)
            } else {
                state.stop_within().max(self.timing.grace) + STOP_SLACK + self.timing.heartbeat
            };
            if started.elapsed() > limit {
                tracing::warn!(
                    "not every node read the job's end within {limit:?}; closing the rendezvous"
                );
                return;
            }
            let mut owed = false;
            for id in state.unacked() {
                match watch.lost(&mut client, &id, self.timing.heartbeat, clock.now()) {
                    Ok(None) => owed = true,
                    Ok(Some(_)) => {}
                    Err(_) => return,
                }
            }
            if !owed || signal().is_some() {
                return;
            }
            std::thread::sleep(TICK);
        }
    }

    fn shut_down(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(c) = self.coordinator.take() {
            let _ = c.join();
        }
        self.server.take();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// When a launcher's heartbeat counter last changed, on the judge's [`RunningClock`].
struct Beat {
    count: i64,
    changed: Duration,
}

/// How a launcher was lost.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lost {
    /// Every heartbeat connection it opened has ended: its process exited or was killed, and
    /// its ranks (killed with it by their parent-death signal) are gone too.
    Closed,
    /// Its heartbeat did not advance for this long: stopped or cut off, its ranks perhaps
    /// still running.
    Silent(Duration),
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lost::Closed => write!(
                f,
                "its connection to the rendezvous closed (its ddprun exited or was killed)"
            ),
            Lost::Silent(silence) => write!(
                f,
                "it sent no heartbeat for {:.1} s (its ddprun was stopped or cut off)",
                silence.as_secs_f64()
            ),
        }
    }
}

/// What the host knows of the launchers' liveness.
#[derive(Default)]
struct Liveness {
    beats: HashMap<String, Beat>,
}

impl Liveness {
    /// `Some(how)` once launcher `id` is lost: every heartbeat connection it opened has ended
    /// (killed: seen at once), or its heartbeat did not advance for `timeout` of the judge's
    /// running time `now` (stopped, cut off): a judge that was itself stopped does not count
    /// that time against the others.
    fn lost(
        &mut self,
        client: &mut StoreClient,
        id: &str,
        timeout: Duration,
        now: Duration,
    ) -> Result<Option<Lost>> {
        let mut ns = PrefixStore::new(client, keys::LAUNCHERS);
        // `gone` first: a launcher that replaces its connection counts the new one before the
        // old one ends.
        let gone = ns.add(&keys::launcher_gone(id), 0)?;
        let opened = ns.add(&keys::launcher_connections(id), 0)?;
        if opened > 0 && gone >= opened {
            return Ok(Some(Lost::Closed));
        }
        let count = ns.add(&keys::launcher_heartbeat(id), 0)?;
        let beat = self.beats.entry(id.to_string()).or_insert(Beat {
            count,
            changed: now,
        });
        if beat.count != count {
            *beat = Beat {
                count,
                changed: now,
            };
        }
        let silence = now.saturating_sub(beat.changed);
        Ok((silence > timeout).then_some(Lost::Silent(silence)))
    }
}

struct Coordinator {
    store: StoreClient,
    host_id: String,
    host_label: String,
    timing: Timing,
    /// The coordinator's running time: what liveness is judged on.
    clock: RunningClock,
    stop: Arc<AtomicBool>,
    liveness: Liveness,
    logged_refusals: u64,
    /// The round being gathered and since when (and since when `MIN` launchers wait).
    gathering: Option<(u64, Instant, Option<Instant>)>,
    /// The last round seen running.
    last_running: Option<RoundInfo>,
    /// While gathering: the round that ran before, and when the gathering began.
    previous: Option<(RoundInfo, Instant)>,
    /// Launchers of the running round seen with every connection closed, and since when: a
    /// hand-over to a spare waits until that has lasted [`CLOSED_FOR_HAND_OVER`].
    closed_since: HashMap<String, Instant>,
}

/// How long a launcher's connections must stay closed before its node is handed to a spare:
/// a launcher whose heartbeat connection broke opens a new one only after the old one closed,
/// and in between it looks as a killed one does. Starting ranks in its place while it still
/// runs them would put two processes on one rank.
const CLOSED_FOR_HAND_OVER: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Watches and moves the state until the job is over or the host stops it.
    fn run(&mut self) -> Result<(), StateError> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // First, before judging anyone: was this process running all along?
            self.stalled_since_last_look()?;
            PrefixStore::new(&mut self.store, keys::LAUNCHERS).add(keys::COORDINATOR_BEAT, 1)?;
            let state = read_written_state(&mut self.store)?;
            for (seq, line) in &state.refusals {
                if *seq >= self.logged_refusals {
                    tracing::warn!("{line}");
                    self.logged_refusals = seq + 1;
                }
            }
            match &state.phase {
                // Decide on the state as it is once the dead are out of the queue.
                _ if self.drop_dead_waiters(&state)? => {}
                Phase::Gathering => self.gather(&state)?,
                Phase::Running { info, .. } => {
                    self.gathering = None;
                    self.monitor(&state, info)?;
                }
                // The job is over: the host's launcher closes the store once the members
                // have read it; until then the coordinator keeps beating.
                Phase::Finished { .. } => {}
            }
            std::thread::sleep(TICK);
        }
    }

    fn lost(&mut self, id: &str) -> Result<Option<Lost>, StateError> {
        if id == self.host_id {
            // The host's own launcher is this process.
            return Ok(None);
        }
        let verdict =
            self.liveness
                .lost(&mut self.store, id, self.timing.heartbeat, self.clock.now())?;
        // What the judgement just read may be the doing of this process's own stop (a node
        // that gave the host up and left): look again at whether it was running meanwhile.
        if verdict.is_some() && self.stalled_since_last_look()? {
            return Ok(None);
        }
        Ok(verdict)
    }

    /// Whether this process was not running for longer than the heartbeat timeout since the
    /// coordinator last looked; if so the job has just been ended as the host's loss.
    fn stalled_since_last_look(&mut self) -> Result<bool, StateError> {
        let gap = self.clock.advance(self.timing.beat());
        if gap > self.timing.heartbeat {
            self.stalled(gap)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// This process was not running for `gap`, longer than the heartbeat timeout: every other
    /// launcher has given the host up for lost (or will, having seen no beat of its
    /// coordinator), so the host treats itself as lost and ends the job — it does not go on
    /// judging the others by the time it was stopped. Every node still there reads the same
    /// line and exit code (1).
    fn stalled(&mut self, gap: Duration) -> Result<(), StateError> {
        let end = self.stalled_end(gap);
        tracing::error!("{}", end.line);
        change(&mut self.store, "finish", |s| {
            s.finish(end.clone()).then_some(())
        })?;
        Ok(())
    }

    /// The job's end when this process was not running for `gap`, past the heartbeat
    /// timeout.
    fn stalled_end(&self, gap: Duration) -> RoundEnd {
        RoundEnd::new(
            EndKind::HostLost,
            format!(
                "ddprun: lost the launchers' rendezvous host at {} ({}): it was not running for {:.1} s, past the heartbeat timeout ({:.1} s); the job stops",
                self.store.endpoint(),
                self.host_label,
                gap.as_secs_f64(),
                self.timing.heartbeat.as_secs_f64()
            ),
            1,
        )
    }

    /// Removes waiting launchers that are gone; whether it removed any.
    fn drop_dead_waiters(&mut self, state: &State) -> Result<bool, StateError> {
        if matches!(state.phase, Phase::Finished { .. }) {
            return Ok(false);
        }
        let mut dropped = false;
        for j in &state.waiting {
            if let Some(why) = self.lost(&j.id)? {
                tracing::warn!("ddprun: {} left the queue of the job: {why}", j.label);
                change(&mut self.store, "drop", |s| s.leave(&j.id).then_some(()))?;
                dropped = true;
            }
        }
        Ok(dropped)
    }

    /// Closes the round being gathered when it is full, or when `MIN` wait and the last call
    /// passed (and no node of the previous round is still stopping its ranks); ends the job
    /// when `MIN` did not gather within the join timeout.
    fn gather(&mut self, state: &State) -> Result<(), StateError> {
        let (min, max) = (state.job.min_nodes, state.job.max_nodes);
        let now = Instant::now();
        let (round, since, min_since) = match self.gathering {
            Some(g) if g.0 == state.round => g,
            _ => {
                self.previous = self.last_running.take().map(|info| (info, now));
                (state.round, now, None)
            }
        };
        let waiting = state.waiting.len();
        let min_since = if waiting >= min {
            Some(min_since.unwrap_or(now))
        } else {
            None
        };
        self.gathering = Some((round, since, min_since));
        let stopping = self.previous_still_stopping(state)?;
        let last_call_over =
            min_since.is_some_and(|t| t.elapsed() >= self.timing.last_call) && !stopping;
        if waiting >= max || last_call_over {
            // On the state as it is now: enough still wait, the round is still this one.
            let enough = |s: &State| {
                s.phase == Phase::Gathering && s.round == round && s.waiting.len() >= min.min(max)
            };
            let closed = change(&mut self.store, "close", |s| {
                if enough(s) { s.close() } else { None }
            })?;
            if let (Some(info), _) = closed {
                tracing::info!(
                    round = info.round,
                    nodes = ?info.labels,
                    master = format!("{}:{}", info.master_addr, info.master_port),
                    "round closed"
                );
            }
            return Ok(());
        }
        if waiting < min && since.elapsed() > self.timing.join_timeout {
            let mut missing = Vec::new();
            if let Some((info, _)) = &self.previous {
                for (id, label) in info.nodes.iter().zip(&info.labels) {
                    if !state.is_waiting(id) {
                        missing.push(label.clone());
                    }
                }
            }
            let missing = if missing.is_empty() {
                String::new()
            } else {
                format!("; missing: {}", missing.join(", "))
            };
            let end = RoundEnd::new(
                EndKind::Refused,
                format!(
                    "ddprun: only {waiting} of the at least {min} nodes the job needs joined round {round} within {:.0?}{missing}",
                    self.timing.join_timeout
                ),
                1,
            );
            tracing::warn!("{}", end.line);
            change(&mut self.store, "finish", |s| {
                (s.phase == Phase::Gathering && s.round == round && s.finish(end.clone()))
                    .then_some(())
            })?;
        }
        Ok(())
    }

    /// Whether a node of the previous round is alive, not back yet, and within the time its
    /// ranks may take to stop: the last call waits for it, so that a slow stop does not leave
    /// a node out of the next round.
    fn previous_still_stopping(&mut self, state: &State) -> Result<bool, StateError> {
        let Some((info, ended)) = self.previous.clone() else {
            return Ok(false);
        };
        if ended.elapsed() > self.timing.grace + STOP_SLACK {
            return Ok(false);
        }
        for id in &info.nodes {
            if !state.is_waiting(id) && self.lost(id)?.is_none() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Ends the running round for a lost launcher, or for a scale-up when one waits and the
    /// round has room.
    fn monitor(&mut self, state: &State, info: &RoundInfo) -> Result<(), StateError> {
        self.last_running = Some(info.clone());
        for (id, label) in info.nodes.iter().zip(&info.labels) {
            let why = self.lost(id)?;
            if why != Some(Lost::Closed) {
                self.closed_since.remove(id);
            }
            if let Some(why) = why {
                // Killed, its ranks gone with it: a spare launcher may take its node over,
                // once the connections stayed closed long enough to rule out a reconnection.
                if why == Lost::Closed && state.job.live_recovery && !state.waiting.is_empty() {
                    let since = *self
                        .closed_since
                        .entry(id.clone())
                        .or_insert_with(Instant::now);
                    if since.elapsed() < CLOSED_FOR_HAND_OVER {
                        return Ok(());
                    }
                    let handed = change(&mut self.store, "hand over", |s| {
                        s.hand_over(info.round, id)
                    })?;
                    if let (Some((node, spare, spent)), _) = handed {
                        let max = state.job.max_restarts;
                        eprintln!(
                            "ddprun: {label} was lost: {why}; its node {node}'s ranks are \
                             replaced live on {spare} (restart budget {spent} of {max} spent)"
                        );
                        return Ok(());
                    }
                }
                let end = RoundEnd::new(
                    EndKind::Lost,
                    format!("ddprun: {label} was lost: {why} (round {})", info.round),
                    1,
                );
                change(&mut self.store, "lost", |s| {
                    s.end_round(info.round, end.clone()).then_some(())
                })?;
                return Ok(());
            }
        }
        // A rank failure noted in the round ends it as a failure once its cause has settled:
        // no scale-up meanwhile.
        let failing = matches!(&state.phase, Phase::Running { failed, .. } if !failed.is_empty());
        // Under live recovery a launcher that arrives while a round runs waits as a spare
        // (see `State::hand_over`) instead of restarting the group to admit it.
        if !failing
            && !state.job.live_recovery
            && info.nodes.len() < state.job.max_nodes
            && let Some(j) = state.waiting.iter().find(|j| !info.nodes.contains(&j.id))
        {
            let end = RoundEnd::new(
                EndKind::ScaleUp,
                format!(
                    "ddprun: {} is waiting to join; restarting the group to admit it (a scale-up, not counted as a restart)",
                    j.label
                ),
                1,
            );
            change(&mut self.store, "scale-up", |s| {
                s.end_round(info.round, end.clone()).then_some(())
            })?;
        }
        Ok(())
    }
}
