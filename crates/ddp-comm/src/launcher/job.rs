//! A job over several nodes: this node's launcher takes part in the launchers' rendezvous
//! (see [`super::rendezvous`]) and runs its ranks round after round, until a round's end
//! finishes the job on every node.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::PathBuf;

use super::config::RESTART_COUNT_VARS;
use super::rendezvous::host::Host;
use super::rendezvous::member::{Member, RoundWatch, Seen};
use super::rendezvous::messages::{
    After, EndKind, NodeSpec, RoundEnd, RoundInfo, RoundOutcome, after, is_failure,
};
use super::rendezvous::{RendezvousError, Timing};
use super::signals::{SignalForwarding, signal_name};
use super::{AttemptEnd, JobStop, LaunchConfig, LaunchError, LaunchReport, RoundHooks};
use crate::env::TOKEN_VAR;

/// Runs this node's part of a job of several nodes (`cfg.nnodes > 1`); `env` is what
/// [`super::config::common_env`] worked out.
pub(super) fn launch_nodes(
    cfg: &LaunchConfig,
    env: &BTreeMap<String, String>,
    program: &OsStr,
    args: &[impl AsRef<OsStr>],
    forwarding: Option<&SignalForwarding>,
    trace_dir: Option<PathBuf>,
) -> Result<LaunchReport, LaunchError> {
    let token = env[TOKEN_VAR].clone();
    let endpoint = cfg
        .rdzv_endpoint
        .clone()
        .unwrap_or_else(|| format!("{}:{}", env["MASTER_ADDR"], env["MASTER_PORT"]));
    let Some((master_addr, _)) = endpoint.rsplit_once(':') else {
        return Err(LaunchError::InvalidConfig(format!(
            "the rendezvous endpoint {endpoint:?} is not HOST:PORT"
        )));
    };
    let timing = Timing {
        heartbeat: cfg.rdzv_heartbeat,
        last_call: cfg.rdzv_last_call,
        join_timeout: cfg.rdzv_join_timeout,
    };
    let spec = NodeSpec {
        id: format!("{:016x}", rand::random::<u64>()),
        host: crate::group::mesh::host_identity(),
        pid: std::process::id(),
        requested_node_rank: cfg.node_rank,
        nproc_per_node: cfg.nproc_per_node,
        command: std::iter::once(program)
            .chain(args.iter().map(AsRef::as_ref))
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        max_restarts: cfg.max_restarts,
        min_nodes: cfg.min_nodes.unwrap_or(cfg.nnodes),
        max_nodes: cfg.nnodes,
    };
    let label = spec.label();
    let host = match cfg.node_rank {
        0 => Some(Host::start(
            &endpoint,
            &token,
            spec.clone(),
            timing,
            master_addr.trim_matches(['[', ']']),
        )?),
        _ => None,
    };
    let mut member = Member::connect(&endpoint, &token, spec, timing)?;
    let mut round = member.open_round()?;
    let mut restarts = Vec::new();
    loop {
        let info = match member.join(round)? {
            RoundOutcome::Started(info) => info,
            RoundOutcome::Refused { line } => {
                member.bye(round);
                drop(member);
                if let Some(h) = host {
                    h.finish();
                }
                return Err(RendezvousError::Refused { line }.into());
            }
        };
        let Some(node_rank) = info.node_rank(&member.spec().id) else {
            eprintln!(
                "ddprun: round {} started with {} node(s) without {label}; it joins the next round",
                info.round,
                info.nodes.len()
            );
            round = info.round + 1;
            continue;
        };
        let first_rank = node_rank * cfg.nproc_per_node;
        let local_ranks = first_rank..first_rank + cfg.nproc_per_node;
        let mut round_env = round_env(env, &info, node_rank, &token);
        if let Some(dir) = &trace_dir {
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
            "round started"
        );
        let mut hooks = Hooks {
            watch: member.watch(info.round)?,
            member: &mut member,
            round: info.round,
            label: label.clone(),
            host_gone: None,
            claim_error: None,
        };
        let mut report = super::launch_once(
            cfg, &round_env, first_rank, program, args, forwarding, &mut hooks,
        )?;
        report.attempt = info.round as usize;
        if report.interrupted.is_none()
            && let Some((sig, _)) = forwarding.and_then(SignalForwarding::received)
        {
            report.interrupted = Some((sig, 0));
        }
        let (host_gone, claim_error) = (hooks.host_gone.take(), hooks.claim_error.take());
        drop(hooks);
        if let Some(e) = claim_error {
            return Err(e.into());
        }
        if let Some(detail) = host_gone.or_else(|| member.host_gone()) {
            return Err(RendezvousError::HostGone { endpoint, detail }.into());
        }
        let end = round_end(&mut member, &info, &report, &label)?;
        match after(&end, &info, cfg.max_restarts) {
            After::Finish(code) => {
                member.bye(info.round);
                drop(member);
                if let Some(h) = host {
                    h.finish();
                }
                if let Some(dir) = &trace_dir {
                    super::trace::merge(dir, Some(node_rank), local_ranks);
                }
                report.restarts = restarts;
                report.job_stop = (end.kind != EndKind::Done
                    && report.first_failure.is_none()
                    && report.interrupted.is_none())
                .then_some(JobStop {
                    line: end.line,
                    exit_code: code,
                });
                return Ok(report);
            }
            After::NextRound => {
                if is_failure(&end) {
                    eprintln!(
                        "{}; restarting the group (restart {} of {})",
                        end.line,
                        info.failures_before + 1,
                        cfg.max_restarts
                    );
                } else {
                    eprintln!("{}", end.line);
                }
                restarts.push(AttemptEnd {
                    attempt: info.round as usize,
                    summary: end.line,
                    exit_code: end.exit_code,
                });
                round = info.round + 1;
            }
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
    let token = match info.round {
        0 => token.to_string(),
        r => format!("{token}.restart{r}"),
    };
    env.insert(TOKEN_VAR.into(), token);
    for var in RESTART_COUNT_VARS {
        env.insert(var.into(), info.round.to_string());
    }
    env
}

/// How the round ended, after this node's ranks have: this node's own end claimed (a failure
/// was claimed as it happened), then the round's end as the first claim made it.
fn round_end(
    member: &mut Member,
    info: &RoundInfo,
    report: &LaunchReport,
    label: &str,
) -> Result<RoundEnd, RendezvousError> {
    if report.first_failure.is_some() || report.job_stop.is_some() {
        // Claimed when it happened, or ended elsewhere.
    } else if let Some((sig, _)) = report.interrupted {
        let end = RoundEnd {
            kind: EndKind::Interrupted,
            line: format!(
                "ddprun: {label} received {}; the job stops",
                signal_name(sig)
            ),
            exit_code: 128 + sig,
        };
        member.claim(info.round, &end)?;
    } else {
        member.mark_done(info.round, info.nodes.len())?;
    }
    member.wait_end(info.round)
}

/// The watch loop's link to the rendezvous during one round.
struct Hooks<'a> {
    member: &'a mut Member,
    watch: RoundWatch,
    round: u64,
    label: String,
    host_gone: Option<String>,
    claim_error: Option<RendezvousError>,
}

impl RoundHooks for Hooks<'_> {
    fn local_failure(&mut self, what: &str, exit_code: i32) {
        let end = RoundEnd {
            kind: EndKind::Failed,
            line: format!("ddprun: {}: {what} (round {})", self.label, self.round),
            exit_code,
        };
        if let Err(e) = self.member.claim(self.round, &end) {
            self.claim_error = Some(e);
        }
    }

    fn stop_requested(&mut self) -> Option<JobStop> {
        let gone = match self.watch.seen() {
            Some(Seen::Ended(end)) => {
                return Some(JobStop {
                    line: end.line,
                    exit_code: end.exit_code,
                });
            }
            Some(Seen::HostGone(detail)) => Some(detail),
            None => self.member.host_gone(),
        }?;
        let line = format!("ddprun: lost the launchers' rendezvous host ({gone})");
        self.host_gone = Some(gone);
        Some(JobStop { line, exit_code: 1 })
    }
}
