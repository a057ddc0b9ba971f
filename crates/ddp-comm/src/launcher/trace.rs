//! The launcher's side of [`crate::trace`]: the trace directory of a launch, the ranks'
//! `DDP_TRACE`, and merging their files when the launch has ended.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{LaunchConfig, LaunchError};
use crate::trace::{self, MERGED_FILE, TRACE_VAR};

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

/// Before an attempt: creates the directory, removes this node's rank files of an earlier
/// run (so that a merge never shows a stale rank), and sets `DDP_TRACE` for the ranks.
pub(super) fn prepare(
    dir: &Path,
    ranks: std::ops::Range<usize>,
    env: &mut BTreeMap<String, String>,
) -> Result<(), LaunchError> {
    std::fs::create_dir_all(dir).map_err(|source| LaunchError::Io {
        what: format!("creating the trace directory {}", dir.display()),
        source,
    })?;
    for r in ranks {
        let stale = dir.join(trace::rank_file_name(r));
        if std::fs::remove_file(&stale).is_ok() {
            tracing::debug!("removed the earlier trace file {}", stale.display());
        }
    }
    env.insert(TRACE_VAR.into(), dir.to_string_lossy().into_owned());
    Ok(())
}

/// After the launch: merges the rank files into `DIR/trace.json` (`DIR/trace-node<N>.json`
/// on a job of several nodes) and says on stderr where it is and which ranks are missing.
pub(super) fn merge(cfg: &LaunchConfig, dir: &Path, ranks: std::ops::Range<usize>) {
    let out = if cfg.nnodes > 1 {
        dir.join(format!("trace-node{}.json", cfg.node_rank))
    } else {
        dir.join(MERGED_FILE)
    };
    let expected: Vec<usize> = ranks.collect();
    match trace::merge_into(dir, &expected, &out) {
        Ok(s) => {
            let mut line = format!(
                "ddprun: trace of rank(s) {} merged into {} ({} events; open it in https://ui.perfetto.dev)",
                list(&s.ranks),
                s.path.display(),
                s.events
            );
            if !s.missing.is_empty() {
                line += &format!(
                    "; no trace from rank(s) {} (killed before writing one?)",
                    list(&s.missing)
                );
            }
            if s.dropped_events > 0 {
                line += &format!(
                    "; {} events dropped over the cap ({})",
                    s.dropped_events,
                    trace::MAX_EVENTS_VAR
                );
            }
            for (path, why) in &s.unreadable {
                tracing::warn!("trace: left out {}: {why}", path.display());
            }
            eprintln!("{line}");
        }
        Err(e) => eprintln!("ddprun: no merged trace: {e}"),
    }
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
