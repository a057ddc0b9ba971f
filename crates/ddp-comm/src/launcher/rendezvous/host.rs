//! The rendezvous host: serves the launchers' store and runs the coordinator, which closes
//! rounds, watches heartbeats and ends rounds for lost nodes and scale-ups.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::messages::{
    After, EndKind, NodeSpec, RoundEnd, RoundInfo, RoundOutcome, after, decode, encode, is_failure,
};
use super::{RendezvousError, TICK, Timing, claim_end};
use crate::error::{CommError, Result};
use crate::store::{PrefixStore, Store, StoreClient, StoreServer, keys};

/// How long the host keeps its store up after the job's end for the members to read it.
const BYE_WAIT: Duration = Duration::from_secs(5);

/// The rendezvous host: the store and its coordinator thread.
pub(crate) struct Host {
    endpoint: String,
    token: String,
    server: Option<StoreServer>,
    stop: Arc<AtomicBool>,
    coordinator: Option<JoinHandle<Result<Closing>>>,
}

/// Where the coordinator stopped: the last round and how many launchers will say bye there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Closing {
    round: u64,
    members: usize,
}

impl Host {
    /// Serves the store at `endpoint` and starts coordinating the job that `spec` (the host's
    /// own configuration) describes; the ranks' rank 0 will serve at `master_addr`.
    pub fn start(
        endpoint: &str,
        token: &str,
        spec: NodeSpec,
        timing: Timing,
        master_addr: &str,
    ) -> Result<Self, RendezvousError> {
        let bind = |source| RendezvousError::Bind {
            endpoint: endpoint.to_string(),
            source,
        };
        let server = StoreServer::bind(endpoint, Some(token.to_string())).map_err(bind)?;
        let mut client =
            StoreClient::connect(endpoint, Some(token), timing.heartbeat).map_err(bind)?;
        PrefixStore::new(&mut client, keys::LAUNCHERS)
            .set(keys::OPEN_ROUND, &encode(&0u64))
            .map_err(bind)?;
        let stop = Arc::new(AtomicBool::new(false));
        let coordinator = {
            let stop = Arc::clone(&stop);
            let master_addr = master_addr.to_string();
            std::thread::Builder::new()
                .name("ddprun-rendezvous".into())
                .spawn(move || {
                    let mut c = Coordinator {
                        store: client,
                        host: spec,
                        timing,
                        master_addr,
                        stop,
                        specs: HashMap::new(),
                        liveness: HashMap::new(),
                    };
                    let r = c.run();
                    if let Err(e) = &r {
                        tracing::warn!("the launchers' rendezvous coordinator stopped: {e}");
                    }
                    r
                })
                .map_err(|e| bind(CommError::io("starting the coordinator thread", None, e)))?
        };
        Ok(Host {
            endpoint: endpoint.to_string(),
            token: token.to_string(),
            server: Some(server),
            stop,
            coordinator: Some(coordinator),
        })
    }

    /// After the job's end: waits (up to 5 s) until every member of the last round has read
    /// it, then stops the coordinator and the store.
    pub fn finish(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let closing = self.coordinator.take().and_then(|c| {
            let done = Instant::now() + BYE_WAIT;
            while !c.is_finished() && Instant::now() < done {
                std::thread::sleep(TICK);
            }
            self.stop.store(true, Ordering::Relaxed);
            c.join().ok().and_then(|r| r.ok())
        });
        if let Some(Closing { round, members }) = closing
            && let Ok(mut client) =
                StoreClient::connect(&self.endpoint, Some(&self.token), Duration::from_secs(1))
        {
            let until = Instant::now() + BYE_WAIT;
            let mut ns = PrefixStore::new(&mut client, keys::LAUNCHERS);
            while Instant::now() < until {
                match ns.add(&keys::round_bye(round), 0) {
                    Ok(n) if n as usize >= members => break,
                    Ok(_) => std::thread::sleep(TICK),
                    Err(_) => break,
                }
            }
        }
        self.server.take();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.shut_down();
    }
}

/// When a launcher's heartbeat counter last changed.
struct Beat {
    count: i64,
    changed: Instant,
}

struct Coordinator {
    store: StoreClient,
    host: NodeSpec,
    timing: Timing,
    master_addr: String,
    stop: Arc<AtomicBool>,
    specs: HashMap<String, NodeSpec>,
    liveness: HashMap<String, Beat>,
}

/// How a gathering ended.
enum Gathered {
    Started(RoundInfo),
    Refused(usize),
}

impl Coordinator {
    fn ns(&mut self) -> PrefixStore<'_, StoreClient> {
        PrefixStore::new(&mut self.store, keys::LAUNCHERS)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Rounds until the job ends.
    fn run(&mut self) -> Result<Closing> {
        let mut failures = 0;
        let mut previous: Option<RoundInfo> = None;
        for round in 0.. {
            let info = match self.gather(round, failures, previous.as_ref())? {
                Gathered::Started(info) => info,
                Gathered::Refused(members) => return Ok(Closing { round, members }),
            };
            let Some(end) = self.monitor(&info)? else {
                return Ok(Closing {
                    round,
                    members: info.nodes.len(),
                });
            };
            match after(&end, &info, self.host.max_restarts) {
                After::Finish(_) => {
                    return Ok(Closing {
                        round,
                        members: info.nodes.len(),
                    });
                }
                After::NextRound => failures += usize::from(is_failure(&end)),
            }
            previous = Some(info);
        }
        unreachable!("the rounds loop returns")
    }

    /// The ids of the launchers that joined `round`, in order.
    fn joiners(&mut self, round: u64) -> Result<Vec<String>> {
        let n = self.ns().add(&keys::round_joins(round), 0)?;
        let mut ids = Vec::new();
        for i in 1..=n {
            // A joiner adds, then names itself: a name not there yet is next tick's.
            if let Some(id) = self.ns().try_get(&keys::round_joiner(round, i))? {
                ids.push(String::from_utf8_lossy(&id).into_owned());
            }
        }
        Ok(ids)
    }

    fn spec(&mut self, id: &str) -> Result<Option<NodeSpec>> {
        if let Some(s) = self.specs.get(id) {
            return Ok(Some(s.clone()));
        }
        let key = keys::launcher_spec(id);
        let Some(bytes) = self.ns().try_get(&key)? else {
            return Ok(None);
        };
        let endpoint = self.store.endpoint().to_string();
        let spec: NodeSpec = decode(&endpoint, &key, &bytes)?;
        self.specs.insert(id.to_string(), spec.clone());
        Ok(Some(spec))
    }

    /// Reads `id`'s heartbeat; `Some(silence)` once it has not advanced for the heartbeat
    /// timeout. The host's own launcher is never lost (it is this process).
    fn silent_for(&mut self, id: &str) -> Result<Option<Duration>> {
        if id == self.host.id {
            return Ok(None);
        }
        let count = self.ns().add(&keys::launcher_heartbeat(id), 0)?;
        let now = Instant::now();
        let beat = self.liveness.entry(id.to_string()).or_insert(Beat {
            count,
            changed: now,
        });
        if beat.count != count {
            *beat = Beat {
                count,
                changed: now,
            };
        }
        let silence = now - beat.changed;
        Ok((silence > self.timing.heartbeat).then_some(silence))
    }

    /// Why `spec` cannot take part in this job, if it cannot.
    fn refusal(&self, spec: &NodeSpec) -> Option<String> {
        if spec.id != self.host.id && spec.requested_node_rank == 0 {
            return Some(format!(
                "ddprun: {} was also started with --node-rank 0; only the rendezvous host may be (give every other node a rank from 1)",
                spec.label()
            ));
        }
        let differs = spec.differences(&self.host);
        (!differs.is_empty()).then(|| {
            format!(
                "ddprun: {} differs from node 0: {}; every node stops",
                spec.label(),
                differs.join(", ")
            )
        })
    }

    /// The alive, valid launchers among `round`'s joiners, in node-rank order; a refusal if
    /// one of them differs.
    fn candidates(&mut self, round: u64) -> Result<Result<Vec<NodeSpec>, String>> {
        let mut alive = Vec::new();
        for (arrival, id) in self.joiners(round)?.into_iter().enumerate() {
            let Some(spec) = self.spec(&id)? else {
                continue;
            };
            if let Some(why) = self.refusal(&spec) {
                return Ok(Err(why));
            }
            if self.silent_for(&id)?.is_none() {
                alive.push((arrival, spec));
            }
        }
        let host = self.host.id.clone();
        alive.sort_by_key(|(arrival, s)| (s.id != host, s.requested_node_rank, *arrival));
        Ok(Ok(alive.into_iter().map(|(_, s)| s).collect()))
    }

    fn refuse(&mut self, round: u64, line: String) -> Result<Gathered> {
        tracing::warn!("{line}");
        let members = self.joiners(round)?.len();
        self.ns().set(
            &keys::round_info(round),
            &encode(&RoundOutcome::Refused { line }),
        )?;
        Ok(Gathered::Refused(members))
    }

    /// Waits for `round`'s launchers and closes it (or refuses it).
    fn gather(
        &mut self,
        round: u64,
        failures: usize,
        previous: Option<&RoundInfo>,
    ) -> Result<Gathered> {
        let (min, max) = (self.host.min_nodes, self.host.max_nodes);
        let started = Instant::now();
        let mut min_reached: Option<Instant> = None;
        loop {
            if self.stopped() {
                return Ok(Gathered::Refused(0));
            }
            let nodes = match self.candidates(round)? {
                Ok(n) => n,
                Err(line) => return self.refuse(round, line),
            };
            let enough = nodes.len() >= min;
            if !enough {
                min_reached = None;
            }
            let last_call_over = enough
                && min_reached.get_or_insert_with(Instant::now).elapsed() >= self.timing.last_call;
            if nodes.len() >= max || last_call_over {
                return self.close(round, failures, nodes.into_iter().take(max).collect());
            }
            if !enough {
                // Who of the previous round is missing, and whether they are all lost.
                let mut missing = Vec::new();
                let mut all_lost = true;
                for (id, label) in previous
                    .map(|p| p.nodes.iter().zip(&p.labels).collect::<Vec<_>>())
                    .unwrap_or_default()
                {
                    if nodes.iter().any(|n| &n.id == id) {
                        continue;
                    }
                    match self.silent_for(id)? {
                        Some(s) => {
                            missing.push(format!("{label}, silent for {:.1} s", s.as_secs_f64()))
                        }
                        None => {
                            all_lost = false;
                            missing.push(label.clone());
                        }
                    }
                }
                let timed_out = started.elapsed() > self.timing.join_timeout;
                if timed_out || (previous.is_some() && !missing.is_empty() && all_lost) {
                    let missing = if missing.is_empty() {
                        String::new()
                    } else {
                        format!("; missing: {}", missing.join("; "))
                    };
                    let line = format!(
                        "ddprun: only {} of the at least {min} nodes the job needs joined round {round}{}{missing}",
                        nodes.len(),
                        if timed_out {
                            format!(" within {:.0?}", self.timing.join_timeout)
                        } else {
                            String::new()
                        }
                    );
                    return self.refuse(round, line);
                }
            }
            std::thread::sleep(super::TICK);
        }
    }

    fn close(&mut self, round: u64, failures: usize, nodes: Vec<NodeSpec>) -> Result<Gathered> {
        let master_port = crate::net::free_port(&self.master_addr).map_err(|e| {
            CommError::io(
                format!(
                    "finding a free port for round {round}'s rank 0 on {}",
                    self.master_addr
                ),
                None,
                e,
            )
        })?;
        let info = RoundInfo {
            round,
            nodes: nodes.iter().map(|s| s.id.clone()).collect(),
            labels: nodes.iter().map(NodeSpec::label).collect(),
            nproc_per_node: self.host.nproc_per_node,
            master_addr: self.master_addr.clone(),
            master_port,
            failures_before: failures,
        };
        tracing::info!(round, nodes = ?info.labels, "round closed");
        self.ns().set(
            &keys::round_info(round),
            &encode(&RoundOutcome::Started(info.clone())),
        )?;
        self.ns().set(keys::OPEN_ROUND, &encode(&(round + 1)))?;
        Ok(Gathered::Started(info))
    }

    /// Watches a running round until it ends: ends it for a lost launcher or a scale-up.
    /// `None` when told to stop.
    fn monitor(&mut self, info: &RoundInfo) -> Result<Option<RoundEnd>> {
        let round = info.round;
        let endpoint = self.store.endpoint().to_string();
        loop {
            if self.stopped() {
                return Ok(None);
            }
            let key = keys::round_end(round);
            if let Ok(v) = self.ns().get(&key, TICK) {
                return decode(&endpoint, &key, &v).map(Some);
            }
            if !self.store.is_usable() {
                return Err(CommError::Store {
                    addr: endpoint,
                    msg: "the coordinator's own connection broke".into(),
                });
            }
            for (id, label) in info.nodes.iter().zip(&info.labels) {
                if let Some(silence) = self.silent_for(id)? {
                    let end = RoundEnd {
                        kind: EndKind::Lost,
                        line: format!(
                            "ddprun: {label} sent no heartbeat for {:.1} s (its ddprun was killed, stopped or cut off)",
                            silence.as_secs_f64()
                        ),
                        exit_code: 1,
                    };
                    claim_end(&mut self.store, round, &end)?;
                    break;
                }
            }
            if info.nodes.len() < self.host.max_nodes {
                let waiting = match self.candidates(round + 1)? {
                    Ok(c) => c.into_iter().find(|s| !info.nodes.contains(&s.id)).map(|s| {
                        RoundEnd {
                            kind: EndKind::ScaleUp,
                            line: format!(
                                "ddprun: {} is waiting to join; restarting the group to admit it (a scale-up, not counted as a restart)",
                                s.label()
                            ),
                            exit_code: 1,
                        }
                    }),
                    Err(line) => Some(RoundEnd {
                        kind: EndKind::Refused,
                        line,
                        exit_code: 1,
                    }),
                };
                if let Some(end) = waiting {
                    claim_end(&mut self.store, round, &end)?;
                }
            }
        }
    }
}
