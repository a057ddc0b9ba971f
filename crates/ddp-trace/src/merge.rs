//! Merges the rank files of a trace directory into one file: one track (`pid`) per rank, and
//! per restart attempt.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::writer::FORMAT;

/// The merged file's name inside the trace directory (one node; see [`merge_into`]).
pub const MERGED_FILE: &str = "trace.json";

/// The subdirectory of the trace directory that holds the rank files of restart attempt
/// `attempt` (≥ 1; attempt 0 writes into the trace directory itself). The launcher points
/// `DDP_TRACE` of a restarted group there, so that no attempt overwrites an earlier one's files.
///
/// ```
/// assert_eq!(ddp_trace::attempt_dir_name(2), "attempt-2");
/// ```
pub fn attempt_dir_name(attempt: usize) -> String {
    format!("attempt-{attempt}")
}

/// The `pid` (track) of rank `rank` of restart attempt `attempt` in a merged file: the rank for
/// attempt 0, `attempt * 1_000_000 + rank` after a restart, so that every attempt's ranks get
/// tracks of their own (named `rank R (attempt K)`), sorted after the earlier attempts'.
///
/// ```
/// use ddp_trace::track_pid;
/// assert_eq!(track_pid(3, 0), 3);
/// assert_eq!(track_pid(3, 2), 2_000_003);
/// ```
pub fn track_pid(rank: usize, attempt: usize) -> u64 {
    (attempt as u64) * 1_000_000 + rank as u64
}

/// What [`merge_dir`] merged.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeSummary {
    /// The merged file.
    pub path: PathBuf,
    /// The ranks of the last attempt whose files were merged, ascending.
    pub ranks: Vec<usize>,
    /// Expected ranks without a file in the last attempt (killed before writing it, or not
    /// tracing).
    pub missing: Vec<usize>,
    /// The attempts merged: 1 without restarts, `K + 1` when the last one was restart `K`.
    pub attempts: usize,
    /// Rank files that could not be read or parsed, with the reason (left out).
    pub unreadable: Vec<(PathBuf, String)>,
    /// Events in the merged file, metadata included.
    pub events: usize,
    /// Events the ranks dropped (over their cap), summed.
    pub dropped_events: u64,
}

/// One line for the user: which ranks (and attempts) were merged into which file, how to open
/// it, and what is missing, e.g. `trace of rank(s) 0, 1 merged into /tmp/t/trace.json (812
/// events; open it in https://ui.perfetto.dev); no trace from rank(s) 2 (killed before writing
/// one?)`.
impl std::fmt::Display for MergeSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |ranks: &[usize]| {
            ranks
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(f, "trace of rank(s) {}", list(&self.ranks))?;
        if self.attempts > 1 {
            write!(f, " and of the {} earlier attempt(s)", self.attempts - 1)?;
        }
        write!(
            f,
            " merged into {} ({} events; open it in https://ui.perfetto.dev)",
            self.path.display(),
            self.events
        )?;
        if !self.missing.is_empty() {
            write!(
                f,
                "; no trace from rank(s) {} (killed before writing one?)",
                list(&self.missing)
            )?;
        }
        if self.dropped_events > 0 {
            write!(
                f,
                "; {} events dropped over the cap ({})",
                self.dropped_events,
                super::MAX_EVENTS_VAR
            )?;
        }
        Ok(())
    }
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
/// let summary = ddp_trace::merge_dir("/tmp/trace".as_ref(), &[0, 1, 2, 3])?;
/// println!("{} ({} events); missing ranks {:?}", summary.path.display(), summary.events, summary.missing);
/// # Ok::<(), ddp_trace::TraceError>(())
/// ```
pub fn merge_dir(dir: &Path, expected: &[usize]) -> Result<MergeSummary, TraceError> {
    merge_into(dir, expected, &dir.join(MERGED_FILE))
}

/// Merges every `rank-<R>.trace.json` in `dir` into `out`: the metadata events of every rank
/// first, then all other events sorted by `ts`; `pid` stays the rank (set from the file name
/// where an event lacks one). The rank files of restart attempts, in `dir/attempt-<K>/`
/// ([`attempt_dir_name`]), are merged too, each rank of each attempt on a track of its own
/// ([`track_pid`]). `otherData` lists the merged and missing ranks of the last attempt, every
/// attempt's under `attempts`, and carries each rank's own `otherData` under
/// `ranks_other_data` (keyed `R`, or `R/attempt-K`). Ranks of `expected` without a file in the
/// last attempt are reported as missing (an empty `expected`: every rank up to the highest one
/// with a file); unreadable files are left out and reported. The file is replaced atomically.
pub fn merge_into(dir: &Path, expected: &[usize], out: &Path) -> Result<MergeSummary, TraceError> {
    let (files, last_attempt) = rank_files(dir)?;
    let up_to_highest: Vec<usize> = match files.iter().map(|f| f.rank).max() {
        Some(max) if expected.is_empty() => (0..=max).collect(),
        _ => Vec::new(),
    };
    let expected = if expected.is_empty() {
        &up_to_highest[..]
    } else {
        expected
    };
    let mut per_attempt: Vec<Vec<usize>> = vec![Vec::new(); last_attempt + 1];
    let mut unreadable = Vec::new();
    let mut metadata = Vec::new();
    let mut events = Vec::new();
    let mut other = Map::new();
    let mut dropped_events = 0;
    for RankFile {
        attempt,
        rank,
        path,
    } in files
    {
        let (evs, data) = match read_rank_file(&path) {
            Ok(doc) => doc,
            Err(e) => {
                unreadable.push((path, e));
                continue;
            }
        };
        let pid = track_pid(rank, attempt);
        for mut ev in evs {
            let Some(obj) = ev.as_object_mut() else {
                continue;
            };
            if attempt == 0 {
                obj.entry("pid").or_insert(json!(rank));
            } else {
                obj.insert("pid".into(), json!(pid));
                rename_restarted_track(obj, rank, attempt, pid);
            }
            if obj.get("ph").and_then(Value::as_str) == Some("M") {
                metadata.push(ev);
            } else {
                events.push(ev);
            }
        }
        if let Some(data) = data {
            dropped_events += data
                .get("dropped_events")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            let key = match attempt {
                0 => rank.to_string(),
                k => format!("{rank}/{}", attempt_dir_name(k)),
            };
            other.insert(key, data);
        }
        per_attempt[attempt].push(rank);
    }
    if per_attempt.iter().all(Vec::is_empty) {
        return Err(TraceError::NoRankFiles {
            dir: dir.to_path_buf(),
            unreadable,
        });
    }
    let ts = |e: &Value| e.get("ts").and_then(Value::as_f64).unwrap_or(0.0);
    events.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
    let missing_of = |ranks: &[usize]| -> Vec<usize> {
        expected
            .iter()
            .copied()
            .filter(|r| !ranks.contains(r))
            .collect()
    };
    let ranks = per_attempt[last_attempt].clone();
    let missing = missing_of(&ranks);
    let attempts: Vec<Value> = per_attempt
        .iter()
        .enumerate()
        .map(|(k, r)| json!({"attempt": k, "ranks": r, "missing": missing_of(r)}))
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
            "attempts": attempts,
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
        attempts: last_attempt + 1,
        unreadable,
        events: count,
        dropped_events,
    })
}

/// One rank file found in a trace directory.
struct RankFile {
    attempt: usize,
    rank: usize,
    path: PathBuf,
}

/// The rank files of `dir` (attempt 0) and of its `attempt-<K>` subdirectories, sorted by
/// attempt and rank, and the last attempt (the highest `K` with a subdirectory, else 0).
fn rank_files(dir: &Path) -> Result<(Vec<RankFile>, usize), TraceError> {
    let list = |d: &Path| {
        std::fs::read_dir(d).map_err(|source| TraceError::ReadDir {
            dir: d.to_path_buf(),
            source,
        })
    };
    let mut files = Vec::new();
    let mut attempt_dirs = Vec::new();
    for e in list(dir)?.filter_map(|e| e.ok()) {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if let Some(rank) = rank_of(&name) {
            files.push(RankFile {
                attempt: 0,
                rank,
                path: e.path(),
            });
        } else if let Some(k) = name.strip_prefix("attempt-").and_then(|k| k.parse().ok())
            && k > 0
            && e.path().is_dir()
        {
            attempt_dirs.push((k, e.path()));
        }
    }
    let last = attempt_dirs.iter().map(|(k, _)| *k).max().unwrap_or(0);
    for (attempt, sub) in attempt_dirs {
        for e in list(&sub)?.filter_map(|e| e.ok()) {
            if let Some(rank) = e.file_name().to_str().and_then(rank_of) {
                files.push(RankFile {
                    attempt,
                    rank,
                    path: e.path(),
                });
            }
        }
    }
    files.sort_by_key(|f| (f.attempt, f.rank));
    Ok((files, last))
}

/// The rank of a file named `rank-<R>.trace.json`.
fn rank_of(name: &str) -> Option<usize> {
    name.strip_prefix("rank-")?
        .strip_suffix(".trace.json")?
        .parse()
        .ok()
}

/// A rank file's events and its `otherData`.
fn read_rank_file(path: &Path) -> Result<(Vec<Value>, Option<Value>), String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let Value::Object(mut doc) = serde_json::from_slice(&bytes).map_err(|e| e.to_string())? else {
        return Err("not a JSON object".into());
    };
    let Some(Value::Array(list)) = doc.remove("traceEvents") else {
        return Err("no traceEvents array".into());
    };
    Ok((list, doc.remove("otherData")))
}

/// Names the track of a restarted rank `rank (attempt K)` and sorts it after the earlier
/// attempts' tracks (its `process_name` and `process_sort_index` metadata).
fn rename_restarted_track(obj: &mut Map<String, Value>, rank: usize, attempt: usize, pid: u64) {
    let name = obj.get("name").and_then(Value::as_str).map(str::to_owned);
    let args = obj.get_mut("args").and_then(Value::as_object_mut);
    match (name.as_deref(), args) {
        (Some("process_name"), Some(args)) => {
            args.insert(
                "name".into(),
                json!(format!("rank {rank} (attempt {attempt})")),
            );
        }
        (Some("process_sort_index"), Some(args)) => {
            args.insert("sort_index".into(), json!(pid));
        }
        _ => {}
    }
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
