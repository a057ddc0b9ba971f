//! The launcher's side of [`ddp_trace`]: the trace directory of a launch, the ranks'
//! `DDP_TRACE`, and merging their files when the launch has ended.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{LaunchConfig, LaunchError};
use ddp_trace::{self as trace, MERGED_FILE, TRACE_VAR};

/// The trace directory: [`LaunchConfig::trace`], else `DDP_TRACE` in
/// [`LaunchConfig::extra_env`], else in our environment; made absolute (ranks may change
/// directory). `None`: no tracing.
pub(super) fn trace_dir(cfg: &LaunchConfig) -> Option<PathBuf> {
    let dir = cfg
        .trace
        .clone()
        .or_else(|| {
            cfg.extra_env
                .iter()
                .rev()
                .find(|(k, _)| k == TRACE_VAR)
                .map(|(_, v)| PathBuf::from(v))
        })
        .or_else(|| std::env::var_os(TRACE_VAR).map(PathBuf::from))
        .filter(|d| !d.as_os_str().is_empty())?;
    Some(std::path::absolute(&dir).unwrap_or(dir))
}

/// Before an attempt: creates the attempt's directory (the trace directory for attempt 0,
/// `DIR/attempt-<K>` after a restart, so that no attempt overwrites an earlier one's files),
/// removes this node's rank files of an earlier run there (and, on attempt 0, those of the
/// earlier run's restarts: a merge never shows a stale rank), and sets `DDP_TRACE` for the
/// ranks.
pub(super) fn prepare(
    dir: &Path,
    attempt: usize,
    ranks: std::ops::Range<usize>,
    env: &mut BTreeMap<String, String>,
) -> Result<(), LaunchError> {
    let here = match attempt {
        0 => dir.to_path_buf(),
        k => dir.join(trace::attempt_dir_name(k)),
    };
    std::fs::create_dir_all(&here).map_err(|source| LaunchError::Io {
        what: format!("creating the trace directory {}", here.display()),
        source,
    })?;
    let mut stale_dirs = vec![here.clone()];
    if attempt == 0 {
        stale_dirs.extend(earlier_attempt_dirs(dir));
    }
    for d in &stale_dirs {
        for r in ranks.clone() {
            let stale = d.join(trace::rank_file_name(r));
            if std::fs::remove_file(&stale).is_ok() {
                tracing::debug!("removed the earlier trace file {}", stale.display());
            }
        }
        if d != &here {
            // Empty once no node has files there (other nodes may share the directory).
            let _ = std::fs::remove_dir(d);
        }
    }
    env.insert(TRACE_VAR.into(), here.to_string_lossy().into_owned());
    Ok(())
}

/// The `attempt-<K>` subdirectories an earlier run left in `dir`.
fn earlier_attempt_dirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(list) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    list.filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("attempt-"))
                .is_some_and(|k| k.parse::<usize>().is_ok())
        })
        .map(|e| e.path())
        .collect()
}

/// After the launch: merges the rank files into `DIR/trace.json` (`DIR/trace-node<N>.json`
/// for node `N` of a job of several nodes) and says on stderr where it is and which ranks
/// are missing.
pub(super) fn merge(dir: &Path, node: Option<usize>, ranks: std::ops::Range<usize>) {
    let out = match node {
        Some(n) => dir.join(format!("trace-node{n}.json")),
        None => dir.join(MERGED_FILE),
    };
    let expected: Vec<usize> = ranks.collect();
    match trace::merge_into(dir, &expected, &out) {
        Ok(s) => {
            for (path, why) in &s.unreadable {
                tracing::warn!("trace: left out {}: {why}", path.display());
            }
            eprintln!("ddprun: {s}");
            if node.is_some() {
                eprintln!(
                    "ddprun: for one timeline of all nodes, gather every node's rank files into one \
                     directory and run `ddprun --merge-trace DIR`"
                );
            }
        }
        Err(e) => eprintln!("ddprun: no merged trace: {e}"),
    }
}
