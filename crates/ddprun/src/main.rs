//! `ddprun`: starts the ranks of a data-parallel job on this node (torchrun's shape).
//!
//! ```text
//! ddprun --nproc-per-node 4 -- ./train --epochs 1
//! ddprun --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- ./train
//! ddprun --nproc-per-node 8 --nnodes 1:4 --node-rank 2 --master-addr 10.0.0.1 --max-restarts 3 -- ./train
//! ```
//!
//! On several nodes the launchers meet at a rendezvous that node 0's ddprun serves
//! (`--rdzv-endpoint`, default `MASTER_ADDR:MASTER_PORT`): every restart and every change of
//! membership is a round all of them agree on (see `ddprun`).
//!
//! Exit code: 0 when every rank succeeds; otherwise the first failing rank's exit code (128 +
//! signal when it was killed by a signal), with one summary line on stderr. With
//! `--max-restarts K` a failed group is started again up to K times (one line per failed
//! attempt); the exit code is then the last attempt's. With `--trace DIR` every rank records a
//! timeline and ddprun merges them into `DIR/trace.json`, printing where it is;
//! `ddprun --merge-trace DIR` merges rank files gathered from several nodes into one timeline.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ddprun::{LaunchConfig, LaunchError, launch};

/// `--recover`: what a rank's failure costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Recover {
    /// Stop every rank; start the group again within --max-restarts.
    Restart,
    /// Replace the lost rank while the others run.
    Live,
}

/// Start, watch and stop the rank processes of a data-parallel job on this node.
///
/// Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
/// MASTER_PORT and DDP_JOB_TOKEN. When a rank fails, the others get SIGTERM, then SIGKILL after
/// the grace period; ddprun exits with the failing rank's exit code.
#[derive(Debug, Parser)]
#[command(name = "ddprun", version)]
struct Args {
    /// Ranks to start on this node.
    #[arg(long = "nproc-per-node", visible_alias = "nproc_per_node", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    nproc_per_node: u32,
    /// Nodes in the job, N or MIN:MAX (each runs its own ddprun; set DDP_JOB_TOKEN to one
    /// value on all). With MIN:MAX a round starts with MAX nodes, or with at least MIN once
    /// --rdzv-last-call has passed; a node that joins later is admitted by restarting the group
    /// (under --recover live it waits as a spare instead, and takes over a node whose ddprun
    /// is killed, live).
    #[arg(long, default_value = "1", value_parser = parse_nnodes, value_name = "N|MIN:MAX")]
    nnodes: (u32, u32),
    /// This node's index. Node 0 hosts the launchers' rendezvous; a round ranks its nodes by
    /// it, then by arrival (GROUP_RANK). Any number from 1 on for the others (0..nnodes on a
    /// job of fixed size), so that a replacement or an extra node of an elastic job has a
    /// place of its own.
    #[arg(long = "node-rank", visible_alias = "node_rank", default_value_t = 0)]
    node_rank: u32,
    /// The launchers' rendezvous on several nodes, HOST:PORT, served by node 0's ddprun
    /// [default: MASTER_ADDR:MASTER_PORT].
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        value_name = "HOST:PORT"
    )]
    rdzv_endpoint: Option<String>,
    /// This node's address as the other nodes reach it (where its rank 0 serves when it is
    /// node 0 of a round) [default: the address its connection to the rendezvous comes from].
    #[arg(long = "local-addr", visible_alias = "local_addr", value_name = "ADDR")]
    local_addr: Option<String>,
    /// With --nnodes MIN:MAX: how long a round with at least MIN nodes waits for more.
    #[arg(long = "rdzv-last-call", visible_alias = "rdzv_last_call", default_value_t = 10.0,
          value_parser = parse_secs, value_name = "SECS")]
    rdzv_last_call: f64,
    /// A node whose ddprun sends no heartbeat for this long is lost (its round ends); when
    /// node 0's ddprun stops answering for this long (plus 1.5 beats of a fifth of it and a
    /// last try: at most 1.5 × this + 1 s), every other node fails. The same on every node (one that differs
    /// is refused).
    #[arg(long = "rdzv-heartbeat-secs", visible_alias = "rdzv_heartbeat_secs",
          default_value_t = 10.0, value_parser = parse_secs, value_name = "SECS")]
    rdzv_heartbeat_secs: f64,
    /// How long a round waits for the fewest nodes it needs before the job fails (the same on
    /// every node).
    #[arg(long = "rdzv-join-timeout", visible_alias = "rdzv_join_timeout",
          default_value_t = 300.0, value_parser = parse_secs, value_name = "SECS")]
    rdzv_join_timeout: f64,
    /// Host of rank 0 (where the rendezvous store runs).
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    master_addr: String,
    /// Port of the rendezvous store [default: MASTER_PORT from the environment, else a free
    /// port on one node, 29500 on several].
    #[arg(long = "master-port", visible_alias = "master_port",
          value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long = "grace-secs", visible_alias = "grace_secs", default_value_t = 5.0,
          value_parser = parse_secs)]
    grace_secs: f64,
    /// Compute threads per rank (OMP_NUM_THREADS, RAYON_NUM_THREADS)
    /// [default: cores / nproc-per-node when several ranks share the node].
    #[arg(long = "threads-per-rank", visible_alias = "threads_per_rank",
          value_parser = clap::value_parser!(u32).range(1..))]
    threads_per_rank: Option<u32>,
    /// Do not prefix output lines with `[rank k] ` (ranks write to ddprun's streams directly).
    #[arg(long = "no-prefix", visible_alias = "no_prefix")]
    no_prefix: bool,
    /// Start the whole group again after a rank failed, up to this many times (torchrun's
    /// --max-restarts). Each attempt gets a fresh rendezvous and TORCHELASTIC_RESTART_COUNT /
    /// DDP_RESTART_COUNT set to the failed attempts before it (torchrun's meaning; on several
    /// nodes DDP_ROUND counts every round, scale-ups included); the exit code is the last
    /// attempt's.
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        default_value_t = 0
    )]
    max_restarts: u32,
    /// What a rank's failure costs: `restart` stops every rank (of every node) and starts the
    /// group again (within --max-restarts); `live` replaces a lost rank (0 included) by a new
    /// process with DDP_REJOIN=1, started by its node's launcher, while the others keep
    /// running and re-form their group with it (each replacement counts against this node's
    /// --max-restarts; other failures stop every rank). On several nodes a spare launcher
    /// (one that joined while the round ran) takes over a node whose ddprun was killed, its
    /// ranks replacements in the running group. Under `live` the launcher of rank 0
    /// serves the ranks' store at MASTER_PORT (DDP_LAUNCHER_STORE=1): the program's rank 0
    /// must connect to it rather than serve one (burn-ddp's does).
    #[arg(long, value_enum, default_value_t = Recover::Restart)]
    recover: Recover,
    /// Make every rank an NCCL host of its own (NCCL_HOSTID per rank, NCCL_NET=Socket on
    /// loopback, DDP_EMULATED_GPU_HOST), so that several ranks share one GPU through NCCL: for
    /// tests and benchmarks on a machine with fewer GPUs than ranks (said in the first line).
    #[arg(long = "emulate-gpu-hosts")]
    emulate_gpu_hosts: bool,
    /// Leave rank 0's stderr unprefixed and connected to ddprun's own, so a progress bar rank 0
    /// draws there sees the terminal (its stdout and the other ranks stay prefixed).
    #[arg(long = "rank0-stderr-direct")]
    rank0_stderr_direct: bool,
    /// Record a timeline of every rank into DIR (sets DDP_TRACE for the ranks) and merge the
    /// rank files into DIR/trace.json when the job has ended (Chrome trace-event format: open
    /// it in https://ui.perfetto.dev or chrome://tracing). Without it, DDP_TRACE in ddprun's
    /// environment does the same.
    #[arg(long, value_name = "DIR")]
    trace: Option<std::path::PathBuf>,
    /// Launch nothing: merge the rank files in DIR (`rank-<R>.trace.json`, restarts' in
    /// `DIR/attempt-<K>/`) into DIR/trace.json and exit, e.g. the files of a job over several
    /// nodes gathered into one directory (every rank's clock was aligned to rank 0's at
    /// rendezvous). Ranks expected: nnodes × nproc-per-node when either is given, else every
    /// rank up to the highest found.
    #[arg(long = "merge-trace", value_name = "DIR", conflicts_with_all = ["trace", "command"])]
    merge_trace: Option<std::path::PathBuf>,
    /// The hang doctor: a hang verdict (which ranks wait in which collective, where each other
    /// rank is, with its stack) once no rank finished a collective for SECS while ranks wait in
    /// one [default: a quarter of DDP_TIMEOUT_SECS, 75 s without it]. One line per incident,
    /// while every rank is alive; the job goes on until the collective timeout ends it.
    #[arg(long = "hang-after", value_parser = parse_secs, value_name = "SECS")]
    hang_after: Option<f64>,
    /// Warn (once per incident; the job goes on) when a rank's own work per step exceeds X
    /// times the others' median over its last steps: a straggler.
    #[arg(long = "straggler-factor", default_value_t = 2.0, value_name = "X",
          value_parser = parse_factor)]
    straggler_factor: f64,
    /// Write every rank's flight recorder and stack as JSON under DIR at every hang verdict and
    /// when a rank fails (and on SIGUSR1, which without this flag writes under ./ddprun-dumps).
    /// Read a dump with `ddprun doctor DIR`.
    #[arg(long = "dump-on-hang", value_name = "DIR")]
    dump_on_hang: Option<std::path::PathBuf>,
    /// Launch nothing: read the dump(s) under DIR (written on SIGUSR1 or at a hang) and print
    /// where every rank was and the verdict. Also `ddprun doctor DIR`. With --hang-after SECS
    /// (default 10 here), the threshold the verdict is judged by.
    #[arg(long = "doctor", value_name = "DIR", conflicts_with_all = ["trace", "command", "merge_trace"])]
    doctor: Option<std::path::PathBuf>,
    /// The program to run, then its arguments (after `--`).
    #[arg(
        required_unless_present_any = ["merge_trace", "doctor"],
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]..."
    )]
    command: Vec<OsString>,
}

/// `N` or `MIN:MAX`, 1 ≤ MIN ≤ MAX.
fn parse_nnodes(s: &str) -> Result<(u32, u32), String> {
    let number = |v: &str| {
        v.trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("{v:?} is not a number of nodes (1 or more)"))
    };
    let (min, max) = match s.split_once(':') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min > max {
        return Err(format!("MIN {min} is above MAX {max} in {s:?}"));
    }
    Ok((min, max))
}

fn parse_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds between 0 and 86400"
        )),
    }
}

fn parse_factor(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 1.0 => Ok(v),
        _ => Err(format!("{s:?} is not a factor above 1")),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(ddp_comm::log::colour_wanted())
        .with_writer(std::io::stderr)
        .init();
    // `ddprun doctor DIR` is `ddprun --doctor DIR`.
    let mut argv: Vec<OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "doctor") {
        argv[1] = "--doctor".into();
    }
    let args = Args::parse_from(argv);
    if let Some(dir) = &args.doctor {
        let hang_after = Duration::from_secs_f64(args.hang_after.unwrap_or(10.0));
        return ddprun::doctor(dir, hang_after, args.straggler_factor);
    }
    if let Some(dir) = &args.merge_trace {
        return merge_trace(dir, (args.nnodes.1 * args.nproc_per_node) as usize);
    }
    // Without --master-port, MASTER_PORT from the environment (torchrun's reading); one that
    // is not a port is refused, not ignored.
    let master_port = match (args.master_port, std::env::var("MASTER_PORT")) {
        (Some(p), _) => Some(p),
        (None, Ok(v)) if !v.is_empty() => match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Some(p),
            _ => {
                eprintln!(
                    "ddprun: error: MASTER_PORT={v:?} is not a port (1 to 65535); unset it or pass --master-port"
                );
                return ExitCode::from(2);
            }
        },
        (None, _) => None,
    };
    let (min_nodes, max_nodes) = args.nnodes;
    let cfg = LaunchConfig {
        nproc_per_node: args.nproc_per_node as usize,
        nnodes: max_nodes as usize,
        min_nodes: Some(min_nodes as usize),
        node_rank: args.node_rank as usize,
        master_addr: args.master_addr,
        master_port,
        rdzv_endpoint: args.rdzv_endpoint,
        local_addr: args.local_addr,
        rdzv_last_call: Duration::from_secs_f64(args.rdzv_last_call),
        rdzv_heartbeat: Duration::from_secs_f64(args.rdzv_heartbeat_secs),
        rdzv_join_timeout: Duration::from_secs_f64(args.rdzv_join_timeout),
        grace: Duration::from_secs_f64(args.grace_secs),
        threads_per_rank: args.threads_per_rank.map(|t| t as usize),
        prefix_output: !args.no_prefix,
        rank0_stderr_direct: args.rank0_stderr_direct,
        job_token: None,
        forward_signals: true,
        extra_env: Vec::new(),
        max_restarts: args.max_restarts as usize,
        live_recovery: args.recover == Recover::Live,
        emulate_gpu_hosts: args.emulate_gpu_hosts,
        trace: args.trace,
        hang_after: args.hang_after.map(Duration::from_secs_f64),
        straggler_factor: args.straggler_factor,
        dump_on_hang: args.dump_on_hang,
    };
    let (program, rest) = args
        .command
        .split_first()
        .expect("clap requires at least the program");
    match launch(&cfg, program, rest) {
        Ok(report) => {
            if let Some(line) = report.summary() {
                eprintln!("{line}");
            } else if cfg.nnodes > 1 && report.attempt > 0 {
                eprintln!(
                    "ddprun: every rank of the job exited 0 in round {} (rounds counted from 0)",
                    report.attempt
                );
            } else if !report.replaced.is_empty() {
                eprintln!(
                    "ddprun: all {} ranks exited 0; {} lost rank(s) replaced while the others ran",
                    report.exits.len(),
                    report.replaced.len()
                );
            } else if report.attempt > 0 {
                eprintln!(
                    "ddprun: all {} ranks exited 0 on restart {} of {}",
                    report.exits.len(),
                    report.attempt,
                    args.max_restarts
                );
            }
            ExitCode::from((report.exit_code() & 0xff) as u8)
        }
        Err(e) => {
            // The rendezvous' own lines already start with `ddprun: `.
            let text = e.to_string();
            if text.starts_with("ddprun: ") {
                eprintln!("{text}");
            } else {
                eprintln!("ddprun: error: {text}");
            }
            let code = match &e {
                LaunchError::Rendezvous(r) => r.exit_code(),
                // The shell's conventions for a command that cannot run.
                LaunchError::Spawn { source, .. }
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    127
                }
                LaunchError::Spawn { .. } => 126,
                _ => 1,
            };
            ExitCode::from((code & 0xff) as u8)
        }
    }
}

/// `--merge-trace DIR`: merges the rank files of `DIR` into `DIR/trace.json` (expecting ranks
/// `0..world` when `world` > 1, else every rank up to the highest found).
fn merge_trace(dir: &std::path::Path, world: usize) -> ExitCode {
    let expected: Vec<usize> = if world > 1 {
        (0..world).collect()
    } else {
        Vec::new()
    };
    match ddp_trace::merge_dir(dir, &expected) {
        Ok(s) => {
            for (path, why) in &s.unreadable {
                eprintln!("ddprun: left out {}: {why}", path.display());
            }
            eprintln!("ddprun: {s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ddprun: error: {e}");
            ExitCode::from(1)
        }
    }
}
