//! `ddp_worker --scenario live` on 3 ranks (or as many as asked) under `ddprun --recover live --max-restarts K`: the
//! live-recovery jobs of the fault tests (CPU ranks) and of the CUDA tests (NCCL), one command.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// ddprun's options for ranks of which a lost one is replaced live (add `--nproc-per-node` and
/// `--max-restarts`).
pub const LIVE: &[&str] = &["--recover", "live"];

/// What a live job adds to the command and the ranks' variables.
#[derive(Default)]
pub struct Setup<'a> {
    /// More ddprun options (before `--`).
    pub launcher: &'a [&'a str],
    /// `--max-restarts` (1 when unset).
    pub max_restarts: Option<&'a str>,
    /// `--nproc-per-node` (3 when unset).
    pub nproc: Option<&'a str>,
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
    let ended = run_any(dir, steps, extra, setup, limit);
    assert!(
        ended.status.success(),
        "{extra:?}: {}\n{}",
        ended.status,
        ended.all
    );
    (ended.stdout, ended.all)
}

/// How a live job ended.
#[allow(dead_code)] // each test binary that includes this module uses a part of it
pub struct Ended {
    /// ddprun's exit status.
    pub status: std::process::ExitStatus,
    /// Its stdout (the ranks' lines).
    pub stdout: String,
    /// Everything it printed.
    pub all: String,
    /// From its start to its end.
    pub after: Duration,
}

/// [`run`], whatever the job's outcome.
pub fn run_any(
    dir: &Path,
    steps: &str,
    extra: &[&str],
    setup: &Setup<'_>,
    limit: Duration,
) -> Ended {
    let worker = ddp_testkit::bundled(env!("CARGO_BIN_EXE_ddp_worker"));
    let ddprun = worker.with_file_name("ddprun");
    let mut cmd = Command::new(&ddprun);
    cmd.args(LIVE)
        .args(["--nproc-per-node", setup.nproc.unwrap_or("3")])
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
    Ended {
        status: ended.status,
        stdout: ended.stdout,
        all,
        after: ended.after,
    }
}
