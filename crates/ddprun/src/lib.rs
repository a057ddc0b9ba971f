//! Starts, watches and stops rank processes: the library behind the `ddprun` binary, with the
//! launchers' elastic rendezvous for jobs of several nodes.
//!
//! [`launch`] follows torchrun's contract: it starts `nproc_per_node` copies of a program on this
//! node with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT` and the job token ([`ddp_comm::env::TOKEN_VAR`]) set, copies their output with a
//! `[rank k] ` prefix on every line, and watches them. When a rank exits non-zero or is killed
//! by a signal, the others are stopped (SIGTERM to each rank's process group, SIGKILL after
//! [`LaunchConfig::grace`]) and the first failure is reported.
//!
//! No process outlives the launch: each rank leads its own process group, which is killed
//! when the rank fails or after it exits (so stray grandchildren go too), and each rank gets
//! `PR_SET_PDEATHSIG = SIGKILL`, so it dies if the launcher itself is killed, even by SIGKILL.
//!
//! With [`LaunchConfig::trace`] (or `DDP_TRACE` set), every rank records a timeline and the
//! launcher merges the rank files into one when the launch has ended (see [`ddp_trace`]).
//!
//! ```no_run
//! use ddprun::{launch, LaunchConfig};
//! let cfg = LaunchConfig { nproc_per_node: 4, ..LaunchConfig::default() };
//! let report = launch(&cfg, "./train", &["--epochs".to_string(), "1".to_string()])?;
//! if let Some(line) = report.summary() {
//!     eprintln!("{line}");
//! }
//! std::process::exit(report.exit_code());
//! # Ok::<(), ddprun::LaunchError>(())
//! ```

#![warn(missing_docs)]

mod config;
mod doctor;
mod failure_notes;
mod job;
mod live;
mod net;
mod output;
mod rendezvous;
mod report;
mod signals;
mod spawn;
mod trace;

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use config::LaunchConfig;
pub use ddp_comm::env::{RESTART_COUNT_VARS, ROUND_VAR};
pub use rendezvous::RendezvousError;
pub use report::{AttemptEnd, Failure, JobStop, LaunchError, LaunchReport, RankExit};
pub use signals::signal_name;

use config::{attempt_env, common_env};
use failure_notes::FailureNotes;
use rendezvous::messages::Cause;
use signals::{SignalForwarding, kill_group};
use spawn::RankSpawner;

/// How often the watch loop checks the ranks.
const POLL: Duration = Duration::from_millis(5);
/// After a rank failed only on a peer's failure (it said so through `DDP_FAILURE_FILE`), how
/// long the others keep running so that the rank whose own error it was can exit and be named.
const RELAY_SETTLE: Duration = Duration::from_millis(500);
/// How long to wait for a rank's output to drain after all ranks exited.
pub(crate) const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// A running rank.
struct Rank {
    rank: usize,
    child: Child,
    exit: Option<RankExit>,
}

/// Launches `nproc_per_node` ranks of `program args…` and waits until all of them have ended.
///
/// Returns the report (`Ok` even when ranks fail: see [`LaunchReport::success`] and
/// [`LaunchReport::exit_code`]); `Err` only when the launch itself could not run, in which case
/// any rank already started has been killed and reaped.
///
/// The ranks' stdin is `/dev/null` (ranks run in their own process groups, where reading the
/// terminal would stop them). `PR_SET_PDEATHSIG` fires when the *thread* that called `launch`
/// exits, so call it from a thread that lives until it returns (the main thread in `ddprun`).
///
/// ```
/// use std::time::Duration;
/// use ddprun::{launch, LaunchConfig};
/// let cfg = LaunchConfig {
///     nproc_per_node: 2,
///     grace: Duration::from_secs(2),
///     ..LaunchConfig::default()
/// };
/// let report = launch(&cfg, "sh", &["-c", "echo hello from rank $RANK of $WORLD_SIZE"])?;
/// assert!(report.success());
/// # Ok::<(), ddprun::LaunchError>(())
/// ```
pub fn launch(
    cfg: &LaunchConfig,
    program: impl AsRef<std::ffi::OsStr>,
    args: &[impl AsRef<std::ffi::OsStr>],
) -> Result<LaunchReport, LaunchError> {
    let program = program.as_ref();
    if program.is_empty() {
        return Err(LaunchError::InvalidConfig("no program to launch".into()));
    }
    let env = common_env(cfg)?;
    if cfg.emulate_gpu_hosts {
        // The job's first line: never on without the user seeing it.
        eprintln!(
            "ddprun: emulated GPU hosts: each rank is an NCCL host of its own (NCCL_HOSTID, \
             NCCL_NET=Socket on loopback), so several ranks may share one GPU; for tests and \
             benchmarks, not a real job's speed"
        );
    }
    let forwarding = if cfg.forward_signals {
        Some(
            SignalForwarding::install().map_err(|source| LaunchError::Io {
                what: "installing the SIGINT/SIGTERM handlers".into(),
                source,
            })?,
        )
    } else {
        None
    };
    let trace_dir = trace::trace_dir(cfg);
    let notes = FailureNotes::create()?;
    if cfg.nnodes > 1 {
        return job::launch_nodes(
            cfg,
            &notes,
            &env,
            program,
            args,
            forwarding.as_ref(),
            trace_dir,
        );
    }
    let node_ranks = 0..cfg.nproc_per_node;
    let mut restarts = Vec::new();
    // The budget: group restarts and lost ranks replaced live, together.
    let mut budget = LocalBudget {
        spent: 0,
        max: cfg.max_restarts,
    };
    for attempt in 0.. {
        let mut env = attempt_env(cfg, &env, attempt)?;
        if let Some(dir) = &trace_dir {
            trace::prepare(dir, attempt, node_ranks.clone(), &mut env)?;
        }
        let shared = Shared {
            cfg,
            notes: &notes,
            forwarding: forwarding.as_ref(),
            rejoin: false,
        };
        let mut report = launch_once(shared, &env, 0, program, args, &mut budget)?;
        report.attempt = attempt;
        // A signal to the launcher ends the job whenever it came, even after the last rank
        // had exited (between the watch and this line).
        if report.interrupted.is_none()
            && let Some((sig, _)) = forwarding.as_ref().and_then(SignalForwarding::received)
        {
            report.interrupted = Some((sig, 0));
        }
        // A restart that only follows a live recovery that could not complete (every failure a
        // relay of the loss of a rank replaced live in this attempt) is paid for by that
        // replacement.
        let paid = report.first_failure.as_ref().is_some_and(|f| {
            cause_of(f) == Cause::Relayed
                && f.relayed_from
                    .is_some_and(|p| report.replaced.iter().any(|r| r.rank == p))
        });
        let again = !report.success()
            && report.interrupted.is_none()
            && (paid || budget.spent < cfg.max_restarts);
        if !again {
            report.restarts = restarts;
            if let Some(dir) = &trace_dir {
                trace::merge(dir, None, node_ranks);
            }
            return Ok(report);
        }
        let summary = report.summary().unwrap_or_default();
        // The launcher's own line, like the ranks' output it copies: the user sees the
        // restart when it happens, not only at the end.
        if paid {
            eprintln!(
                "{summary}; restarting the group (paid for by the live recovery that could not \
                 complete; restart budget {} of {} spent)",
                budget.spent, cfg.max_restarts
            );
        } else {
            budget.spent += 1;
            eprintln!(
                "{summary}; restarting the group (restart budget {} of {} spent)",
                budget.spent, cfg.max_restarts
            );
        }
        restarts.push(AttemptEnd {
            attempt,
            summary,
            exit_code: report.exit_code(),
        });
    }
    unreachable!("the attempts loop returns")
}

/// `ddprun doctor DIR`: prints where every rank of the dump(s) under `dir` was and the verdict
/// (a hang judged with `hang_after`, stragglers with `straggler_factor`). Exit code 0 once
/// read, 2 when `dir` holds no readable dump (the line says why).
pub fn doctor(
    dir: &std::path::Path,
    hang_after: Duration,
    straggler_factor: f64,
) -> std::process::ExitCode {
    doctor::command::run(dir, hang_after, straggler_factor)
}

/// What a job over several nodes adds to the watch loop of one attempt.
trait RoundHooks {
    /// Called once, when the first local rank fails.
    fn local_failure(&mut self, failure: &Failure);
    /// Polled while the ranks run: `Some` stops them (SIGTERM, grace, SIGKILL).
    fn stop_requested(&mut self) -> Option<JobStop>;
    /// Charges the live replacement of a lost rank to the job's one budget (`--max-restarts`,
    /// shared with the group restarts): `Ok` with the budget spent after it, `Err` with the
    /// budget spent when it is spent (`None`: the round is ending, nothing may be replaced).
    fn charge_replacement(&mut self, rank: usize) -> Result<usize, Option<usize>>;
    /// Tells the other nodes' launchers that their global rank `rank` hangs (a rank here
    /// waited for it past its collective timeout).
    fn report_hung(&mut self, _rank: usize) {}
    /// The ranks another node's launcher reported hung (some may be this node's).
    fn hung_elsewhere(&mut self) -> Vec<usize> {
        Vec::new()
    }
    /// The hang doctor's exchange of progress with the other nodes' launchers (this launcher
    /// is node `node` of the round); `None` alone.
    fn progress_share(&mut self, _node: usize) -> Option<doctor::share::Share> {
        None
    }
}

/// One node alone: its budget is its own; nothing to tell, nothing to hear.
struct LocalBudget {
    /// Group restarts and live replacements so far.
    spent: usize,
    /// `--max-restarts`.
    max: usize,
}

impl RoundHooks for LocalBudget {
    fn local_failure(&mut self, _: &Failure) {}
    fn stop_requested(&mut self) -> Option<JobStop> {
        None
    }
    fn charge_replacement(&mut self, _rank: usize) -> Result<usize, Option<usize>> {
        if self.spent >= self.max {
            return Err(Some(self.spent));
        }
        self.spent += 1;
        Ok(self.spent)
    }
}

/// What every attempt of one launch shares.
#[derive(Clone, Copy)]
struct Shared<'a> {
    cfg: &'a LaunchConfig,
    /// Where the ranks note a failure that only relayed a peer's.
    notes: &'a FailureNotes,
    /// The caught SIGINT/SIGTERM, with `forward_signals`.
    forwarding: Option<&'a SignalForwarding>,
    /// This node's ranks start as replacements of lost ones in a running group
    /// (`DDP_REJOIN=1`): a spare launcher that took over a lost node (`--recover live`).
    rejoin: bool,
}

/// One attempt: starts the ranks with `env` (global ranks from `first_rank`), watches them
/// until all have ended, reaps them.
fn launch_once(
    shared: Shared<'_>,
    env: &BTreeMap<String, String>,
    first_rank: usize,
    program: &std::ffi::OsStr,
    args: &[impl AsRef<std::ffi::OsStr>],
    hooks: &mut dyn RoundHooks,
) -> Result<LaunchReport, LaunchError> {
    let Shared {
        cfg, notes, rejoin, ..
    } = shared;
    let start = Instant::now();
    tracing::info!(
        program = ?program,
        nproc_per_node = cfg.nproc_per_node,
        world_size = %env["WORLD_SIZE"],
        master = format!("{}:{}", env["MASTER_ADDR"], env["MASTER_PORT"]),
        "launching ranks"
    );

    // Under live recovery the launcher of global rank 0 serves the ranks' store: it outlives
    // every rank, so rank 0 can be replaced as any other (the ranks know from
    // `DDP_LAUNCHER_STORE=1`). Dropped, and so closed, once the ranks are reaped.
    let _ranks_store = if cfg.live_recovery && first_rank == 0 {
        Some(serve_ranks_store(env)?)
    } else {
        None
    };
    let (done_tx, done_rx) = mpsc::channel();
    let mut spawner = RankSpawner {
        cfg,
        notes,
        env,
        program,
        args,
        first_rank,
        done: Some(done_tx),
        pumps: Vec::new(),
    };
    let mut ranks: Vec<Rank> = Vec::with_capacity(cfg.nproc_per_node);
    for local in 0..cfg.nproc_per_node {
        match spawner.spawn(local, rejoin) {
            Ok(child) => ranks.push(Rank {
                rank: first_rank + local,
                child,
                exit: None,
            }),
            Err(e) => {
                for r in &mut ranks {
                    kill_group(r.child.id(), libc::SIGKILL);
                    let _ = r.child.wait();
                }
                return Err(e);
            }
        }
    }

    let report = watch(shared, &mut ranks, start, &mut spawner, hooks);
    spawner.done = None;
    let pumps = std::mem::take(&mut spawner.pumps);

    // Every rank is reaped. Kill what is left of each rank's process group (a background
    // grandchild would otherwise outlive the job and hold the output pipe open).
    for r in &ranks {
        kill_group(r.child.id(), libc::SIGKILL);
    }
    let deadline = Instant::now() + OUTPUT_DRAIN;
    let mut finished = 0;
    while finished < pumps.len() {
        match done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(()) => finished += 1,
            Err(_) => {
                tracing::warn!(
                    "{} output stream(s) still open {OUTPUT_DRAIN:?} after the ranks exited; not waiting for them",
                    pumps.len() - finished
                );
                break;
            }
        }
    }
    for h in pumps {
        if h.is_finished() {
            let _ = h.join();
        }
    }
    Ok(report)
}

/// The ranks' store at `MASTER_ADDR:MASTER_PORT` of `env`, with the per-rank keys of the
/// round's token, as rank 0 would serve it.
fn serve_ranks_store(env: &BTreeMap<String, String>) -> Result<ddp_comm::StoreServer, LaunchError> {
    let port = env["MASTER_PORT"].parse().map_err(|_| {
        LaunchError::InvalidConfig(format!(
            "MASTER_PORT={:?} is not a port",
            env["MASTER_PORT"]
        ))
    })?;
    let endpoint = ddp_comm::env::endpoint(&env["MASTER_ADDR"], port);
    let served = match env.get(ddp_comm::env::TOKEN_VAR) {
        Some(round) => ddp_comm::StoreServer::bind_per_rank(&endpoint, round),
        None => Err(ddp_comm::CommError::Unauthenticated(
            "the launcher has no job token".into(),
        )),
    };
    let server = served.map_err(|source| LaunchError::RanksStore {
        endpoint: endpoint.clone(),
        source,
    })?;
    server.limit_clients_to_ranks(env["WORLD_SIZE"].parse().unwrap_or(1));
    tracing::debug!(%endpoint, "serving the ranks' store (live recovery)");
    Ok(server)
}

/// Polls the ranks until all have exited; stops the others on the first failure or on a
/// forwarded signal.
fn watch<A: AsRef<std::ffi::OsStr>>(
    shared: Shared<'_>,
    ranks: &mut [Rank],
    start: Instant,
    spawner: &mut RankSpawner<'_, A>,
    hooks: &mut dyn RoundHooks,
) -> LaunchReport {
    let first_rank = spawner.first_rank;
    let Shared {
        cfg,
        notes,
        forwarding,
        ..
    } = shared;
    let mut first_failure: Option<Failure> = None;
    // Failures a replacement process recovered (`--recover live`).
    let mut replaced: Vec<Failure> = Vec::new();
    let mut job_stop: Option<JobStop> = None;
    let mut interrupted: Option<(i32, usize)> = None;
    let mut signals_seen = 0u32;
    // When set: SIGKILL whatever still runs at this instant.
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;

    // When set: the others are stopped at this instant (at once after a rank's own failure,
    // after RELAY_SETTLE when the first failure only relayed a peer's).
    let mut stop_at: Option<Instant> = None;
    // Live recovery: when the ranks' notes were last read for a hung rank, and the processes
    // killed as hung (each once).
    let mut hung_checked = Instant::now();
    let mut hung_killed = HungKills::default();
    // The hang doctor: the ranks' progress, verdicts while they are alive, dumps.
    let env_number = |k: &str| spawner.env.get(k).and_then(|v| v.parse::<usize>().ok());
    let node = env_number("GROUP_RANK").unwrap_or(0);
    let mut doctor = doctor::Doctor::new(
        cfg,
        env_number("WORLD_SIZE").unwrap_or(ranks.len()),
        node,
        hooks.progress_share(node),
    );

    loop {
        let mut running = 0;
        let mut newly_failed: Option<Failure> = None;
        // The ranks that finished before this poll.
        let finished = ranks_done(ranks);
        for r in ranks.iter_mut() {
            if r.exit.is_some() {
                continue;
            }
            if doctor.holds(r.child.id()) {
                // Held for its stack, not yet stopped: a plain wait would take the coming
                // ptrace stop for its end. The doctor lets it go first.
                running += 1;
                continue;
            }
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = RankExit::from_status(status);
                    r.exit = Some(exit);
                    // What a process killed mid-handshake left in shared memory.
                    remove_segments(r.child.id());
                    tracing::debug!(rank = r.rank, %exit, "rank exited");
                    if exit.success() || kill_at.is_some() {
                        continue;
                    }
                    let failure = Failure {
                        rank: r.rank,
                        exit,
                        elapsed: start.elapsed(),
                        stopped: 0,
                        relayed_from: match exit {
                            RankExit::Code(_) => notes.relayed_from(r.rank),
                            RankExit::Signal(_) => None,
                        },
                    };
                    let quiet = first_failure.is_none()
                        && newly_failed.is_none()
                        && stop_at.is_none()
                        && interrupted.is_none()
                        && job_stop.is_none();
                    match live::verdict(cfg.live_recovery, &failure, quiet, &finished) {
                        live::Verdict::Replace => match hooks.charge_replacement(r.rank) {
                            Ok(spent) => {
                                // What is left of the lost process's group (a stray
                                // grandchild) goes with it, as at the end of a launch.
                                kill_group(r.child.id(), libc::SIGKILL);
                                match spawner.spawn(r.rank - first_rank, true) {
                                    Ok(child) => {
                                        eprintln!(
                                            "{}",
                                            live::replace_line(
                                                &failure,
                                                child.id(),
                                                spent,
                                                cfg.max_restarts
                                            )
                                        );
                                        r.child = child;
                                        r.exit = None;
                                        replaced.push(failure);
                                        running += 1;
                                        continue;
                                    }
                                    Err(e) => eprintln!(
                                        "ddprun: the replacement for rank {} did not start ({e}); stopping every rank",
                                        r.rank
                                    ),
                                }
                            }
                            Err(Some(spent)) => {
                                eprintln!("{}", live::spent_line(&failure, spent, cfg.max_restarts))
                            }
                            Err(None) => {
                                eprintln!("{}", live::stop_line(&failure, "the round is ending"))
                            }
                        },
                        live::Verdict::Stop(Some(line)) if quiet => eprintln!("{line}"),
                        live::Verdict::Stop(_) => {}
                    }
                    // Several ranks seen failed in one poll (5 ms): the likelier cause (a
                    // rank killed by a signal, then a rank's own error, then one that only
                    // relayed a peer's), else the lowest rank.
                    if newly_failed
                        .as_ref()
                        .is_none_or(|n| cause_of(&failure) < cause_of(n))
                    {
                        newly_failed = Some(failure);
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    // Cannot happen for our own child; stop it rather than spin.
                    tracing::warn!(rank = r.rank, "waiting for the rank failed: {e}");
                    kill_group(r.child.id(), libc::SIGKILL);
                    running += 1;
                }
            }
        }
        // Record a failure before deciding that the launch is over: the rank that failed may
        // be the last one to exit (one rank per node, or every rank failing together). A
        // failure that relayed a peer's is replaced by a rank's own that follows it.
        if let Some(failure) = newly_failed
            && first_failure
                .as_ref()
                .is_none_or(|f| cause_of(&failure) < cause_of(f))
        {
            let relayed = failure.relayed_from.is_some();
            hooks.local_failure(&failure);
            let due = if relayed {
                Instant::now() + RELAY_SETTLE
            } else {
                Instant::now()
            };
            stop_at = Some(stop_at.map_or(due, |t| t.min(due)));
            doctor.failed(&watched(ranks), notes, &failure.what_happened());
            first_failure = Some(failure);
        }
        if let (Some(t), Some(failure)) = (stop_at, first_failure.as_mut())
            && kill_at.is_none()
            && Instant::now() >= t
        {
            failure.stopped = running;
            if running > 0 {
                tracing::info!(rank = failure.rank, exit = %failure.exit, "rank failed; stopping the other {running} rank(s)");
                stop(ranks, libc::SIGTERM);
                kill_at = Some(Instant::now() + cfg.grace);
            }
        }
        if running == 0 {
            break;
        }
        if cfg.live_recovery
            && stop_at.is_none()
            && kill_at.is_none()
            && hung_checked.elapsed() >= HUNG_POLL
        {
            hung_checked = Instant::now();
            kill_hung_rank(ranks, notes, hooks, &mut hung_killed);
        }
        if kill_at.is_none()
            && let Some(stop) = hooks.stop_requested()
        {
            tracing::info!("{}; stopping this node's {running} rank(s)", stop.line);
            job_stop = Some(stop);
            self::stop(ranks, libc::SIGTERM);
            kill_at = Some(Instant::now() + cfg.grace);
        }

        if let Some((sig, count)) = forwarding.and_then(SignalForwarding::received)
            && count > signals_seen
        {
            signals_seen = count;
            if kill_at.is_none() {
                tracing::info!(
                    "received {}; forwarding it to {running} rank(s)",
                    signal_name(sig)
                );
                interrupted = Some((sig, running));
                stop(ranks, sig);
                kill_at = Some(Instant::now() + cfg.grace);
            } else {
                // A signal while stopping after a failure (or a second one): the user wants the
                // job to end — no restart — and not to wait out the grace period.
                interrupted.get_or_insert((sig, running));
                if !killed {
                    tracing::info!(
                        "received {} while stopping; killing the ranks now",
                        signal_name(sig)
                    );
                    kill_at = Some(Instant::now());
                }
            }
        }

        if kill_at.is_none() {
            doctor.poll(&watched(ranks), notes);
        }

        if let Some(t) = kill_at
            && !killed
            && Instant::now() >= t
        {
            tracing::info!("grace period over; sending SIGKILL to {running} rank(s)");
            stop(ranks, libc::SIGKILL);
            killed = true;
        }
        std::thread::sleep(POLL);
    }

    LaunchReport {
        exits: ranks
            .iter()
            .map(|r| r.exit.unwrap_or(RankExit::Code(1)))
            .collect(),
        first_rank,
        first_failure,
        interrupted,
        elapsed: start.elapsed(),
        attempt: 0,
        restarts: Vec::new(),
        replaced,
        job_stop,
    }
}

/// The ranks as the hang doctor sees them.
fn watched(ranks: &[Rank]) -> Vec<doctor::Watched> {
    ranks
        .iter()
        .map(|r| doctor::Watched {
            rank: r.rank,
            pid: r.child.id(),
            running: r.exit.is_none(),
        })
        .collect()
}

/// The ranks that exited 0.
fn ranks_done(ranks: &[Rank]) -> Vec<usize> {
    ranks
        .iter()
        .filter(|r| r.exit.is_some_and(RankExit::success))
        .map(|r| r.rank)
        .collect()
}

/// How often, under live recovery, the watch loop reads the running ranks' failure notes for
/// a hung rank.
const HUNG_POLL: Duration = Duration::from_millis(100);

/// The hung ranks a watch loop killed: once for each note (its noter and peer: a note stays
/// until its rank re-formed the group, and the killed rank's replacement is not hung), each
/// process once, and each rank another node reported once in a round (the report stays in the
/// state).
#[derive(Default)]
struct HungKills {
    notes: Vec<(usize, usize)>,
    pids: Vec<u32>,
    reported: Vec<usize>,
}

/// Under live recovery: kills a rank of this node that hangs (a running rank's collective
/// waited for it past its deadline, and it waits for nobody itself), once per process, so that
/// it is replaced as any killed rank (see [`live::hung_rank`]); reports a hung rank of another
/// node to its launcher, and kills a rank of this node another node reported.
fn kill_hung_rank(
    ranks: &[Rank],
    notes: &FailureNotes,
    hooks: &mut dyn RoundHooks,
    killed: &mut HungKills,
) {
    let running: Vec<usize> = ranks
        .iter()
        .filter(|r| r.exit.is_none())
        .map(|r| r.rank)
        .collect();
    let read: Vec<_> = running.iter().map(|&r| notes.note(r)).collect();
    // A note acted on and since withdrawn (its rank re-formed the group): a later one counts.
    killed.notes.retain(|&(noter, peer)| {
        running
            .iter()
            .zip(&read)
            .any(|(&q, n)| q == noter && n.is_some_and(|n| n.peer == peer))
    });
    for (noter, hung) in live::hung_elsewhere(&running, &read, ranks.iter().map(|r| r.rank)) {
        tracing::info!("rank {noter} waited for rank {hung} of another node past its deadline");
        hooks.report_hung(hung);
    }
    let reported: Vec<usize> = hooks
        .hung_elsewhere()
        .into_iter()
        .filter(|r| !killed.reported.contains(r))
        .collect();
    let found = live::hung_rank(&running, &read, &running, &killed.notes)
        .inspect(|&(hung, noter)| killed.notes.push((noter, hung)))
        .map(|(hung, noter)| (hung, format!("rank {noter}")))
        .or_else(|| {
            let hung = live::reported_hung(&running, &read, &reported)?;
            killed.reported.push(hung);
            Some((hung, "a rank of another node".to_string()))
        });
    let Some((hung, noter)) = found else {
        return;
    };
    let Some(r) = ranks.iter().find(|r| r.rank == hung) else {
        return;
    };
    let pid = r.child.id();
    if killed.pids.contains(&pid) {
        return;
    }
    killed.pids.push(pid);
    eprintln!(
        "ddprun: rank {hung} hangs: {noter} waited for it in a collective past its deadline \
         (DDP_TIMEOUT_SECS); killing it (SIGKILL) so that it is replaced"
    );
    kill_group(pid, libc::SIGKILL);
}

/// Removes the shared-memory segments and the local socket's directory the rank process `pid`
/// created and did not remove (it was killed mid-handshake); a failure is logged with the path.
fn remove_segments(pid: u32) {
    if let Err(e) = ddp_comm::group::remove_segments_of(pid) {
        tracing::warn!("cannot remove the shared-memory segments of process {pid}: {e}");
    }
    if let Err(e) = ddp_comm::group::remove_local_dirs_of(pid) {
        tracing::warn!("cannot remove the local socket directory of process {pid}: {e}");
    }
}

/// How likely `failure` is the root cause (see [`Cause`]).
pub(crate) fn cause_of(failure: &Failure) -> Cause {
    match (failure.exit, failure.relayed_from) {
        (RankExit::Signal(_), _) => Cause::Signal,
        (RankExit::Code(_), None) => Cause::Own,
        (RankExit::Code(_), Some(_)) => Cause::Relayed,
    }
}

/// Sends `sig` to the process group of every rank still running.
fn stop(ranks: &[Rank], sig: i32) {
    for r in ranks.iter().filter(|r| r.exit.is_none()) {
        kill_group(r.child.id(), sig);
    }
}

#[cfg(test)]
mod tests;
