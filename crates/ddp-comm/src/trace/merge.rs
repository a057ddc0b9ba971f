//! Merges the rank files of a trace directory into one file: one track (`pid`) per rank.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::writer::FORMAT;

/// The merged file's name inside the trace directory (one node; see [`merge_into`]).
pub const MERGED_FILE: &str = "trace.json";

/// What [`merge_dir`] merged.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeSummary {
    /// The merged file.
    pub path: PathBuf,
    /// The ranks whose files were merged, ascending.
    pub ranks: Vec<usize>,
    /// Expected ranks without a file (killed before writing it, or not tracing).
    pub missing: Vec<usize>,
    /// Rank files that could not be read or parsed, with the reason (left out).
    pub unreadable: Vec<(PathBuf, String)>,
    /// Events in the merged file, metadata included.
    pub events: usize,
    /// Events the ranks dropped (over their cap), summed.
    pub dropped_events: u64,
}

/// Why a merge produced no file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The trace directory could not be listed.
    #[error("cannot read the trace directory {}: {source}", dir.display())]
    ReadDir {
        /// The directory.
        dir: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// No readable rank file was found.
    #[error("no readable rank-<R>.trace.json in {} ({} unreadable)", dir.display(), unreadable.len())]
    NoRankFiles {
        /// The directory.
        dir: PathBuf,
        /// Rank files that exist but could not be read, with the reason.
        unreadable: Vec<(PathBuf, String)>,
    },
    /// The merged file could not be written.
    #[error("cannot write the merged trace {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Merges every `rank-<R>.trace.json` in `dir` into `dir/trace.json` ([`MERGED_FILE`]), see
/// [`merge_into`].
///
/// ```no_run
/// let summary = ddp_comm::trace::merge_dir("/tmp/trace".as_ref(), &[0, 1, 2, 3])?;
/// println!("{} ({} events); missing ranks {:?}", summary.path.display(), summary.events, summary.missing);
/// # Ok::<(), ddp_comm::trace::TraceError>(())
/// ```
pub fn merge_dir(dir: &Path, expected: &[usize]) -> Result<MergeSummary, TraceError> {
    merge_into(dir, expected, &dir.join(MERGED_FILE))
}

/// Merges every `rank-<R>.trace.json` in `dir` into `out`: the metadata events of every rank
/// first, then all other events sorted by `ts`; `pid` stays the rank (set from the file name
/// where an event lacks one). `otherData` lists the merged and missing ranks and carries each
/// rank's own `otherData` under `ranks_other_data`. Ranks of `expected` without a file are
/// reported as missing; unreadable files are left out and reported. The file is replaced
/// atomically.
pub fn merge_into(dir: &Path, expected: &[usize], out: &Path) -> Result<MergeSummary, TraceError> {
    let read_dir = std::fs::read_dir(dir).map_err(|source| TraceError::ReadDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<(usize, PathBuf)> = read_dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rank = name.strip_prefix("rank-")?.strip_suffix(".trace.json")?;
            Some((rank.parse().ok()?, e.path()))
        })
        .collect();
    files.sort();

    let mut ranks = Vec::new();
    let mut unreadable = Vec::new();
    let mut metadata = Vec::new();
    let mut events = Vec::new();
    let mut other = Map::new();
    let mut dropped_events = 0;
    for (rank, path) in files {
        let parsed = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string()));
        let mut doc = match parsed {
            Ok(Value::Object(doc)) => doc,
            Ok(_) => {
                unreadable.push((path, "not a JSON object".to_string()));
                continue;
            }
            Err(e) => {
                unreadable.push((path, e));
                continue;
            }
        };
        let Some(Value::Array(list)) = doc.remove("traceEvents") else {
            unreadable.push((path, "no traceEvents array".to_string()));
            continue;
        };
        for mut ev in list {
            let Some(obj) = ev.as_object_mut() else {
                continue;
            };
            obj.entry("pid").or_insert(json!(rank));
            if obj.get("ph").and_then(Value::as_str) == Some("M") {
                metadata.push(ev);
            } else {
                events.push(ev);
            }
        }
        if let Some(data) = doc.remove("otherData") {
            dropped_events += data
                .get("dropped_events")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            other.insert(rank.to_string(), data);
        }
        ranks.push(rank);
    }
    if ranks.is_empty() {
        return Err(TraceError::NoRankFiles {
            dir: dir.to_path_buf(),
            unreadable,
        });
    }
    let ts = |e: &Value| e.get("ts").and_then(Value::as_f64).unwrap_or(0.0);
    events.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
    let missing: Vec<usize> = expected
        .iter()
        .copied()
        .filter(|r| !ranks.contains(r))
        .collect();
    let count = metadata.len() + events.len();
    metadata.extend(events);
    let doc = json!({
        "traceEvents": metadata,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": FORMAT,
            "merged_ranks": ranks,
            "missing_ranks": missing,
            "unreadable": unreadable.iter().map(|(p, e)| format!("{}: {e}", p.display())).collect::<Vec<_>>(),
            "dropped_events": dropped_events,
            "ranks_other_data": other,
        },
    });
    write_atomically(out, &doc).map_err(|source| TraceError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    Ok(MergeSummary {
        path: out.to_path_buf(),
        ranks,
        missing,
        unreadable,
        events: count,
        dropped_events,
    })
}

fn write_atomically(path: &Path, doc: &Value) -> io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let result = (|| {
        let mut w = io::BufWriter::new(std::fs::File::create(&tmp)?);
        serde_json::to_writer(&mut w, doc)?;
        w.write_all(b"\n")?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
