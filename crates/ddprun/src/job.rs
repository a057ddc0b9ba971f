//! A job over several nodes: this node's launcher takes part in the launchers' rendezvous
//! (see [`super::rendezvous`]) and runs its ranks round after round, until a round's end
//! finishes the job on every node.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::config::ranks_token;
use super::failure_notes::FailureNotes;
use super::rendezvous::host::Host;
use super::rendezvous::member::{Joined, Member, RoundWatch, Seen};
use super::rendezvous::messages::{
    After, EndKind, NodeSpec, RoundEnd, RoundInfo, after, is_failure,
};
use super::rendezvous::{RendezvousError, Timing};
use super::report::{Failure, RankExit};
use super::signals::{SignalForwarding, caught, signal_name};
use super::{AttemptEnd, JobStop, LaunchConfig, LaunchError, LaunchReport, RoundHooks};
use ddp_comm::auth::Key;
use ddp_comm::env::TOKEN_VAR;
use ddp_comm::env::{RESTART_COUNT_VARS, ROUND_VAR};

/// How long a rank failure with an exit code waits before it is written as the round's cause:
/// a rank that exits with an error because a peer was killed, or because another node's
/// launcher died, fails within milliseconds of it, and the cause (the killed rank, the lost
/// node) should win. A rank killed by a signal is written at once.
const CAUSE_SETTLE: Duration = Duration::from_millis(500);

/// Runs this node's part of a job of several nodes (`cfg.nnodes > 1`); `env` is what
/// [`super::config::common_env`] worked out.
pub(super) fn launch_nodes(
    cfg: &LaunchConfig,
    notes: &FailureNotes,
    env: &BTreeMap<String, String>,
    program: &OsStr,
    args: &[impl AsRef<OsStr>],
    forwarding: Option<&SignalForwarding>,
    trace_dir: Option<PathBuf>,
) -> Result<LaunchReport, LaunchError> {
    // The launchers hold the job token; their rendezvous uses a key derived for them, and each
    // round's ranks get a token derived for that round: a rank can neither reach the
    // launchers' rendezvous nor work out another round's token.
    let token = env[TOKEN_VAR].clone();
    let launchers_token = Key::from_token(&token).derive("launchers").to_token();
    let endpoint = cfg
        .rdzv_endpoint
        .clone()
        .unwrap_or_else(|| format!("{}:{}", env["MASTER_ADDR"], env["MASTER_PORT"]));
    if endpoint.rsplit_once(':').is_none() {
        return Err(LaunchError::InvalidConfig(format!(
            "the rendezvous endpoint {endpoint:?} is not HOST:PORT"
        )));
    }
    let timing = Timing {
        heartbeat: cfg.rdzv_heartbeat,
        last_call: cfg.rdzv_last_call,
        join_timeout: cfg.rdzv_join_timeout,
        grace: cfg.grace,
    };
    let spec = NodeSpec {
        id: format!("{:016x}", rand::random::<u64>()),
        host: ddp_comm::group::host_identity(),
        pid: std::process::id(),
        requested_node_rank: cfg.node_rank,
        nproc_per_node: cfg.nproc_per_node,
        command: std::iter::once(program)
            .chain(args.iter().map(AsRef::as_ref))
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        max_restarts: cfg.max_restarts,
        live_recovery: cfg.live_recovery,
        min_nodes: cfg.min_nodes.unwrap_or(cfg.nnodes),
        max_nodes: cfg.nnodes,
        heartbeat_ms: millis(cfg.rdzv_heartbeat),
        join_timeout_ms: millis(cfg.rdzv_join_timeout),
    };
    let host = match cfg.node_rank {
        0 => Some(Host::start(
            &endpoint,
            &launchers_token,
            spec.clone(),
            timing,
        )?),
        _ => None,
    };
    let node = Node {
        cfg,
        notes,
        env,
        program,
        trace_dir,
        forwarding,
        is_host: host.is_some(),
        label: spec.label(),
    };
    // Where this node's rank 0 serves when it is a round's node 0: as given; else, on the
    // host, the rendezvous endpoint's host (the others reach it there already); elsewhere,
    // the address its connection to the rendezvous comes from.
    let endpoint_host = endpoint
        .rsplit_once(':')
        .map(|(h, _)| h.trim_matches(['[', ']']).to_string());
    let local_addr = cfg
        .local_addr
        .clone()
        .or_else(|| host.as_ref().and(endpoint_host));
    let member = Member::connect(
        &endpoint,
        &launchers_token,
        spec,
        timing,
        forwarding.is_some(),
        local_addr.as_deref(),
        host.as_ref().map(Host::failure_cell),
    );
    let mut result = member
        .map_err(LaunchError::from)
        .and_then(|m| node.run_rounds(m, &token, args));
    if let Some(h) = host {
        // Interrupted, the host leaves at once (the others have read the end by then, or see
        // the host gone: they stop either way).
        let quick = match &result {
            Ok(r) => r.interrupted.is_some(),
            Err(LaunchError::Rendezvous(RendezvousError::Interrupted { .. })) => true,
            Err(_) => false,
        };
        // A signal while the host waits for the others to read the job's end ends the wait
        // and this launcher, with 128 + the signal, after the job's own line.
        // The signals the outcome took into account: none unless it was an interruption
        // (one that came after the report was made, while acknowledging or merging traces,
        // still counts).
        let accounted = forwarding.map(|_| match &result {
            Ok(r) if r.interrupted.is_none() => 0,
            _ => caught().map_or(0, |(_, n)| n),
        });
        if let Some(sig) = h.finish(quick, accounted)
            && let Ok(report) = &mut result
            && report.interrupted.is_none()
        {
            if let Some(line) = report.summary() {
                eprintln!("{line}");
            }
            report.first_failure = None;
            report.interrupted = Some((sig, 0));
            report.job_stop = Some(JobStop {
                line: format!(
                    "ddprun: {} (the rendezvous host) received {} while the other nodes were reading the job's end; it stopped waiting for them",
                    node.label,
                    signal_name(sig)
                ),
                exit_code: 128 + sig,
            });
        }
    }
    result
}

/// `d` in whole milliseconds (saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// This node's part of the job.
struct Node<'a> {
    cfg: &'a LaunchConfig,
    notes: &'a FailureNotes,
    env: &'a BTreeMap<String, String>,
    program: &'a OsStr,
    trace_dir: Option<PathBuf>,
    forwarding: Option<&'a SignalForwarding>,
    is_host: bool,
    label: String,
}

impl Node<'_> {
    /// Rounds until the job's end.
    fn run_rounds(
        &self,
        mut member: Member,
        token: &str,
        args: &[impl AsRef<OsStr>],
    ) -> Result<LaunchReport, LaunchError> {
        let cfg = self.cfg;
        let mut restarts = Vec::new();
        loop {
            let info = match member.join()? {
                Joined::Started(info) => info,
                Joined::Finished(end, completed) => {
                    member.ack();
                    return Ok(self.ended_without_a_round(end, completed, restarts));
                }
                Joined::Missed(info, end) => {
                    // The round ended before this node started its ranks: the same rule.
                    if let After::Finish(code) = after(&end, &info, cfg.max_restarts) {
                        member.ack();
                        // Its ranks never ran in that round: not a completion for this node.
                        let mut report = self.ended_without_a_round(end, false, restarts);
                        report.job_stop = report.job_stop.map(|s| JobStop {
                            exit_code: code,
                            ..s
                        });
                        return Ok(report);
                    }
                    restarts.push(self.next_round(end, &info));
                    continue;
                }
            };
            let node_rank = info
                .node_rank(&member.spec().id)
                .expect("a round this launcher joined has it");
            let first_rank = node_rank * cfg.nproc_per_node;
            let local_ranks = first_rank..first_rank + cfg.nproc_per_node;
            let mut round_env = round_env(self.env, &info, node_rank, token);
            if let Some(dir) = &self.trace_dir {
                super::trace::prepare(
                    dir,
                    info.round as usize,
                    local_ranks.clone(),
                    &mut round_env,
                )?;
            }
            tracing::info!(
                round = info.round,
                node_rank,
                nodes = info.nodes.len(),
                master = format!("{}:{}", info.master_addr, info.master_port),
                "round started"
            );
            let mut hooks = Hooks {
                watch: member.watch(info.round)?,
                nodes: info.nodes.len(),
                member: &mut member,
                round: info.round,
                label: self.label.clone(),
                held: None,
                seen: None,
                claim_error: None,
            };
            // A rank of this node lost while the others run is replaced by this launcher alone
            // (the other nodes' ranks re-form their group with it and their launchers see no
            // failure), charged to the job's budget in the shared state.
            let adopted = info.adopted.contains(&node_rank);
            if adopted {
                eprintln!(
                    "ddprun: {} takes over node {node_rank} of round {}, whose launcher was \
                     lost: its ranks start as replacements in the running group",
                    self.label, info.round
                );
            }
            let shared = super::Shared {
                cfg,
                notes: self.notes,
                forwarding: self.forwarding,
                rejoin: adopted,
            };
            let mut report = super::launch_once(
                shared,
                &round_env,
                first_rank,
                self.program,
                args,
                &mut hooks,
            )?;
            report.attempt = info.round as usize;
            if report.interrupted.is_none()
                && let Some((sig, _)) = self.forwarding.and_then(SignalForwarding::received)
            {
                report.interrupted = Some((sig, 0));
            }
            let end = hooks.round_end(&info, &report, self.is_host);
            drop(hooks);
            let end = end?;
            // This node was interrupted: it leaves with 128 + the signal, whatever the others
            // do (the host's interruption ended the job for all).
            let finish = match (report.interrupted, after(&end, &info, cfg.max_restarts)) {
                (Some((sig, _)), _) => Some(128 + sig),
                (None, After::Finish(code)) => Some(code),
                (None, After::NextRound) => None,
            };
            if let Some(code) = finish {
                member.ack();
                drop(member);
                if let Some(dir) = &self.trace_dir {
                    super::trace::merge(dir, Some(node_rank), local_ranks);
                }
                report.restarts = restarts;
                let own_ranks_done = report.exits.iter().all(|e| e.success());
                if report.interrupted.is_none() && end.kind == EndKind::Done && !own_ranks_done {
                    // Done is for each launcher to see with its own ranks: a round end that
                    // says so while this node's ranks were stopped or failed is not a success.
                    report.job_stop = Some(JobStop {
                        line: format!(
                            "ddprun: {}: the round was ended as done ({}) but this node's ranks \
                             did not all exit 0; the job failed",
                            self.label, end.line
                        ),
                        exit_code: report
                            .first_failure
                            .as_ref()
                            .map_or(1, |f| f.exit.shell_code().rem_euclid(256).max(1)),
                    });
                } else if report.interrupted.is_none() {
                    // One outcome for all: every node prints the round's end and exits with
                    // its code, whichever node's rank failed.
                    report.first_failure = None;
                    report.job_stop = (end.kind != EndKind::Done).then_some(JobStop {
                        line: end.line,
                        exit_code: code,
                    });
                } else if end.kind != EndKind::Left {
                    eprintln!("{}", end.line);
                }
                return Ok(report);
            }
            restarts.push(self.next_round(end, &info));
            if self.forwarding.is_some()
                && let Some((sig, _)) = caught()
            {
                member.leave();
                return Err(RendezvousError::Interrupted {
                    signal: sig,
                    line: format!(
                        "ddprun: {} received {} between rounds; it leaves the job",
                        self.label,
                        signal_name(sig)
                    ),
                }
                .into());
            }
        }
    }

    /// A round ended and the next one starts: prints the line every node prints, and returns
    /// what the report keeps of the round.
    fn next_round(&self, end: RoundEnd, info: &RoundInfo) -> AttemptEnd {
        if is_failure(&end) && end.paid {
            eprintln!(
                "{}; restarting the group (paid for by the live recovery that could not \
                 complete; restart budget {} of {} spent)",
                end.line,
                end.spent_before(info),
                self.cfg.max_restarts
            );
        } else if is_failure(&end) {
            eprintln!(
                "{}; restarting the group (restart budget {} of {} spent)",
                end.line,
                end.spent_before(info) + 1,
                self.cfg.max_restarts
            );
        } else {
            eprintln!("{}", end.line);
        }
        AttemptEnd {
            attempt: info.round as usize,
            summary: end.line,
            exit_code: end.exit_code,
        }
    }

    /// The report of a launcher that got no round before the job ended (it came late, or
    /// waited for room in a full job): the job's line and its exit code. It exits 0 only when
    /// the job `completed` (a round ran with every node's ranks exiting 0), and says so; any
    /// other end is non-zero here, whatever code it carries.
    fn ended_without_a_round(
        &self,
        end: RoundEnd,
        completed: bool,
        restarts: Vec<AttemptEnd>,
    ) -> LaunchReport {
        let (line, exit_code) = if completed {
            (
                format!(
                    "ddprun: {}: the job completed without this node (it waited for a round that never had room): {}",
                    self.label, end.line
                ),
                0,
            )
        } else {
            (
                format!(
                    "ddprun: {}: the job ended before this node got a round, and did not complete: {}",
                    self.label, end.line
                ),
                if end.exit_code & 0xff == 0 {
                    1
                } else {
                    end.exit_code
                },
            )
        };
        if exit_code == 0 {
            eprintln!("{line}");
        }
        LaunchReport {
            exits: Vec::new(),
            first_rank: 0,
            first_failure: None,
            interrupted: None,
            elapsed: Duration::ZERO,
            attempt: 0,
            restarts,
            replaced: Vec::new(),
            job_stop: (exit_code != 0).then_some(JobStop { line, exit_code }),
        }
    }
}

/// The variables of this node's ranks in the round `info`.
fn round_env(
    base: &BTreeMap<String, String>,
    info: &RoundInfo,
    node_rank: usize,
    token: &str,
) -> BTreeMap<String, String> {
    let mut env = base.clone();
    env.insert("WORLD_SIZE".into(), info.world_size().to_string());
    env.insert("GROUP_RANK".into(), node_rank.to_string());
    env.insert("MASTER_ADDR".into(), info.master_addr.clone());
    env.insert("MASTER_PORT".into(), info.master_port.to_string());
    env.insert(TOKEN_VAR.into(), ranks_token(token, "round", info.round));
    // torchrun's meaning: failed rounds only; the round itself (scale-ups too) apart.
    for var in RESTART_COUNT_VARS {
        env.insert(var.into(), info.failures_before.to_string());
    }
    env.insert(ROUND_VAR.into(), info.round.to_string());
    env
}

/// The watch loop's link to the rendezvous during one round.
struct Hooks<'a> {
    member: &'a mut Member,
    watch: RoundWatch,
    round: u64,
    /// The round's nodes.
    nodes: usize,
    label: String,
    /// This node's failure, not written yet, and when it is due (see [`CAUSE_SETTLE`]).
    held: Option<(RoundEnd, Instant)>,
    /// What the watch saw.
    seen: Option<Seen>,
    claim_error: Option<RendezvousError>,
}

impl Hooks<'_> {
    fn look(&mut self) -> Option<Seen> {
        if self.seen.is_none() {
            self.seen = self.watch.seen();
        }
        self.seen.clone()
    }

    /// Writes the held failure once it is due (unless the round ended meanwhile).
    fn claim_if_due(&mut self) {
        let due = self
            .held
            .as_ref()
            .is_some_and(|(_, at)| Instant::now() >= *at);
        if !due {
            return;
        }
        let (end, _) = self.held.take().expect("checked above");
        if let Err(e) = self.member.claim_failure(self.round, &end) {
            self.claim_error = Some(e);
        }
    }

    /// How the round ended, after this node's ranks have: what the watch saw, or this node's
    /// own end written now (its failure, its interruption, or its ranks all done), then the
    /// round's end as the first written made it.
    fn round_end(
        &mut self,
        info: &RoundInfo,
        report: &LaunchReport,
        is_host: bool,
    ) -> Result<RoundEnd, RendezvousError> {
        let round = info.round;
        if let Some((sig, _)) = report.interrupted {
            let end = if is_host {
                let end = RoundEnd::new(
                    EndKind::Interrupted,
                    format!(
                        "ddprun: {} (the rendezvous host) received {}; the job stops (round {round})",
                        self.label,
                        signal_name(sig)
                    ),
                    128 + sig,
                );
                self.member.finish_job(&end)?;
                end
            } else {
                let end = RoundEnd::new(
                    EndKind::Left,
                    format!(
                        "ddprun: {} received {} and left the job (round {round})",
                        self.label,
                        signal_name(sig)
                    ),
                    128 + sig,
                );
                self.member.claim(round, &end)?
            };
            eprintln!("{}", end.line);
            return Ok(end);
        }
        // A failure held back: wait for it to be due, or for the round to end first.
        while self.held.is_some() {
            if self.look().is_some() {
                self.held = None;
                break;
            }
            if self.member.host_gone_error().is_some() {
                break;
            }
            self.claim_if_due();
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(e) = self.claim_error.take() {
            return Err(e);
        }
        match self.look() {
            // As the state says now: a failure of this node's noted at the same moment as a
            // scale-up takes its place.
            // (The watch's copy if the host is gone by now.)
            Some(Seen::Ended(seen)) => {
                return Ok(self.member.end_of(round).ok().flatten().unwrap_or(seen));
            }
            Some(Seen::Broken(line)) => return Err(RendezvousError::Refused { line }),
            None => {}
        }
        if let Some(e) = self.member.host_gone_error() {
            return Err(e);
        }
        if report.first_failure.is_none() && report.job_stop.is_none() {
            self.member.mark_done(round)?;
        }
        self.member.wait_end(round)
    }
}

impl RoundHooks for Hooks<'_> {
    fn local_failure(&mut self, failure: &Failure) {
        let end = RoundEnd {
            relayed_from: failure.relayed_from,
            ..RoundEnd::new(
                EndKind::Failed,
                format!(
                    "ddprun: {}: {} (round {})",
                    self.label,
                    failure.what_happened(),
                    self.round
                ),
                failure.exit.shell_code(),
            )
        };
        let cause = super::cause_of(failure);
        // The rank exited before this instant (it was seen exited just now).
        let failed_by = Instant::now();
        // Noted at once, so that nothing but a failure can end the round from now on (a
        // scale-up that comes with it becomes this failure) — unless this node already saw
        // the round end: then its ranks failed on the stop. If the round ended unseen
        // meanwhile, the failure still counts when the store had the round running after the
        // rank exited (the end came after it).
        if !matches!(self.look(), Some(Seen::Ended(_)))
            && let Err(e) = self.member.note_failure(
                self.round,
                &end,
                cause,
                self.watch.running_after(failed_by),
            )
        {
            self.claim_error = Some(e);
        }
        let wait = match failure.exit {
            RankExit::Signal(_) => Duration::ZERO,
            _ => super::rendezvous::fault::settle(CAUSE_SETTLE),
        };
        // A better cause seen later (a rank's own error after a relay) keeps the first due
        // time: the settle counts from the first failure.
        let due = Instant::now() + wait;
        let due = self.held.as_ref().map_or(due, |(_, at)| (*at).min(due));
        self.held = Some((end, due));
        self.claim_if_due();
    }

    fn report_hung(&mut self, rank: usize) {
        if let Err(e) = self.member.report_hung(self.round, rank) {
            tracing::warn!("cannot report rank {rank} as hung to the other launchers: {e}");
        }
    }

    fn hung_elsewhere(&mut self) -> Vec<usize> {
        self.watch.hung()
    }

    fn progress_share(&mut self, node: usize) -> Option<crate::doctor::share::Share> {
        Some(self.member.progress_share(self.round, node, self.nodes))
    }

    fn charge_replacement(&mut self, rank: usize) -> Result<usize, Option<usize>> {
        match self.member.charge_replacement(self.round, rank) {
            Ok(charged) => charged,
            Err(e) => {
                tracing::warn!("cannot charge a live replacement to the job's budget: {e}");
                Err(None)
            }
        }
    }

    fn stop_requested(&mut self) -> Option<JobStop> {
        match self.look() {
            Some(Seen::Ended(end)) => {
                self.held = None;
                return Some(JobStop {
                    line: end.line,
                    exit_code: end.exit_code,
                });
            }
            Some(Seen::Broken(line)) => {
                return Some(JobStop { line, exit_code: 1 });
            }
            None => {}
        }
        self.claim_if_due();
        let gone = self.member.host_failure()?;
        Some(JobStop {
            line: gone.to_string(),
            exit_code: gone.exit_code(),
        })
    }
}
