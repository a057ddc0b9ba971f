//! Dumps: every rank's snapshot (with what the launcher saw of it) as JSON files in a folder of
//! their own, written by `ddprun` on SIGUSR1 or at a hang, and read back by `ddprun doctor`.

use std::io;
use std::path::{Path, PathBuf};

use crate::snapshot::RankSnapshot;

/// The verdict file of a dump (one verdict per line; may be empty).
pub const VERDICT_FILE: &str = "verdict.txt";

/// What went wrong reading or writing a dump.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// A file or folder could not be read or written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A rank file is not a snapshot.
    #[error("{} is not a rank snapshot: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// No rank file found.
    #[error("no rank snapshots (rank-<R>.json) under {}", .0.display())]
    Empty(PathBuf),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DumpError + 'a {
    move |source| DumpError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The file name of rank `rank`'s snapshot in a dump.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank}.json")
}

/// Writes `snapshots` and `verdicts` into a new folder `dir/<name>` (made whole under a
/// temporary name, then renamed: a dump is there entire or not at all). Returns its path.
pub fn write(
    dir: &Path,
    name: &str,
    snapshots: &[RankSnapshot],
    verdicts: &[String],
) -> Result<PathBuf, DumpError> {
    std::fs::create_dir_all(dir).map_err(io_err("creating the dump folder", dir))?;
    let partial = dir.join(format!(".{name}.partial"));
    std::fs::create_dir_all(&partial).map_err(io_err("creating", &partial))?;
    for s in snapshots {
        let path = partial.join(rank_file_name(s.rank));
        let json = serde_json::to_vec_pretty(s).map_err(|e| DumpError::Io {
            what: "encoding",
            path: path.clone(),
            source: io::Error::other(e),
        })?;
        std::fs::write(&path, json).map_err(io_err("writing", &path))?;
    }
    let verdict_path = partial.join(VERDICT_FILE);
    let mut text = verdicts.join("\n");
    text.push('\n');
    std::fs::write(&verdict_path, text).map_err(io_err("writing", &verdict_path))?;
    let done = dir.join(name);
    std::fs::rename(&partial, &done).map_err(io_err("renaming into place", &done))?;
    Ok(done)
}

/// Reads the snapshots under `dir`: its own `rank-<R>.json` files, else those of the folders
/// in it (a dump folder per node and time), the newest snapshot of each rank winning.
pub fn read(dir: &Path) -> Result<Vec<RankSnapshot>, DumpError> {
    let mut found: Vec<RankSnapshot> = Vec::new();
    collect(dir, &mut found, 0)?;
    if found.is_empty() {
        return Err(DumpError::Empty(dir.to_path_buf()));
    }
    found.sort_by_key(|s| s.rank);
    Ok(found)
}

fn collect(dir: &Path, found: &mut Vec<RankSnapshot>, depth: usize) -> Result<(), DumpError> {
    let entries = std::fs::read_dir(dir).map_err(io_err("reading the folder", dir))?;
    let mut folders = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("reading the folder", dir))?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let kind = entry.file_type().map_err(io_err("reading", &path))?;
        if kind.is_dir() {
            folders.push(path);
        } else if name.starts_with("rank-") && name.ends_with(".json") {
            let bytes = std::fs::read(&path).map_err(io_err("reading", &path))?;
            let s: RankSnapshot =
                serde_json::from_slice(&bytes).map_err(|source| DumpError::Parse {
                    path: path.clone(),
                    source,
                })?;
            match found.iter_mut().find(|f| f.rank == s.rank) {
                Some(f) if f.written_ms >= s.written_ms => {}
                Some(f) => *f = s,
                None => found.push(s),
            }
        }
    }
    if depth < 2 {
        for f in folders {
            collect(&f, found, depth + 1)?;
        }
    }
    Ok(())
}
