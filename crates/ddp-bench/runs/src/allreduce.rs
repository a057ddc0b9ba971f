//! `cargo xtask bench allreduce`: `allreduce_bench` built in release and launched through
//! `ddprun` per transport and world size, or on emulated nodes (`--nodes KxL`: each node's
//! ranks share a host identity, so only cross-node traffic touches TCP).

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use cargo_tasks::run;

/// What `cargo xtask bench allreduce` runs.
#[derive(Debug, Clone, Default)]
pub struct AllreduceRuns {
    /// Ranks per run (without `nodes`).
    pub nprocs: Vec<u32>,
    /// Message sizes (`8K`, `25M`, …).
    pub sizes: Vec<String>,
    /// `shm` and/or `tcp` (without `nodes`).
    pub transports: Vec<String>,
    /// Wire formats (`none`, `bf16`, `fp16`).
    pub compression: Vec<String>,
    /// Collectives (`all-reduce`, `reduce-scatter`, `all-gather`), one table each.
    pub collectives: Vec<String>,
    /// Timed iterations per size (`None`: scaled to the size).
    pub iters: Option<usize>,
    /// Pin each rank to a core.
    pub pin: bool,
    /// Emulated node layouts `KxL` instead of `nprocs` × `transports`.
    pub nodes: Vec<String>,
}

/// Runs the all-reduce benchmark: `nprocs` ranks per transport, or the `nodes` layouts.
///
/// # Errors
/// An unknown transport or layout, a failed build or a failed run.
pub fn run_allreduce(runs: &AllreduceRuns) -> Result<(), String> {
    let AllreduceRuns {
        nprocs,
        sizes,
        transports,
        compression,
        collectives,
        iters,
        pin,
        nodes,
    } = runs;
    let layouts = nodes
        .iter()
        .map(|l| {
            l.split_once('x')
                .and_then(|(k, l)| Some((k.parse::<u32>().ok()?, l.parse::<u32>().ok()?)))
                .filter(|&(k, l)| k >= 1 && l >= 1)
                .ok_or_else(|| format!("--nodes {l:?}: expected KxL, e.g. 2x4"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    crate::check_transports(transports)?;
    let release = crate::build_with_ddprun("allreduce_bench", true)?;
    let ddprun = release.join("ddprun");
    let bench = release.join("allreduce_bench");
    let runs: Vec<(u32, &str, Option<u32>)> = if layouts.is_empty() {
        transports
            .iter()
            .flat_map(|t| nprocs.iter().map(move |&n| (n, t.as_str(), None)))
            .collect()
    } else {
        layouts
            .iter()
            .map(|&(k, l)| (k * l, "shm", Some(l)))
            .collect()
    };
    for (n, t, per_node) in runs {
        println!();
        let launch_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| e.to_string())?
            .as_nanos();
        let mut cmd = Command::new(&ddprun);
        cmd.arg("--nproc-per-node")
            .arg(n.to_string())
            .arg("--no-prefix")
            .arg("--");
        // `tcp`: every rank its own host identity, so that the ranks meet over TCP on
        // loopback (ranks of one host would meet over a Unix socket).
        let per_node = per_node.or((t == "tcp").then_some(1));
        if let Some(l) = per_node {
            // Host j holds ranks j·L … j·L + L − 1: each its own host identity.
            cmd.args([
                "sh",
                "-c",
                &format!("DDP_HOST_ID=emulated-node-$((RANK / {l})) exec \"$@\""),
                "sh",
            ]);
        }
        cmd.arg(&bench)
            .arg("--sizes")
            .arg(sizes.join(","))
            .arg("--transport")
            .arg(t)
            .arg("--compression")
            .arg(compression.join(","))
            .arg("--collectives")
            .arg(collectives.join(","))
            .env("DDP_BENCH_LAUNCH_NS", launch_ns.to_string());
        if let Some(i) = iters {
            cmd.arg("--iters").arg(i.to_string());
        }
        if *pin {
            cmd.arg("--pin");
        }
        run(&mut cmd)?;
    }
    Ok(())
}
