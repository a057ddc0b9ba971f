//! How a launch ended: [`LaunchReport`], [`RankExit`], [`LaunchError`].

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use super::signals::signal_name;
use ddp_comm::env::TOKEN_VAR;

/// How an earlier attempt of a launch ended (see [`LaunchConfig::max_restarts`](super::LaunchConfig::max_restarts)).
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
    /// Under live recovery, this launcher serves the ranks' store, and could not.
    #[error("cannot serve the ranks' store at {endpoint} (--recover live): {source}")]
    RanksStore {
        /// Where it was to listen (`MASTER_ADDR:MASTER_PORT`).
        endpoint: String,
        /// The store's error.
        #[source]
        source: ddp_comm::CommError,
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
    /// The launchers of a job over several nodes could not agree (see the `rendezvous`
    /// module: a host that is gone, a node that differs, too few nodes).
    #[error(transparent)]
    Rendezvous(#[from] super::rendezvous::RendezvousError),
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
    pub(super) fn from_status(status: ExitStatus) -> Self {
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
    /// The rank whose failure this rank only relayed, when it said so (`DDP_FAILURE_FILE`):
    /// its error was a peer's, and the launcher names a rank with an error of its own
    /// instead when one fails too.
    pub relayed_from: Option<usize>,
}

/// Why a job over several nodes stopped this node's ranks: what happened on another node (or
/// to it), as every launcher of the job prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStop {
    /// The line, naming the node and what happened there.
    pub line: String,
    /// The exit code the job ends with if it ends here.
    pub exit_code: i32,
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
    /// The rank failures of this attempt that a replacement process recovered while the
    /// others ran (`LaunchConfig::live_recovery`), in order.
    pub replaced: Vec<Failure>,
    /// On a job of several nodes: the job stopped this node's ranks (a failure elsewhere, a
    /// lost node, a scale-up) or ended without a failure here.
    pub job_stop: Option<JobStop>,
}

impl LaunchReport {
    /// Whether every rank exited with code 0, no signal interrupted the launch, and (on
    /// several nodes) the job did not stop it.
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && self.interrupted.is_none() && self.job_stop.is_none()
    }

    /// The launcher's exit code: 0 on success, the first failing rank's code (128 + signal
    /// for a signal), or 128 + the forwarded signal.
    pub fn exit_code(&self) -> i32 {
        if let Some(f) = &self.first_failure {
            // A non-zero code that wraps to 0 in the shell would hide the failure.
            let code = f.exit.shell_code();
            if code & 0xff == 0 { 1 } else { code }
        } else if let Some(stop) = &self.job_stop {
            if stop.exit_code & 0xff == 0 {
                1
            } else {
                stop.exit_code
            }
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
            let others = match f.stopped {
                0 => "no other rank was running".to_string(),
                1 => "stopped the other 1 rank".to_string(),
                n => format!("stopped the other {n} ranks"),
            };
            let attempt = match self.attempt {
                0 => String::new(),
                n => format!(" (restart {n})"),
            };
            return Some(format!("ddprun: {}{attempt}; {others}", f.what_happened()));
        }
        if let Some(stop) = &self.job_stop {
            return Some(stop.line.clone());
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

impl Failure {
    /// What happened, e.g. `rank 1 failed with exit code 3 after 0.42 s`.
    pub fn what_happened(&self) -> String {
        let how = match self.exit {
            RankExit::Code(c) => format!("failed with exit code {c}"),
            RankExit::Signal(s) => {
                format!("was killed by signal {s} ({})", signal_name(s))
            }
        };
        let relayed = match self.relayed_from {
            Some(peer) => format!(" (on rank {peer}'s failure)"),
            None => String::new(),
        };
        format!(
            "rank {} {how} after {:.2} s{relayed}",
            self.rank,
            self.elapsed.as_secs_f64()
        )
    }
}
