//! What to launch ([`LaunchConfig`]) and the environment every rank of an attempt gets.

use std::collections::BTreeMap;
use std::time::Duration;

use super::LaunchError;
use ddp_comm::auth::Key;
use ddp_comm::env::{DEFAULT_MASTER_PORT, TOKEN_VAR};
use ddp_comm::env::{RESTART_COUNT_VARS, ROUND_VAR};

/// What to launch on this node. `Default` is one rank on one node with a 5 s grace period.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    /// Ranks on this node (`LOCAL_WORLD_SIZE`), at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job, at least 1 (with [`Self::min_nodes`], the most nodes: torchrun's
    /// `--nnodes MIN:MAX`). Above 1, the launchers of the job meet at a rendezvous that node
    /// 0's launcher serves (see the `rendezvous` module): restarts and membership are agreed
    /// on by all of them, round by round.
    pub nnodes: usize,
    /// The fewest nodes a round may start with. `None`: [`Self::nnodes`] (a fixed size).
    pub min_nodes: Option<usize>,
    /// This node's index, `0..nnodes` (any number from 1 on for the other nodes of an elastic
    /// job, `min_nodes < nnodes`). Node 0 hosts the launchers' rendezvous; on several nodes the
    /// node rank a round gives (`GROUP_RANK`) follows this order, then arrival.
    pub node_rank: usize,
    /// Host of the rendezvous store (`MASTER_ADDR`): rank 0's on one node, the launchers' on
    /// several (node 0's; rank 0 of every round serves the ranks' store on that host too).
    pub master_addr: String,
    /// Port of the rendezvous store. `None`: a free port on one node, 29500 on several (where
    /// it is the launchers' rendezvous; each round's ranks get a fresh port of their own).
    pub master_port: Option<u16>,
    /// This node's address as the other nodes reach it, on several nodes (torchrun's
    /// `--local-addr`): where its rank 0 serves the ranks' store in a round whose node 0 it
    /// is. `None`: the address its connection to the rendezvous comes from.
    pub local_addr: Option<String>,
    /// The launchers' rendezvous endpoint `HOST:PORT` on several nodes (torchrun's
    /// `--rdzv-endpoint`). `None`: `master_addr:master_port`.
    pub rdzv_endpoint: Option<String>,
    /// How long a round with at least [`Self::min_nodes`] (and fewer than `nnodes`) launchers
    /// waits for more (torchrun's last call).
    pub rdzv_last_call: Duration,
    /// A launcher whose heartbeat stops for this long is lost: its round ends (and node 0's
    /// launcher, when the others' heartbeats to it fail this long).
    pub rdzv_heartbeat: Duration,
    /// How long a round may wait for [`Self::min_nodes`] launchers before the job fails.
    pub rdzv_join_timeout: Duration,
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
    /// Live recovery (`--recover live`): a rank that dies of its own failure (rank 0 too: the
    /// launcher of global rank 0 then serves the ranks' store, `DDP_LAUNCHER_STORE=1`) is
    /// replaced by a new process for the same rank, started with `DDP_REJOIN=1` by
    /// its node's launcher, while the others (on every node) keep running and re-form their
    /// group with it (`ProcessGroup::reform` / `ProcessGroup::rejoin`). Each replacement counts
    /// against [`Self::max_restarts`]; on several nodes each launcher counts its own
    /// replacements together with the job's group restarts. Any other failure (a rank failing on
    /// a peer's, a second one while stopping) stops every rank as without it, and on
    /// several nodes ends the round for every node.
    pub live_recovery: bool,
    /// Emulated GPU hosts (`--emulate-gpu-hosts`): every rank an NCCL host of its own
    /// ([`ddp_comm::gpu_hosts::rank_vars`]: `NCCL_HOSTID`, NCCL's socket transport on
    /// loopback), so that several ranks share one GPU through NCCL. For tests and benchmarks
    /// on a machine with fewer GPUs than ranks; the launch says so in its first line.
    pub emulate_gpu_hosts: bool,
    /// Record a timeline of every rank into this directory (sets `DDP_TRACE` for the ranks,
    /// see [`ddp_trace`]) and merge the rank files into `DIR/trace.json` when the launch
    /// has ended, also when ranks failed. `None`: `DDP_TRACE` from [`Self::extra_env`] or
    /// from our environment, if set, does the same. With restarts, the last attempt's.
    pub trace: Option<std::path::PathBuf>,
    /// The hang doctor ([`crate::doctor`]): a hang verdict once no rank finished a collective
    /// for this long while ranks wait in one. `None`: a quarter of the ranks' collective
    /// timeout (`DDP_TIMEOUT_SECS` in [`Self::extra_env`] or our environment, else 300 s),
    /// at least 1 s.
    pub hang_after: Option<Duration>,
    /// A straggler warning once a rank's own work per step exceeds this many times the
    /// others' median (sustained over its last steps).
    pub straggler_factor: f64,
    /// Where dumps go (every rank's flight recorder and stack as JSON): at every hang verdict
    /// (`--dump-on-hang DIR`) and on SIGUSR1. `None`: no dump at a hang; SIGUSR1 writes into
    /// `ddprun-dumps` in the current directory.
    pub dump_on_hang: Option<std::path::PathBuf>,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            min_nodes: None,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: None,
            rdzv_endpoint: None,
            local_addr: None,
            rdzv_last_call: Duration::from_secs(10),
            rdzv_heartbeat: Duration::from_secs(10),
            rdzv_join_timeout: Duration::from_secs(300),
            grace: Duration::from_secs(5),
            threads_per_rank: None,
            prefix_output: true,
            rank0_stderr_direct: false,
            job_token: None,
            forward_signals: false,
            extra_env: Vec::new(),
            max_restarts: 0,
            live_recovery: false,
            emulate_gpu_hosts: false,
            trace: None,
            hang_after: None,
            straggler_factor: 2.0,
            dump_on_hang: None,
        }
    }
}

/// The job token of the ranks of `what` number `n` (a round, an attempt): a key derived from
/// the launchers' job token, so that the ranks never hold the launchers' secret and one
/// round's token reveals no other's.
pub(super) fn ranks_token(job_token: &str, what: &str, n: u64) -> String {
    Key::from_token(job_token)
        .derive(&format!("ranks/{what}/{n}"))
        .to_token()
}

/// The job token rank `rank` gets in a round whose ranks' token is `round_token`: rank 0 the
/// round's when it serves the store, any other rank — and rank 0 when the launcher serves the
/// store (`launcher_store`) — a key of its own derived from it ([`Key::rank_key`]), with which
/// it proves which rank it is and can pass for no other (`DDP_RANK_KEYS=1` tells the rank so).
pub(super) fn rank_token(round_token: &str, rank: usize, launcher_store: bool) -> String {
    if rank == 0 && !launcher_store {
        return round_token.to_string();
    }
    Key::from_token(round_token)
        .rank_key(rank as u32)
        .to_token()
}

/// Validates `cfg` and works out the variables shared by every rank of this node.
pub(super) fn common_env(cfg: &LaunchConfig) -> Result<BTreeMap<String, String>, LaunchError> {
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
    if let Some(min) = cfg.min_nodes
        && !(1..=cfg.nnodes).contains(&min)
    {
        return Err(LaunchError::InvalidConfig(format!(
            "the fewest nodes ({min}) must be between 1 and the most nodes ({})",
            cfg.nnodes
        )));
    }
    if cfg.live_recovery && cfg.max_restarts == 0 {
        return Err(LaunchError::InvalidConfig(
            "--recover live needs --max-restarts 1 or more: each replacement counts against it"
                .into(),
        ));
    }
    if cfg.nnodes > 1 && cfg.rdzv_heartbeat.is_zero() {
        return Err(LaunchError::InvalidConfig(
            "the rendezvous heartbeat timeout must be above 0".into(),
        ));
    }
    // An elastic job's extra or replacement nodes may take any rank from 1 (rounds order by
    // it); a fixed-size job's are 0..nnodes.
    let elastic = cfg.min_nodes.is_some_and(|min| min < cfg.nnodes);
    if cfg.node_rank >= cfg.nnodes && !elastic {
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

    // A token given in DDP_JOB_TOKEN of under 128 bits is refused (nothing on the wire lets
    // anyone test guesses of it off line, but every connection may try one), unless the user
    // says so with DDP_ALLOW_WEAK_TOKEN=1; the ones ddprun makes pass.
    if cfg.job_token.is_none()
        && std::env::var(TOKEN_VAR).is_ok_and(|t| t == token)
        && let Some(why) = ddp_comm::job_auth::weak_token(&token)
    {
        if std::env::var(ddp_comm::job_auth::WEAK_TOKEN_VAR).as_deref() != Ok("1") {
            return Err(LaunchError::InvalidConfig(why));
        }
        tracing::warn!(
            "runs with a weak {TOKEN_VAR} ({:.0} bits, under 128) because {}=1: anyone who \
             reaches the job's stores may guess it on line",
            ddp_comm::job_auth::token_bits(&token),
            ddp_comm::job_auth::WEAK_TOKEN_VAR
        );
    }

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
    // The ranks write into pipes; whether colour reaches a terminal is the launcher's to know.
    let colour = ddp_comm::log::colour_wanted();
    env.insert(
        ddp_comm::log::COLOR_VAR.into(),
        if colour { "1" } else { "0" }.into(),
    );
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

/// The variables of attempt `attempt`: the restart counters, and from the first restart on a
/// fresh port (one node, port not fixed) and a job token of the attempt's own.
pub(super) fn attempt_env(
    cfg: &LaunchConfig,
    first: &BTreeMap<String, String>,
    attempt: usize,
) -> Result<BTreeMap<String, String>, LaunchError> {
    let mut env = first.clone();
    for var in RESTART_COUNT_VARS {
        env.insert(var.into(), attempt.to_string());
    }
    // On one node every attempt after the first is a restart: the round is the attempt.
    env.insert(ROUND_VAR.into(), attempt.to_string());
    // A token of the attempt's own, derived from the launcher's: a rank left over from an
    // earlier attempt can never join, and no rank holds the launcher's.
    env.insert(
        TOKEN_VAR.into(),
        ranks_token(&first[TOKEN_VAR], "attempt", attempt as u64),
    );
    if attempt > 0 {
        if cfg.master_port.is_none() && cfg.nnodes == 1 {
            env.insert(
                "MASTER_PORT".into(),
                free_port(&cfg.master_addr)?.to_string(),
            );
        }
        // The ranks write into pipes; whether colour reaches a terminal is the launcher's to know.
        let colour = ddp_comm::log::colour_wanted();
        env.insert(
            ddp_comm::log::COLOR_VAR.into(),
            if colour { "1" } else { "0" }.into(),
        );
    }
    Ok(env)
}
