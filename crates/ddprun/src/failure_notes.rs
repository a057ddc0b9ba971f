//! The launcher's side of `DDP_FAILURE_FILE` ([`ddp_comm::failure_note`]): a private folder
//! with one file per rank, where a rank that fails only on a peer's failure says so, so that
//! the launcher names the rank whose own error it was. The ranks' progress files
//! (`DDP_PROGRESS_FILE`, the hang doctor's input) live there too.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;

use ddp_comm::failure_note::{FAILURE_FILE_VAR, Note, read_note};

use super::report::LaunchError;

/// The folder of a launch's failure notes (removed when dropped).
pub(crate) struct FailureNotes {
    dir: PathBuf,
}

impl FailureNotes {
    /// Makes a folder of this launcher's own (mode 0700) under the system's temporary folder.
    pub fn create() -> Result<Self, LaunchError> {
        let dir = std::env::temp_dir().join(format!(
            "ddprun-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| LaunchError::Io {
                what: format!("creating the ranks' failure notes folder {}", dir.display()),
                source,
            })?;
        Ok(FailureNotes { dir })
    }

    /// The variable and file of global rank `rank`, its earlier note (an earlier attempt's)
    /// removed.
    pub fn for_rank(&self, rank: usize) -> Result<(&'static str, PathBuf), LaunchError> {
        let path = self.path(rank);
        remove_stale(&path, "failure note")?;
        Ok((FAILURE_FILE_VAR, path))
    }

    /// The peer whose failure rank `rank` relayed, if it said so. An unreadable note is
    /// logged with its path and counted as the rank's own failure.
    pub fn relayed_from(&self, rank: usize) -> Option<usize> {
        self.note(rank).map(|n| n.peer)
    }

    /// Rank `rank`'s note (while it runs too: a hung peer it waited for), if it wrote one. An
    /// unreadable note is logged with its path and read as none.
    pub fn note(&self, rank: usize) -> Option<Note> {
        let path = self.path(rank);
        read_note(&path).unwrap_or_else(|e| {
            tracing::warn!(
                "cannot read rank {rank}'s failure note {}: {e}",
                path.display()
            );
            None
        })
    }

    /// The variable and file of global rank `rank`'s progress ([`ddp_doctor::publisher`]),
    /// an earlier attempt's removed.
    pub fn progress_for_rank(&self, rank: usize) -> Result<(&'static str, PathBuf), LaunchError> {
        let path = self.progress_path(rank);
        remove_stale(&path, "progress file")?;
        Ok((ddp_doctor::publisher::PROGRESS_FILE_VAR, path))
    }

    /// Rank `rank`'s latest progress, if it published any. An unreadable file is logged with
    /// its path and read as none.
    pub fn progress(&self, rank: usize) -> Option<ddp_doctor::RankSnapshot> {
        let path = self.progress_path(rank);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!("cannot read rank {rank}'s progress {}: {e}", path.display());
                return None;
            }
        };
        serde_json::from_slice(&bytes)
            .inspect_err(|e| {
                tracing::warn!(
                    "rank {rank}'s progress {} is unreadable: {e}",
                    path.display()
                )
            })
            .ok()
    }

    fn progress_path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("progress-{rank}.json"))
    }

    fn path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}"))
    }

    /// The folder.
    #[cfg(test)]
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

/// Removes an earlier attempt's `what` at `path`; absent is fine, any other error stops.
fn remove_stale(path: &std::path::Path, what: &str) -> Result<(), LaunchError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LaunchError::Io {
            what: format!("removing the {what} {}", path.display()),
            source,
        }),
    }
}

impl Drop for FailureNotes {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                "cannot remove the ranks' failure notes folder {}: {e}",
                self.dir.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_note_is_read_cleared_and_the_folder_removed() {
        let notes = FailureNotes::create().unwrap();
        let (var, path) = notes.for_rank(2).unwrap();
        assert_eq!(var, FAILURE_FILE_VAR);
        assert_eq!(notes.relayed_from(2), None);
        std::fs::write(&path, "0\trank 0 closed its connection\n").unwrap();
        assert_eq!(notes.relayed_from(2), Some(0));
        notes.for_rank(2).unwrap();
        assert_eq!(
            notes.relayed_from(2),
            None,
            "a new attempt starts without it"
        );
        let dir = notes.dir().to_path_buf();
        drop(notes);
        assert!(!dir.exists());
    }
}
