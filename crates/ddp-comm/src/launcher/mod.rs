//! Starts, watches and stops rank processes (the library behind `ddprun`).
//!
//! [`launch`] follows torchrun's contract: it starts `nproc_per_node` copies of a program on this
//! node with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT` and the job token ([`crate::env::TOKEN_VAR`]) set, copies their output with a
//! `[rank k] ` prefix on every line, and watches them. When a rank exits non-zero or is killed
//! by a signal, the others are stopped (SIGTERM to each rank's process group, SIGKILL after
//! [`LaunchConfig::grace`]) and the first failure is reported.
//!
//! No process outlives the launch: each rank leads its own process group, which is killed
//! when the rank fails or after it exits (so stray grandchildren go too), and each rank gets
//! `PR_SET_PDEATHSIG = SIGKILL`, so it dies if the launcher itself is killed, even by SIGKILL.
//!
//! ```no_run
//! use ddp_comm::launcher::{launch, LaunchConfig};
//! let cfg = LaunchConfig { nproc_per_node: 4, ..LaunchConfig::default() };
//! let report = launch(&cfg, "./train", &["--epochs".to_string(), "1".to_string()])?;
//! if let Some(line) = report.summary() {
//!     eprintln!("{line}");
//! }
//! std::process::exit(report.exit_code());
//! # Ok::<(), ddp_comm::launcher::LaunchError>(())
//! ```

mod output;
mod signals;

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use signals::signal_name;

use crate::env::{DEFAULT_MASTER_PORT, TOKEN_VAR};
use output::Sink;
use signals::{SignalForwarding, kill_group};

/// How often the watch loop checks the ranks.
const POLL: Duration = Duration::from_millis(5);
/// How long to wait for a rank's output to drain after all ranks exited.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// What to launch on this node. `Default` is one rank on one node with a 5 s grace period.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    /// Ranks on this node (`LOCAL_WORLD_SIZE`), at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job, at least 1.
    pub nnodes: usize,
    /// This node's index, `0..nnodes` (`GROUP_RANK`).
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of the rendezvous store. `None`: a free port on one node, 29500 on several.
    pub master_port: Option<u16>,
    /// How long stopped ranks get between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Compute threads per rank (`OMP_NUM_THREADS`, `RAYON_NUM_THREADS`). `None`: when
    /// several ranks share the node and the variables are not already set,
    /// `max(1, cores / nproc_per_node)`.
    pub threads_per_rank: Option<usize>,
    /// Prefix each output line with `[rank k] ` (otherwise ranks write to our streams directly).
    pub prefix_output: bool,
    /// Give global rank 0 our stderr as it is (unprefixed), so a progress bar it draws there
    /// sees the terminal; its stdout and every other rank's output stay prefixed.
    pub rank0_stderr_direct: bool,
    /// The job token. `None`: taken from `DDP_JOB_TOKEN` in our environment if set; else a
    /// random one on a single node (an error on several nodes, which must share one).
    pub job_token: Option<String>,
    /// Catch SIGINT and SIGTERM while the ranks run and forward them to the ranks (then the
    /// same grace period and SIGKILL). The `ddprun` binary turns this on.
    pub forward_signals: bool,
    /// More variables for every rank, set last (they override the launcher's).
    pub extra_env: Vec<(String, String)>,
    /// How often to start the whole group again after a rank failed (torchrun's
    /// `--max-restarts`); 0 never restarts. Every attempt gets a fresh rendezvous (a new port
    /// on one node, and always a job token of its own, so a rank left over from an earlier
    /// attempt can never join) and `TORCHELASTIC_RESTART_COUNT` / `DDP_RESTART_COUNT` set to
    /// the attempt number. A forwarded signal (Ctrl-C, a scheduler's SIGTERM) ends the launch.
    pub max_restarts: usize,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: None,
            grace: Duration::from_secs(5),
            threads_per_rank: None,
            prefix_output: true,
            rank0_stderr_direct: false,
            job_token: None,
            forward_signals: false,
            extra_env: Vec::new(),
            max_restarts: 0,
        }
    }
}

/// The variables that carry the attempt number to the ranks: torchrun's, and burn-ddp's alias.
pub const RESTART_COUNT_VARS: [&str; 2] = ["TORCHELASTIC_RESTART_COUNT", "DDP_RESTART_COUNT"];

/// How an earlier attempt of a launch ended (see [`LaunchConfig::max_restarts`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptEnd {
    /// The attempt number, 0 for the first.
    pub attempt: usize,
    /// Its summary line (which rank failed, how, after how long).
    pub summary: String,
    /// Its exit code.
    pub exit_code: i32,
}

/// Why a launch could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The configuration cannot work (zero ranks, node rank out of range, …).
    #[error("invalid launch configuration: {0}")]
    InvalidConfig(String),
    /// Several nodes need one shared job token, and none was given.
    #[error(
        "{TOKEN_VAR} must be set to the same value on every node when nnodes = {nnodes} > 1 (e.g. `export {TOKEN_VAR}=$(openssl rand -hex 16)` before starting ddprun on each node)"
    )]
    MissingToken {
        /// The number of nodes.
        nnodes: usize,
    },
    /// No free port could be found for the rendezvous store.
    #[error("cannot find a free port for the rendezvous store on {addr}: {source}")]
    FreePort {
        /// The address probed.
        addr: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A rank process could not be started (the ranks already started were killed).
    #[error("cannot start rank {rank} ({program:?}): {source}")]
    Spawn {
        /// The rank that failed to start.
        rank: usize,
        /// The program.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Setting up the launcher itself failed (signal handlers, output threads).
    #[error("{what}: {source}")]
    Io {
        /// What was being set up.
        what: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankExit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl RankExit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(sig)) => RankExit::Signal(sig),
            // Neither is possible for a reaped child on Unix; treat as a failure.
            (None, None) => RankExit::Code(1),
        }
    }

    /// Whether this is a successful exit (code 0).
    pub fn success(self) -> bool {
        self == RankExit::Code(0)
    }

    /// The shell's convention: the code itself, or 128 + signal.
    pub fn shell_code(self) -> i32 {
        match self {
            RankExit::Code(c) => c,
            RankExit::Signal(s) => 128 + s,
        }
    }
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RankExit::Code(c) => write!(f, "exit code {c}"),
            RankExit::Signal(s) => write!(f, "signal {s} ({})", signal_name(s)),
        }
    }
}

/// The first rank that failed.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// Its global rank.
    pub rank: usize,
    /// How it ended.
    pub exit: RankExit,
    /// Time from the start of the launch to the failure.
    pub elapsed: Duration,
    /// How many other ranks were still running and had to be stopped.
    pub stopped: usize,
}

/// What happened to the ranks of a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchReport {
    /// How each local rank ended, by local rank (global rank = `first_rank + index`).
    pub exits: Vec<RankExit>,
    /// Global rank of local rank 0.
    pub first_rank: usize,
    /// The first rank that exited non-zero or by a signal, if any.
    pub first_failure: Option<Failure>,
    /// A signal the launcher received and forwarded (with `forward_signals`), if any, with the
    /// number of ranks it stopped.
    pub interrupted: Option<(i32, usize)>,
    /// Time from the start of this attempt until every rank was reaped.
    pub elapsed: Duration,
    /// This attempt's number (0 unless the group was restarted).
    pub attempt: usize,
    /// How the earlier attempts ended, in order (empty without restarts).
    pub restarts: Vec<AttemptEnd>,
}

impl LaunchReport {
    /// Whether every rank exited with code 0 and no signal interrupted the launch.
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && self.interrupted.is_none()
    }

    /// The launcher's exit code: 0 on success, the first failing rank's code (128 + signal
    /// for a signal), or 128 + the forwarded signal.
    pub fn exit_code(&self) -> i32 {
        if let Some(f) = &self.first_failure {
            // A non-zero code that wraps to 0 in the shell would hide the failure.
            let code = f.exit.shell_code();
            if code & 0xff == 0 { 1 } else { code }
        } else if let Some((sig, _)) = self.interrupted {
            128 + sig
        } else {
            0
        }
    }

    /// One line describing a failure or interruption, `None` on success, e.g.
    /// `ddprun: rank 1 failed with exit code 3 after 0.42 s; stopped the other 3 ranks`.
    pub fn summary(&self) -> Option<String> {
        if let Some(f) = &self.first_failure {
            let how = match f.exit {
                RankExit::Code(c) => format!("failed with exit code {c}"),
                RankExit::Signal(s) => {
                    format!("was killed by signal {s} ({})", signal_name(s))
                }
            };
            let others = match f.stopped {
                0 => "no other rank was running".to_string(),
                1 => "stopped the other 1 rank".to_string(),
                n => format!("stopped the other {n} ranks"),
            };
            let attempt = match self.attempt {
                0 => String::new(),
                n => format!(" (restart {n})"),
            };
            return Some(format!(
                "ddprun: rank {} {how} after {:.2} s{attempt}; {others}",
                f.rank,
                f.elapsed.as_secs_f64()
            ));
        }
        self.interrupted.map(|(sig, n)| {
            format!(
                "ddprun: received {} after {:.2} s; stopped {n} running rank{}",
                signal_name(sig),
                self.elapsed.as_secs_f64(),
                if n == 1 { "" } else { "s" }
            )
        })
    }
}

/// Validates `cfg` and works out the variables shared by every rank of this node.
fn common_env(cfg: &LaunchConfig) -> Result<BTreeMap<String, String>, LaunchError> {
    if cfg.nproc_per_node == 0 {
        return Err(LaunchError::InvalidConfig(
            "nproc_per_node must be at least 1".into(),
        ));
    }
    if cfg.nnodes == 0 {
        return Err(LaunchError::InvalidConfig(
            "nnodes must be at least 1".into(),
        ));
    }
    if cfg.node_rank >= cfg.nnodes {
        return Err(LaunchError::InvalidConfig(format!(
            "node_rank {} is out of range for nnodes = {} (must be 0..{})",
            cfg.node_rank, cfg.nnodes, cfg.nnodes
        )));
    }
    if cfg.master_addr.trim().is_empty() {
        return Err(LaunchError::InvalidConfig(
            "master_addr must not be empty".into(),
        ));
    }
    if cfg.threads_per_rank == Some(0) {
        return Err(LaunchError::InvalidConfig(
            "threads_per_rank must be at least 1".into(),
        ));
    }
    let world = cfg
        .nnodes
        .checked_mul(cfg.nproc_per_node)
        .ok_or_else(|| LaunchError::InvalidConfig("nnodes * nproc_per_node overflows".into()))?;

    let token = match &cfg.job_token {
        Some(t) if !t.is_empty() => t.clone(),
        Some(_) => {
            return Err(LaunchError::InvalidConfig(
                "the job token must not be empty".into(),
            ));
        }
        None => match std::env::var(TOKEN_VAR) {
            Ok(t) if !t.is_empty() => t,
            _ if cfg.nnodes > 1 => return Err(LaunchError::MissingToken { nnodes: cfg.nnodes }),
            _ => format!("{:032x}", rand::random::<u128>()),
        },
    };

    let port = match cfg.master_port {
        Some(0) => {
            return Err(LaunchError::InvalidConfig(
                "master_port 0 is not a port ranks can connect to".into(),
            ));
        }
        Some(p) => p,
        None if cfg.nnodes > 1 => DEFAULT_MASTER_PORT,
        None => free_port(&cfg.master_addr)?,
    };

    let mut env = BTreeMap::new();
    env.insert("WORLD_SIZE".into(), world.to_string());
    env.insert("LOCAL_WORLD_SIZE".into(), cfg.nproc_per_node.to_string());
    env.insert("GROUP_RANK".into(), cfg.node_rank.to_string());
    env.insert("MASTER_ADDR".into(), cfg.master_addr.clone());
    env.insert("MASTER_PORT".into(), port.to_string());
    env.insert(TOKEN_VAR.into(), token);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for var in ["OMP_NUM_THREADS", "RAYON_NUM_THREADS"] {
        let threads = match cfg.threads_per_rank {
            Some(t) => Some(t),
            None if cfg.nproc_per_node > 1 && std::env::var_os(var).is_none() => {
                Some((cores / cfg.nproc_per_node).max(1))
            }
            None => None,
        };
        if let Some(t) = threads {
            env.insert(var.into(), t.to_string());
        }
    }
    Ok(env)
}

/// A port nothing listens on now on `host` (see [`crate::net::free_port`]).
fn free_port(host: &str) -> Result<u16, LaunchError> {
    crate::net::free_port(host).map_err(|source| LaunchError::FreePort {
        addr: host.to_string(),
        source,
    })
}

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
/// use ddp_comm::launcher::{launch, LaunchConfig};
/// let cfg = LaunchConfig {
///     nproc_per_node: 2,
///     grace: Duration::from_secs(2),
///     ..LaunchConfig::default()
/// };
/// let report = launch(&cfg, "sh", &["-c", "echo hello from rank $RANK of $WORLD_SIZE"])?;
/// assert!(report.success());
/// # Ok::<(), ddp_comm::launcher::LaunchError>(())
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
    let mut restarts = Vec::new();
    for attempt in 0.. {
        let env = attempt_env(cfg, &env, attempt)?;
        let mut report = launch_once(cfg, &env, program, args, forwarding.as_ref())?;
        report.attempt = attempt;
        let again = !report.success() && report.interrupted.is_none() && attempt < cfg.max_restarts;
        if !again {
            report.restarts = restarts;
            return Ok(report);
        }
        let summary = report.summary().unwrap_or_default();
        // The launcher's own line, like the ranks' output it copies: the user sees the
        // restart when it happens, not only at the end.
        eprintln!(
            "{summary}; restarting the group (restart {} of {})",
            attempt + 1,
            cfg.max_restarts
        );
        restarts.push(AttemptEnd {
            attempt,
            summary,
            exit_code: report.exit_code(),
        });
    }
    unreachable!("the attempts loop returns")
}

/// The variables of attempt `attempt`: the restart counters, and from the first restart on a
/// fresh port (one node, port not fixed) and a job token of the attempt's own.
fn attempt_env(
    cfg: &LaunchConfig,
    first: &BTreeMap<String, String>,
    attempt: usize,
) -> Result<BTreeMap<String, String>, LaunchError> {
    let mut env = first.clone();
    for var in RESTART_COUNT_VARS {
        env.insert(var.into(), attempt.to_string());
    }
    if attempt > 0 {
        if cfg.master_port.is_none() && cfg.nnodes == 1 {
            env.insert(
                "MASTER_PORT".into(),
                free_port(&cfg.master_addr)?.to_string(),
            );
        }
        let token = format!("{}.restart{attempt}", first[TOKEN_VAR]);
        env.insert(TOKEN_VAR.into(), token);
    }
    Ok(env)
}

/// One attempt: starts the ranks with `env`, watches them until all have ended, reaps them.
fn launch_once(
    cfg: &LaunchConfig,
    env: &BTreeMap<String, String>,
    program: &std::ffi::OsStr,
    args: &[impl AsRef<std::ffi::OsStr>],
    forwarding: Option<&SignalForwarding>,
) -> Result<LaunchReport, LaunchError> {
    let start = Instant::now();
    let first_rank = cfg.node_rank * cfg.nproc_per_node;
    tracing::info!(
        program = ?program,
        nproc_per_node = cfg.nproc_per_node,
        world_size = %env["WORLD_SIZE"],
        master = format!("{}:{}", env["MASTER_ADDR"], env["MASTER_PORT"]),
        "launching ranks"
    );

    // SAFETY: getpid has no preconditions.
    let launcher_pid = unsafe { libc::getpid() };
    let (done_tx, done_rx) = mpsc::channel();
    let mut pumps = Vec::new();
    let mut ranks: Vec<Rank> = Vec::with_capacity(cfg.nproc_per_node);
    for local in 0..cfg.nproc_per_node {
        let rank = first_rank + local;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(env)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .envs(cfg.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0);
        if cfg.prefix_output {
            cmd.stdout(Stdio::piped());
            if !(cfg.rank0_stderr_direct && rank == 0) {
                cmd.stderr(Stdio::piped());
            }
        }
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls (prctl, getppid, kill).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if libc::getppid() != launcher_pid {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                for r in &mut ranks {
                    kill_group(r.child.id(), libc::SIGKILL);
                    let _ = r.child.wait();
                }
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        tracing::debug!(rank, pid = child.id(), "rank started");
        if cfg.prefix_output {
            let streams = [
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn io::Read + Send>),
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn io::Read + Send>),
            ];
            for (stream, sink) in streams.into_iter().zip([Sink::Stdout, Sink::Stderr]) {
                let Some(stream) = stream else { continue };
                match output::pump(rank, stream, sink, done_tx.clone()) {
                    Ok(h) => pumps.push(h),
                    Err(source) => {
                        // Without a reader the rank would block on a full pipe: give up.
                        kill_group(child.id(), libc::SIGKILL);
                        let _ = child.wait();
                        for r in &mut ranks {
                            kill_group(r.child.id(), libc::SIGKILL);
                            let _ = r.child.wait();
                        }
                        return Err(LaunchError::Io {
                            what: format!("starting the output thread of rank {rank}"),
                            source,
                        });
                    }
                }
            }
        }
        ranks.push(Rank {
            rank,
            child,
            exit: None,
        });
    }
    drop(done_tx);

    let report = watch(cfg, &mut ranks, forwarding, start, first_rank);

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

/// Polls the ranks until all have exited; stops the others on the first failure or on a
/// forwarded signal.
fn watch(
    cfg: &LaunchConfig,
    ranks: &mut [Rank],
    forwarding: Option<&SignalForwarding>,
    start: Instant,
    first_rank: usize,
) -> LaunchReport {
    let mut first_failure: Option<Failure> = None;
    let mut interrupted: Option<(i32, usize)> = None;
    let mut signals_seen = 0u32;
    // When set: SIGKILL whatever still runs at this instant.
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;

    loop {
        let mut running = 0;
        let mut newly_failed: Option<(usize, RankExit)> = None;
        for r in ranks.iter_mut() {
            if r.exit.is_some() {
                continue;
            }
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = RankExit::from_status(status);
                    r.exit = Some(exit);
                    tracing::debug!(rank = r.rank, %exit, "rank exited");
                    // Several ranks seen failed in one poll (5 ms): a rank killed by a
                    // signal is the likelier cause (its peers then fail on the closed
                    // connection with an error code), else the lowest rank.
                    let more_likely_cause = match newly_failed {
                        None => true,
                        Some((_, earlier)) => {
                            matches!(exit, RankExit::Signal(_))
                                && matches!(earlier, RankExit::Code(_))
                        }
                    };
                    if !exit.success() && kill_at.is_none() && more_likely_cause {
                        newly_failed = Some((r.rank, exit));
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
        // be the last one to exit (one rank per node, or every rank failing together).
        if let Some((rank, exit)) = newly_failed {
            first_failure = Some(Failure {
                rank,
                exit,
                elapsed: start.elapsed(),
                stopped: running,
            });
            if running > 0 {
                tracing::info!(rank, %exit, "rank failed; stopping the other {running} rank(s)");
                stop(ranks, libc::SIGTERM);
                kill_at = Some(Instant::now() + cfg.grace);
            }
        }
        if running == 0 {
            break;
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
            } else if !killed {
                // A second signal while stopping: do not wait out the grace period.
                tracing::info!("received {} again; killing the ranks now", signal_name(sig));
                kill_at = Some(Instant::now());
            }
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
