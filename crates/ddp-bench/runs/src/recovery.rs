//! `cargo xtask bench recovery`: what a lost rank costs, live recovery against today's restart
//! and reload, the same train-cnn job in the same run.
//!
//! Launches of `ddprun -- train-cnn` (release builds): the job uninterrupted, without and
//! with `--recover live` (what train-cnn's `LiveTraining` keeps at every step while nothing
//! fails: the step's start, every rank's buffers, the step's sums); the job with
//! rank 1 SIGKILLed at a fixed moment and `--recover live` (the survivors hand a replacement
//! their state from memory and redo one step); the same with a second fault during the
//! recovery (the replacement itself SIGKILLed `--second-kill-after-ms` after it started, while
//! it joins the re-forming group: the dead generation is given up and a second replacement
//! joins, `--max-restarts 2`); and the job killed at the same moment under `--max-restarts 1`
//! (every rank stopped and started again, the last epoch's checkpoint read, the epoch's
//! finished steps done again). Then the same job on **two launchers** (emulated hosts, half
//! the ranks each, `--nnodes 2:3 --recover live`): never killed, and with node 1's launcher
//! SIGKILLed (its ranks with it) while a third launcher waits as a spare, which takes the lost
//! node over live. Then **burn-train's `Learner`** (train-learner): never killed, and with
//! rank 1 SIGKILLed after the first epoch's checkpoint under `--max-restarts 1` (the job
//! restarts and every rank resumes after the last whole checkpoint). Each is repeated `repeats`
//! times; the table gives the median wall time and the time lost against the median of its
//! own never-killed row, next to the job's mean step time. A run is checked to have exited 0
//! and recovered the way it was meant to (a replacement and no restart, a spare's take-over,
//! or a restart) from ddprun's own lines; that the recovered runs end with the uninterrupted
//! run's parameters is the tests' job (train-cnn
//! `restart::a_rank_replaced_live_ends_bitwise_as_the_run_never_killed`, ddp-tests
//! `second_faults::a_lost_host_is_replaced_live_by_a_spare_launcher`, train-learner
//! `restart::a_learner_job_that_loses_a_rank_resumes_from_its_checkpoint_bitwise`).

use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use cargo_tasks::{cargo, run, target_dir, workspace_root};

/// The settings of one `bench recovery` (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct RecoveryRuns {
    /// Ranks of the job (rank 1 is killed).
    #[arg(long, default_value_t = 2)]
    pub nproc: u32,
    /// Epochs; the kill falls in the second.
    #[arg(long, default_value_t = 3)]
    pub epochs: usize,
    /// Synthetic training images; the steps per epoch are this ÷ (ranks × batch).
    #[arg(long, default_value_t = 8000)]
    pub train_size: usize,
    /// Images per rank and step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Milliseconds after the first epoch's checkpoint at which rank 1 is killed.
    #[arg(long, default_value_t = 500)]
    pub kill_after_ms: u64,
    /// The second fault's row: milliseconds after its start at which rank 1's first
    /// replacement is killed too.
    #[arg(long, default_value_t = 50)]
    pub second_kill_after_ms: u64,
    /// Launches of each kind (the median is shown).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The `Learner` rows: train-learner's training points (its steps take well under a
    /// millisecond: enough points for epochs of a few seconds).
    #[arg(long, default_value_t = 400_000)]
    pub learner_train_size: usize,
    /// The `Learner` rows: points per rank and step.
    #[arg(long, default_value_t = 32)]
    pub learner_batch: usize,
}

/// The longest one launch may take (the default job takes about 8 s).
const LAUNCH_DEADLINE: Duration = Duration::from_secs(600);

/// How a launch recovers from the kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Uninterrupted,
    UninterruptedLive,
    Live,
    LiveSecondKill,
    Restart,
    TwoNodes,
    SpareHost,
    Learner,
    LearnerRestart,
}

/// Every kind, in the table's order.
const KINDS: [Kind; 9] = [
    Kind::Uninterrupted,
    Kind::UninterruptedLive,
    Kind::Live,
    Kind::LiveSecondKill,
    Kind::Restart,
    Kind::TwoNodes,
    Kind::SpareHost,
    Kind::Learner,
    Kind::LearnerRestart,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Uninterrupted => "never killed",
            Kind::UninterruptedLive => "never killed, under --recover live",
            Kind::Live => "live recovery (--recover live)",
            Kind::LiveSecondKill => {
                "live recovery, the replacement killed too (--recover live --max-restarts 2)"
            }
            Kind::Restart => "restart and reload (--max-restarts 1)",
            Kind::TwoNodes => "two launchers, never killed (--nnodes 2:3 --recover live)",
            Kind::SpareHost => {
                "two launchers, node 1's launcher killed, a spare takes it over live"
            }
            Kind::Learner => "burn-train Learner (train-learner), never killed",
            Kind::LearnerRestart => {
                "burn-train Learner, rank 1 killed, restart from its checkpoint (--max-restarts 1)"
            }
        }
    }

    /// The never-killed row a row's loss is measured against.
    fn baseline(self) -> Kind {
        match self {
            Kind::TwoNodes | Kind::SpareHost => Kind::TwoNodes,
            Kind::Learner | Kind::LearnerRestart => Kind::Learner,
            _ => Kind::Uninterrupted,
        }
    }
}

/// Rank 1 of the first start (neither a replacement nor a restarted attempt) kills itself with
/// SIGKILL `$KILL_AFTER_MS` after the first checkpoint exists (looked for every 50 ms: a
/// tighter loop of `sleep` processes took a core's share from the ranks, 1.1 s of a 2.5 s epoch
/// on 2 cores); with `$SECOND_KILL_AFTER_MS`, rank 1's first replacement (the one that makes
/// the folder `$SECOND_MARK`) kills itself that long after its start; every other process just
/// runs.
const KILL_RANK_1: &str = r#"
if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" = 0 ] && [ "$DDP_REJOIN" != 1 ] && [ -n "$KILL_AFTER_MS" ]; then
  ( while [ ! -f "$CHECKPOINT" ]; do sleep 0.05; done
    sleep "$(awk "BEGIN { print $KILL_AFTER_MS / 1000 }")"
    kill -9 $$ ) &
fi
if [ "$RANK" = 1 ] && [ "$DDP_REJOIN" = 1 ] && [ -n "$SECOND_KILL_AFTER_MS" ] && mkdir "$SECOND_MARK" 2>/dev/null; then
  ( sleep "$(awk "BEGIN { print $SECOND_KILL_AFTER_MS / 1000 }")"
    kill -9 $$ ) &
fi
exec "$@"
"#;

/// The first rank of node 1 (`$NODE1_FIRST_RANK`), not a replacement, SIGKILLs its launcher
/// (its parent: `$PPID` of this shell) `$KILL_AFTER_MS` after the first checkpoint exists and
/// the spare launcher waits (`$SPARE_READY` made by the bench); every rank of node 1 dies with
/// it (their parent-death signal). The watchers give up after the launch's deadline.
const KILL_HOST_1: &str = r#"
if [ "$RANK" = "$NODE1_FIRST_RANK" ] && [ "$DDP_REJOIN" != 1 ] && [ -n "$KILL_AFTER_MS" ]; then
  ( i=0; while [ ! -f "$CHECKPOINT" ] || [ ! -f "$SPARE_READY" ]; do
      i=$((i + 1)); [ $i -gt 12000 ] && exit 0; sleep 0.05; done
    sleep "$(awk "BEGIN { print $KILL_AFTER_MS / 1000 }")"
    kill -9 $PPID ) &
fi
exec "$@"
"#;

/// train-learner's rank 1 of the first attempt SIGKILLs itself `$KILL_AFTER_MS` after rank
/// 0's checkpoint of epoch 1 is whole (its scheduler file, the last of three, in place).
const KILL_LEARNER_RANK_1: &str = r#"
if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" = 0 ] && [ -n "$KILL_AFTER_MS" ]; then
  ( i=0; while [ ! -f "$OUT/checkpoint/scheduler-1.bpk" ]; do
      i=$((i + 1)); [ $i -gt 12000 ] && exit 0; sleep 0.05; done
    sleep "$(awk "BEGIN { print $KILL_AFTER_MS / 1000 }")"
    kill -9 $$ ) &
fi
exec "$@"
"#;

/// Builds train-cnn and ddprun in release, runs every launch and prints the table.
///
/// # Errors
/// A failed build, a launch that failed, or one that did not recover as its kind says.
pub fn run_recovery(r: &RecoveryRuns) -> Result<(), String> {
    if r.nproc < 2 || !r.nproc.is_multiple_of(2) || r.epochs < 2 || r.repeats == 0 {
        return Err(
            "bench recovery needs an even --nproc ≥ 2 (the two-launcher rows split it), \
             --epochs ≥ 2 and --repeats ≥ 1"
                .into(),
        );
    }
    let root = workspace_root();
    run(cargo().current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "train-cnn",
        "-p",
        "train-learner",
        "-p",
        "ddprun",
    ]))?;
    let release = target_dir(&root).join("release");
    let work = target_dir(&root).join("bench-recovery");
    match std::fs::remove_dir_all(&work) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot clear {}: {e}", work.display()));
        }
        _ => {}
    }
    let mut rows = Vec::new();
    for kind in KINDS {
        let mut secs = Vec::new();
        for i in 0..r.repeats {
            let out = work.join(format!("{kind:?}-{i}"));
            secs.push(match kind {
                Kind::TwoNodes | Kind::SpareHost => launch_on_nodes(r, &release, kind, &out)?,
                Kind::Learner | Kind::LearnerRestart => launch_learner(r, &release, kind, &out)?,
                _ => launch(r, &release, kind, &out)?,
            });
        }
        rows.push((kind, median(&mut secs)));
    }
    print!("{}", table(r, &rows));
    Ok(())
}

/// The steps of `kind`'s job (train-cnn's, or train-learner's for the `Learner` rows).
fn steps_of(r: &RecoveryRuns, kind: Kind) -> usize {
    match kind.baseline() {
        Kind::Learner => {
            r.epochs
                * r.learner_train_size
                    .div_ceil(r.nproc as usize)
                    .div_ceil(r.learner_batch)
        }
        _ => r.epochs * (r.train_size.div_ceil(r.nproc as usize) / r.batch),
    }
}

/// train-cnn's arguments in every row, its output to `out`.
fn train_cnn_args(r: &RecoveryRuns, out: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "--train-size",
        &r.train_size.to_string(),
        "--eval-size",
        "200",
        "--batch-size",
        &r.batch.to_string(),
        "--channels",
        "8,16,16",
        "--sync-bn",
        "--no-progress",
        "--quiet",
        "--epochs",
        &r.epochs.to_string(),
        "--out",
    ]
    .iter()
    .map(Into::into)
    .collect();
    args.push(out.into());
    args
}

/// Launchers of one launch: killed and reaped when dropped, whichever way the launch ends (their
/// ranks die with them: they have their launcher's parent-death signal). Killing one already
/// reaped does nothing.
struct Launchers(Vec<Child>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `cmd` with its output into `log_path` (no pipe to drain while waiting).
fn start(cmd: &mut Command, log_path: &Path) -> Result<Child, String> {
    let log =
        std::fs::File::create(log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log2 = log
        .try_clone()
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    cmd.stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))
}

/// Waits for every child until [`LAUNCH_DEADLINE`] after `start`, past which all are killed
/// (their ranks die with them: they have their launcher's parent-death signal).
fn wait_all(
    children: &mut [Child],
    start: Instant,
    kind: Kind,
    logs: &Path,
) -> Result<Vec<ExitStatus>, String> {
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(statuses.iter_mut()) {
            if status.is_none() {
                *status = child
                    .try_wait()
                    .map_err(|e| format!("{}: waiting for ddprun: {e}", kind.name()))?;
            }
        }
        if start.elapsed() > LAUNCH_DEADLINE {
            for child in children.iter_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(format!(
                "{}: still running after {LAUNCH_DEADLINE:?}; killed (output in {})",
                kind.name(),
                logs.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(statuses.into_iter().flatten().collect())
}

/// A free TCP port on the loopback interface (for the two-launcher rows' rendezvous).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on 127.0.0.1: {e}"))
}

/// A fresh job token (32 random bytes, hex) for the two-launcher rows.
fn job_token() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?,
        &mut bytes,
    )
    .map_err(|e| format!("/dev/urandom: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// One launch of a two-launcher row: nodes 0 and 1 of `nproc / 2` ranks each (emulated hosts,
/// `--nnodes 2:3 --recover live`); for [`Kind::SpareHost`] a third launcher joins as a spare
/// once the first checkpoint exists, and node 1's launcher is killed `kill_after_ms` later.
/// The wall time until every launcher still there exited, in seconds.
fn launch_on_nodes(
    r: &RecoveryRuns,
    release: &Path,
    kind: Kind,
    out: &Path,
) -> Result<f64, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let per_node = r.nproc / 2;
    let (port, token) = (free_port()?.to_string(), job_token()?);
    let spare_ready = out.join("spare-ready");
    let node = |n: usize| {
        let mut cmd = Command::new(release.join("ddprun"));
        cmd.args(["--nnodes", "2:3", "--node-rank", &n.to_string()])
            .args(["--nproc-per-node", &per_node.to_string(), "--no-prefix"])
            .args(["--master-port", &port, "--rdzv-last-call", "1"])
            .args(["--recover", "live", "--max-restarts", &per_node.to_string()])
            .args(["--", "sh", "-c", KILL_HOST_1, "sh"])
            .arg(release.join("train-cnn"))
            .args(train_cnn_args(r, out))
            .env("DDP_JOB_TOKEN", &token)
            .env("DDP_HOST_ID", format!("bench-host-{n}"))
            .env("NODE1_FIRST_RANK", per_node.to_string())
            .env("CHECKPOINT", out.join("checkpoint.bin"))
            .env("SPARE_READY", &spare_ready)
            .env("RAYON_NUM_THREADS", "1");
        if kind == Kind::SpareHost {
            cmd.env("KILL_AFTER_MS", r.kill_after_ms.to_string());
        }
        cmd
    };
    eprintln!("bench recovery: {}", kind.name());
    let started = Instant::now();
    let mut children = Launchers(Vec::new());
    for n in 0..2 {
        children
            .0
            .push(start(&mut node(n), &out.join(format!("ddprun-{n}.log")))?);
    }
    if kind == Kind::SpareHost {
        let checkpoint = out.join("checkpoint.bin");
        while !checkpoint.exists() {
            if started.elapsed() > LAUNCH_DEADLINE {
                return Err(format!(
                    "{}: no checkpoint within {LAUNCH_DEADLINE:?}",
                    kind.name()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        children
            .0
            .push(start(&mut node(2), &out.join("ddprun-2.log"))?);
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&spare_ready, b"").map_err(|e| format!("{}: {e}", spare_ready.display()))?;
    }
    let statuses = wait_all(&mut children.0, started, kind, out)?;
    let secs = started.elapsed().as_secs_f64();
    let mut logs = String::new();
    for n in 0..children.0.len() {
        let path = out.join(format!("ddprun-{n}.log"));
        logs += &std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    // Node 1's launcher is killed in the spare's row; every other launcher must exit 0.
    let killed = kind == Kind::SpareHost;
    let ok = statuses
        .iter()
        .enumerate()
        .all(|(n, s)| s.success() || (killed && n == 1));
    let handed = logs.contains("replaced live on");
    let restarted = logs.contains("restarting the group");
    if !ok || restarted || handed != killed {
        return Err(format!(
            "{}: exits {statuses:?}, taken over by the spare: {handed}, restarted: {restarted}:\n{logs}",
            kind.name()
        ));
    }
    Ok(secs)
}

/// One launch of a `Learner` row: train-learner on `nproc` ranks under `--max-restarts 1`,
/// rank 1 killed after the first checkpoint in [`Kind::LearnerRestart`]. Its wall time in
/// seconds.
fn launch_learner(r: &RecoveryRuns, release: &Path, kind: Kind, out: &Path) -> Result<f64, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut cmd = Command::new(release.join("ddprun"));
    cmd.args(["--nproc-per-node", &r.nproc.to_string(), "--no-prefix"])
        .args(["--max-restarts", "1", "--"])
        .args(["sh", "-c", KILL_LEARNER_RANK_1, "sh"])
        .arg(release.join("train-learner"))
        .args(["--epochs", &r.epochs.to_string()])
        .args(["--train-size", &r.learner_train_size.to_string()])
        .args(["--batch-size", &r.learner_batch.to_string(), "--out"])
        .arg(out)
        .env("OUT", out)
        .env("RAYON_NUM_THREADS", "1");
    if kind == Kind::LearnerRestart {
        cmd.env("KILL_AFTER_MS", r.kill_after_ms.to_string());
    }
    eprintln!("bench recovery: {}", kind.name());
    let log_path = out.join("ddprun.log");
    let started = Instant::now();
    let mut children = Launchers(vec![start(&mut cmd, &log_path)?]);
    let statuses = wait_all(&mut children.0, started, kind, out)?;
    let secs = started.elapsed().as_secs_f64();
    let log =
        std::fs::read_to_string(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let resumed = log.contains("restarted, resuming after epoch");
    let restarted = log.contains("restarting the group");
    let as_meant = if kind == Kind::LearnerRestart {
        resumed && restarted
    } else {
        !resumed && !restarted
    };
    if !statuses[0].success() || !as_meant {
        return Err(format!(
            "{} ({}): restarted {restarted}, resumed {resumed}:\n{log}",
            kind.name(),
            statuses[0]
        ));
    }
    Ok(secs)
}

/// One launch of a one-launcher train-cnn row; its wall time in seconds.
fn launch(r: &RecoveryRuns, release: &Path, kind: Kind, out: &Path) -> Result<f64, String> {
    let mut cmd = Command::new(release.join("ddprun"));
    cmd.args(["--nproc-per-node", &r.nproc.to_string(), "--no-prefix"]);
    match kind {
        Kind::UninterruptedLive | Kind::Live => {
            cmd.args(["--recover", "live", "--max-restarts", "1"]);
        }
        Kind::LiveSecondKill => {
            cmd.args(["--recover", "live", "--max-restarts", "2"]);
            cmd.env("SECOND_KILL_AFTER_MS", r.second_kill_after_ms.to_string())
                .env("SECOND_MARK", out.join("second-kill"));
        }
        Kind::Restart => {
            cmd.args(["--max-restarts", "1"]);
        }
        _ => {}
    }
    cmd.args(["--", "sh", "-c", KILL_RANK_1, "sh"])
        .arg(release.join("train-cnn"))
        .args(train_cnn_args(r, out))
        .env("CHECKPOINT", out.join("checkpoint.bin"))
        .env("RAYON_NUM_THREADS", "1");
    if !matches!(kind, Kind::Uninterrupted | Kind::UninterruptedLive) {
        cmd.env("KILL_AFTER_MS", r.kill_after_ms.to_string());
    }
    eprintln!("bench recovery: {}", kind.name());
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let log_path = out.join("ddprun.log");
    let started = Instant::now();
    let mut children = Launchers(vec![start(&mut cmd, &log_path)?]);
    let status = wait_all(&mut children.0, started, kind, out)?[0];
    let secs = started.elapsed().as_secs_f64();
    let stderr =
        std::fs::read_to_string(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status}):\n{stderr}", kind.name()));
    }
    let replaced = stderr.matches("started a replacement for rank 1").count();
    let restarted = stderr.contains("restarting the group");
    let as_meant = match kind {
        Kind::Live => replaced == 1 && !restarted,
        Kind::LiveSecondKill => replaced == 2 && !restarted,
        Kind::Restart => restarted && replaced == 0,
        _ => replaced == 0 && !restarted,
    };
    if !as_meant {
        return Err(format!(
            "{}: ddprun's lines do not show it (replacements: {replaced}, restarted: {restarted}):\n{stderr}",
            kind.name()
        ));
    }
    Ok(secs)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The markdown table: median wall time per kind, time lost against the median of the kind's
/// never-killed row, and that loss in mean steps of that row's job.
fn table(r: &RecoveryRuns, rows: &[(Kind, f64)]) -> String {
    let median_of = |kind: Kind| {
        rows.iter()
            .find(|(k, _)| *k == kind)
            .map_or(f64::NAN, |(_, s)| *s)
    };
    let step_of = |kind: Kind| median_of(kind.baseline()) / steps_of(r, kind) as f64;
    let steps = steps_of(r, Kind::Uninterrupted);
    let mut s = format!(
        "\n## A lost rank: live recovery vs restart and reload (train-cnn, {} CPU ranks, \
         SyncBatchNorm, {} epochs of {} steps, a checkpoint per epoch; rank 1 SIGKILLed {} ms \
         after the first checkpoint, and in the second fault's row its replacement {} ms after \
         its start; medians of {} launches)\n\n",
        r.nproc,
        r.epochs,
        steps / r.epochs,
        r.kill_after_ms,
        r.second_kill_after_ms,
        r.repeats
    );
    s += "| run | wall time, s | lost vs its never-killed row, s | lost, in mean steps |\n";
    s += "|---|---:|---:|---:|\n";
    for &(kind, secs) in rows {
        let lost = secs - median_of(kind.baseline());
        s += &format!(
            "| {} | {secs:.2} | {lost:+.2} | {:+.0} |\n",
            kind.name(),
            lost / step_of(kind)
        );
    }
    s += &format!(
        "\nMean step (a never-killed row's wall time ÷ its steps, start-up included): train-cnn \
         on one launcher {:.1} ms ({steps} steps), on two launchers {:.1} ms; train-learner \
         {:.1} ms ({} steps of {} points per rank).\n",
        step_of(Kind::Uninterrupted) * 1e3,
        step_of(Kind::TwoNodes) * 1e3,
        step_of(Kind::Learner) * 1e3,
        steps_of(r, Kind::Learner),
        r.learner_batch
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_each_kind_its_loss_against_the_uninterrupted_median() {
        let r = RecoveryRuns {
            nproc: 2,
            epochs: 2,
            train_size: 4000,
            batch: 16,
            kill_after_ms: 300,
            second_kill_after_ms: 50,
            repeats: 3,
            learner_train_size: 4000,
            learner_batch: 20,
        };
        let t = table(
            &r,
            &[
                (Kind::Uninterrupted, 10.0),
                (Kind::Live, 10.5),
                (Kind::Restart, 12.0),
                (Kind::TwoNodes, 20.0),
                (Kind::SpareHost, 21.0),
                (Kind::Learner, 5.0),
                (Kind::LearnerRestart, 6.0),
            ],
        );
        assert!(t.contains("| never killed | 10.00 | +0.00 | +0 |"), "{t}");
        assert!(
            t.contains("| live recovery (--recover live) | 10.50 | +0.50 | +12 |"),
            "{t}"
        );
        assert!(
            t.contains("| restart and reload (--max-restarts 1) | 12.00 | +2.00 | +50 |"),
            "{t}"
        );
        assert!(t.contains("2 epochs of 125 steps"), "{t}");
        // Each row against its own never-killed row: 20 s over 250 steps, 5 s over 200.
        assert!(
            t.contains("a spare takes it over live | 21.00 | +1.00 | +12 |"),
            "{t}"
        );
        assert!(
            t.contains("restart from its checkpoint (--max-restarts 1) | 6.00 | +1.00 | +40 |"),
            "{t}"
        );
        assert!(t.contains("40.0 ms"), "{t}");
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }
}
