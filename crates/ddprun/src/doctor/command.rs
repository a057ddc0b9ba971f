//! `ddprun doctor DIR`: reads a dump (or a folder of dumps) and prints where every rank was
//! and the verdict, as the launcher would have.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use ddp_doctor::RankSnapshot;
use ddp_doctor::verdict::{self, Thresholds};

/// Prints the ranks and the verdict of the dump(s) under `dir`, judged as at the dump's time
/// with a hang threshold of `hang_after`.
pub fn run(dir: &Path, hang_after: Duration, straggler_factor: f64) -> ExitCode {
    let snapshots = match ddp_doctor::dump::read(dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ddprun doctor: {e}");
            return ExitCode::from(2);
        }
    };
    for line in report(&snapshots, hang_after, straggler_factor) {
        println!("{line}");
    }
    ExitCode::SUCCESS
}

/// The lines `ddprun doctor` prints for `snapshots`.
pub fn report(
    snapshots: &[RankSnapshot],
    hang_after: Duration,
    straggler_factor: f64,
) -> Vec<String> {
    // The dump's time: the launcher's last look at any rank, else the newest report.
    let at = snapshots
        .iter()
        .map(|s| {
            s.observed
                .as_ref()
                .map_or(s.written_ms, |o| o.seen_ms.max(s.written_ms))
        })
        .fold(0.0, f64::max);
    let world = snapshots.iter().map(|s| s.rank + 1).max().unwrap_or(0);
    let limits = Thresholds {
        hang_after,
        silent_after: super::silent_after(),
        straggler_factor,
    };
    let mut lines = vec![format!("{} rank(s); as of the dump:", snapshots.len())];
    for s in snapshots {
        let mut line = match s.waiting_in() {
            Some(c) => format!(
                "rank {}: in {} for {:.1} s",
                s.rank,
                c.describe(),
                (at - c.issued_ms) / 1e3
            ),
            None => format!(
                "rank {}: in phase {} of step {} for {:.1} s",
                s.rank,
                s.phase,
                s.step,
                (at - s.phase_since_ms).max(0.0) / 1e3
            ),
        };
        if let Some(o) = &s.observed {
            line.push_str(&format!(" (process {})", o.process));
            let frames = verdict::own_frames(&o.stack);
            if !frames.is_empty() {
                line.push_str(&format!(", at {}", frames.join(" ← ")));
            }
        }
        lines.push(line);
    }
    match verdict::hang(snapshots, world, at, &limits) {
        Some(h) => lines.push(format!("verdict: {h}")),
        None => lines.push(format!(
            "verdict: no hang (a collective finished within {:.0} s of the dump, or no rank waits in one)",
            hang_after.as_secs_f64()
        )),
    }
    for s in verdict::stragglers(snapshots, &limits) {
        lines.push(format!("verdict: {s}"));
    }
    lines
}
