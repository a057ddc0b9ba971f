//! The thread that publishes a rank's recorder to its launcher: when `DDP_PROGRESS_FILE` names a
//! file (the launcher sets it), the recorder's snapshot is written there a few times a second,
//! each time whole (a temporary file renamed over it), so the launcher never reads half of one.
//!
//! The thread runs beside the training loop: a rank blocked in a collective, a data loader or a
//! deadlock of its own still publishes where it is. Only a stopped or frozen process goes
//! silent, which the launcher sees as the file's age.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::recorder;

/// The file a rank publishes its progress to (set by the launcher; unset: nothing published).
pub const PROGRESS_FILE_VAR: &str = "DDP_PROGRESS_FILE";
/// How often, in milliseconds (default [`DEFAULT_INTERVAL`]).
pub const PROGRESS_INTERVAL_VAR: &str = "DDP_PROGRESS_MS";
/// The default interval between two publications.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(500);

/// The interval `DDP_PROGRESS_MS` asks for (10 ms to 60 s), else the default.
pub fn interval() -> Duration {
    std::env::var(PROGRESS_INTERVAL_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_INTERVAL, |ms| {
            Duration::from_millis(ms.clamp(10, 60_000))
        })
}

/// Starts the recorder and, when the launcher set `DDP_PROGRESS_FILE`, the publishing thread
/// (once per process; later calls do nothing). `ddp-comm` calls it when a process group
/// forms, so a rank stuck before its first collective still reports where it is.
pub fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if recorder::enabled() {
        STARTED.call_once(start_if_asked);
    }
}

fn start_if_asked() {
    let Some(path) = std::env::var_os(PROGRESS_FILE_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    let path = PathBuf::from(path);
    let rank = std::env::var("RANK")
        .ok()
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0);
    let every = interval();
    let spawned = std::thread::Builder::new()
        .name("ddp-progress".into())
        .spawn(move || publish_forever(&path, rank, every));
    if let Err(e) = spawned {
        tracing::warn!("cannot start the progress publisher: {e}; the launcher sees no progress");
    }
}

fn publish_forever(path: &Path, rank: usize, every: Duration) {
    let mut warned = false;
    loop {
        // At once the first time: a rank stopped early still left a report.
        match publish(path, rank) {
            Ok(()) => warned = false,
            Err(e) if !warned => {
                warned = true;
                tracing::warn!("cannot publish progress to {}: {e}", path.display());
            }
            Err(_) => {}
        }
        std::thread::sleep(every);
    }
}

/// Writes this process's snapshot as global rank `rank` to `path`, whole (write, then rename).
pub fn publish(path: &Path, rank: usize) -> std::io::Result<()> {
    let snapshot = recorder::snapshot(rank);
    let json = serde_json::to_vec(&snapshot).map_err(std::io::Error::other)?;
    // A file of this process's own (a child that inherited the variable writes its own).
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}
