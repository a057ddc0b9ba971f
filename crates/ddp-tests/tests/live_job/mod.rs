//! `ddp_worker --scenario live` on 3 ranks under `ddprun --recover live --max-restarts K`: the
//! live-recovery jobs of the fault tests (CPU ranks) and of the CUDA tests (NCCL), one command.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// ddprun's options for 3 ranks of which a lost one is replaced live (add `--max-restarts`).
pub const LIVE_3_RANKS: &[&str] = &["--nproc-per-node", "3", "--recover", "live"];

/// What a live job adds to the command and the ranks' variables.
#[derive(Default)]
pub struct Setup<'a> {
    /// More ddprun options (before `--`).
    pub launcher: &'a [&'a str],
    /// `--max-restarts` (1 when unset).
    pub max_restarts: Option<&'a str>,
    /// What starts the worker (a shell wrapper and its arguments), if anything.
    pub wrapper: &'a [&'a str],
    /// More worker arguments.
    pub worker: &'a [&'a str],
    /// Variables for every rank.
    pub env: &'a [(&'a str, &'a str)],
}

/// Runs the job of `steps` steps writing into `dir`, with the worker arguments `extra` (a
/// victim, when to kill it), within `limit`; checks that it exited 0 and returns its stdout
/// and everything it printed.
pub fn run(
    dir: &Path,
    steps: &str,
    extra: &[&str],
    setup: &Setup<'_>,
    limit: Duration,
) -> (String, String) {
    let worker = ddp_testkit::bundled(env!("CARGO_BIN_EXE_ddp_worker"));
    let ddprun = worker.with_file_name("ddprun");
    let mut cmd = Command::new(&ddprun);
    cmd.args(LIVE_3_RANKS)
        .args(["--max-restarts", setup.max_restarts.unwrap_or("1")])
        .args(setup.launcher)
        .arg("--")
        .args(setup.wrapper)
        .arg(&worker)
        .args(["--scenario", "live", "--steps", steps])
        .args(setup.worker)
        .arg("--out")
        .arg(dir)
        .args(extra)
        .envs(setup.env.iter().copied());
    let ended = ddp_testkit::Launched::spawn(&mut cmd)
        .expect("start ddprun")
        .wait_until(Instant::now() + limit);
    let all = format!("{}\n{}", ended.stdout, ended.stderr);
    assert!(ended.status.success(), "{extra:?}: {}\n{all}", ended.status);
    (ended.stdout, all)
}
