//! `cargo xtask bench recovery`: what a lost rank costs, live recovery against today's restart
//! and reload, the same train-cnn job in the same run.
//!
//! Five launches of `ddprun -- train-cnn` (release builds): the job uninterrupted, without and
//! with `--recover live` (what train-cnn's `LiveTraining` keeps at every step while nothing
//! fails: the step's start, every rank's buffers, the step's sums); the job with
//! rank 1 SIGKILLed at a fixed moment and `--recover live` (the survivors hand a replacement
//! their state from memory and redo one step); the same with a second fault during the
//! recovery (the replacement itself SIGKILLed `--second-kill-after-ms` after it started, while
//! it joins the re-forming group: the dead generation is given up and a second replacement
//! joins, `--max-restarts 2`); and the job killed at the same moment under `--max-restarts 1`
//! (every rank stopped and started again, the last epoch's checkpoint read, the epoch's
//! finished steps done again). Each is repeated `repeats` times; the table gives the
//! median wall time and the time lost against the uninterrupted median, next to the job's mean
//! step time. A run is checked to have exited 0 and recovered the way it was meant to (a
//! replacement and no restart, or a restart) from ddprun's own lines; that the recovered runs
//! end with the uninterrupted run's parameters is train-cnn's tests' job
//! (`restart::a_rank_replaced_live_ends_bitwise_as_the_run_never_killed`).

use std::path::Path;
use std::process::Command;
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
}

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

/// Builds train-cnn and ddprun in release, runs every launch and prints the table.
///
/// # Errors
/// A failed build, a launch that failed, or one that did not recover as its kind says.
pub fn run_recovery(r: &RecoveryRuns) -> Result<(), String> {
    if r.nproc < 2 || r.epochs < 2 || r.repeats == 0 {
        return Err("bench recovery needs --nproc ≥ 2, --epochs ≥ 2 and --repeats ≥ 1".into());
    }
    let root = workspace_root();
    run(cargo().current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "train-cnn",
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
    for kind in [
        Kind::Uninterrupted,
        Kind::UninterruptedLive,
        Kind::Live,
        Kind::LiveSecondKill,
        Kind::Restart,
    ] {
        let mut secs = Vec::new();
        for i in 0..r.repeats {
            let out = work.join(format!("{kind:?}-{i}"));
            secs.push(launch(r, &release, kind, &out)?);
        }
        rows.push((kind, median(&mut secs)));
    }
    let steps = r.epochs * (r.train_size.div_ceil(r.nproc as usize) / r.batch);
    print!("{}", table(r, &rows, steps));
    Ok(())
}

/// One launch of `kind`; its wall time in seconds.
fn launch(r: &RecoveryRuns, release: &Path, kind: Kind, out: &Path) -> Result<f64, String> {
    let mut cmd = Command::new(release.join("ddprun"));
    cmd.args(["--nproc-per-node", &r.nproc.to_string(), "--no-prefix"]);
    match kind {
        Kind::Uninterrupted => {}
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
    }
    cmd.args(["--", "sh", "-c", KILL_RANK_1, "sh"])
        .arg(release.join("train-cnn"))
        .args([
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
        ])
        .arg(out)
        .env("CHECKPOINT", out.join("checkpoint.bin"))
        .env("RAYON_NUM_THREADS", "1");
    if !matches!(kind, Kind::Uninterrupted | Kind::UninterruptedLive) {
        cmd.env("KILL_AFTER_MS", r.kill_after_ms.to_string());
    }
    eprintln!("bench recovery: {}", kind.name());
    // ddprun's output into a file (no pipe to drain while waiting); the launch has a deadline,
    // past which ddprun is killed (its ranks die with it: they have its parent-death signal).
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let log_path = out.join("ddprun.log");
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log2 = log
        .try_clone()
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    let start = Instant::now();
    let mut child = cmd
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > LAUNCH_DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{}: still running after {LAUNCH_DEADLINE:?}; killed (output in {})",
                    kind.name(),
                    log_path.display()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("{}: waiting for ddprun: {e}", kind.name())),
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let stderr =
        std::fs::read_to_string(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status}):\n{stderr}", kind.name()));
    }
    let replaced = stderr.matches("started a replacement for rank 1").count();
    let restarted = stderr.contains("restarting the group");
    let as_meant = match kind {
        Kind::Uninterrupted | Kind::UninterruptedLive => replaced == 0 && !restarted,
        Kind::Live => replaced == 1 && !restarted,
        Kind::LiveSecondKill => replaced == 2 && !restarted,
        Kind::Restart => restarted && replaced == 0,
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

/// The markdown table: median wall time per kind, time lost against the uninterrupted median,
/// and that loss in steps of the job.
fn table(r: &RecoveryRuns, rows: &[(Kind, f64)], steps: usize) -> String {
    let base = rows
        .iter()
        .find(|(k, _)| *k == Kind::Uninterrupted)
        .map_or(f64::NAN, |(_, s)| *s);
    let step = base / steps as f64;
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
    s += "| run | wall time, s | lost vs never killed, s | lost, in mean steps |\n";
    s += "|---|---:|---:|---:|\n";
    for (kind, secs) in rows {
        let lost = secs - base;
        s += &format!(
            "| {} | {secs:.2} | {lost:+.2} | {:+.0} |\n",
            kind.name(),
            lost / step
        );
    }
    s += &format!(
        "\nMean step of the uninterrupted job (its wall time ÷ its {steps} steps, start-up \
         included): {:.1} ms.\n",
        step * 1e3
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
        };
        let t = table(
            &r,
            &[
                (Kind::Uninterrupted, 10.0),
                (Kind::Live, 10.5),
                (Kind::Restart, 12.0),
            ],
            250,
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
        assert!(t.contains("40.0 ms"), "{t}");
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }
}
