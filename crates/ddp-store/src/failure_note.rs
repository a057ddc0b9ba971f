//! How a rank tells its launcher that its failure only relayed a peer's: the launcher names
//! the rank whose own error it was as the job's cause, not the first rank that exited.
//!
//! `ddprun` sets [`FAILURE_FILE_VAR`] to a file of each rank's own. A rank whose process group
//! broke on a peer (the peer closed its connection, an I/O error or a timeout on it, rank 0's
//! checkpoint error sent to every rank) writes the peer's rank there with
//! [`note_peer_failure`], once, before it returns the error; the launcher reads it with
//! [`relayed_from`] when the rank has exited non-zero. Without the variable (a rank not
//! started by `ddprun`) nothing is written.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::Path;

/// The variable naming the file a rank writes its relayed failure to (set by `ddprun`).
pub const FAILURE_FILE_VAR: &str = "DDP_FAILURE_FILE";

/// What a rank's note says of the peer it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoteKind {
    /// The peer's connection closed or failed: it is gone (its launcher sees it exit).
    Lost,
    /// A collective waited for the peer past its deadline (`DDP_TIMEOUT_SECS`): the peer may
    /// be alive and hung (stopped, deadlocked, stuck in its data loader). Under live recovery
    /// its launcher kills it, so that it is replaced.
    Hung,
}

impl NoteKind {
    fn word(self) -> &'static str {
        match self {
            NoteKind::Lost => "lost",
            NoteKind::Hung => "hung",
        }
    }
}

/// A rank's note: the peer whose failure it relayed, and how it saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Note {
    /// The peer's rank.
    pub peer: usize,
    /// How this rank saw it fail.
    pub kind: NoteKind,
}

/// Notes that this rank fails because rank `peer` failed (`what`: the error, for the file's
/// reader). The first note stays; later ones are ignored. A file that cannot be written is
/// logged and skipped: the rank's own error is what it returns either way.
pub fn note_peer_failure(peer: usize, what: &str) {
    note(peer, NoteKind::Lost, what);
}

/// Notes that this rank fails because a collective waited for rank `peer` past its deadline:
/// as [`note_peer_failure`], with [`NoteKind::Hung`].
pub fn note_peer_hung(peer: usize, what: &str) {
    note(peer, NoteKind::Hung, what);
}

fn note(peer: usize, kind: NoteKind, what: &str) {
    let Some(path) = std::env::var_os(FAILURE_FILE_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    // One line: the launcher reads the first two fields.
    let what = what.replace(['\n', '\t'], " ");
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{peer}\t{}\t{what}", kind.word()));
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => tracing::warn!(
            "cannot note this rank's relayed failure in {} ({FAILURE_FILE_VAR}): {e}",
            Path::new(&path).display()
        ),
    }
}

/// Withdraws this rank's note (its group re-formed after the peer's failure it noted, so a
/// later failure of its own is not taken for a relayed one). Nothing to do without the
/// variable or the file.
///
/// # Errors
/// The note exists and cannot be removed (the error names the file).
pub fn withdraw_peer_failure() -> io::Result<()> {
    let Some(path) = std::env::var_os(FAILURE_FILE_VAR).filter(|p| !p.is_empty()) else {
        return Ok(());
    };
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!(
                "cannot withdraw this rank's failure note {}: {e}",
                Path::new(&path).display()
            ),
        )),
    }
}

/// The peer whose failure the rank that owns `path` relayed, if it wrote one (`Ok(None)`: the
/// file does not exist, the failure was the rank's own).
pub fn relayed_from(path: &Path) -> io::Result<Option<usize>> {
    Ok(read_note(path)?.map(|n| n.peer))
}

/// The note the rank that owns `path` wrote, if any (`Ok(None)`: the file does not exist).
/// A note of an older format (`peer`, then the error) reads as [`NoteKind::Lost`].
///
/// # Errors
/// The file cannot be read, or does not start with a rank.
pub fn read_note(path: &Path) -> io::Result<Option<Note>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut fields = text.split('\t');
    let peer = fields.next().unwrap_or_default().trim();
    let kind = match fields.next().map(str::trim) {
        Some("hung") => NoteKind::Hung,
        _ => NoteKind::Lost,
    };
    let peer = peer.parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{FAILURE_FILE_VAR} file holds {text:?}, not a rank"),
        )
    })?;
    Ok(Some(Note { peer, kind }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn withdraw_peer_failure_at(path: &Path) {
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn the_first_note_stays_and_an_absent_file_is_an_own_failure() {
        let dir = std::env::temp_dir().join(format!("ddp-failure-note-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank-1");
        let _ = std::fs::remove_file(&path);
        assert_eq!(relayed_from(&path).unwrap(), None);
        // SAFETY: this test is the only one in this binary that touches the variable.
        unsafe { std::env::set_var(FAILURE_FILE_VAR, &path) };
        note_peer_failure(3, "rank 3 closed its connection");
        note_peer_failure(0, "later");
        assert_eq!(relayed_from(&path).unwrap(), Some(3));
        // Withdrawn after a recovery: a later failure is the rank's own again.
        withdraw_peer_failure().unwrap();
        assert_eq!(relayed_from(&path).unwrap(), None);
        withdraw_peer_failure().unwrap();
        note_peer_failure(3, "rank 3 closed its connection");
        unsafe { std::env::remove_var(FAILURE_FILE_VAR) };
        assert_eq!(relayed_from(&path).unwrap(), Some(3));
        assert_eq!(
            read_note(&path).unwrap(),
            Some(Note {
                peer: 3,
                kind: NoteKind::Lost
            })
        );
        withdraw_peer_failure_at(&path);
        unsafe { std::env::set_var(FAILURE_FILE_VAR, &path) };
        note_peer_hung(
            2,
            "timed out after 10.0s during all_reduce\nwaiting for rank 2",
        );
        unsafe { std::env::remove_var(FAILURE_FILE_VAR) };
        assert_eq!(
            read_note(&path).unwrap(),
            Some(Note {
                peer: 2,
                kind: NoteKind::Hung
            })
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
        // An older launcher's reader and an older rank's note: the first field is the rank.
        std::fs::write(&path, "1\trank 1 closed its connection\n").unwrap();
        assert_eq!(
            read_note(&path).unwrap(),
            Some(Note {
                peer: 1,
                kind: NoteKind::Lost
            })
        );
        std::fs::write(&path, "garbage").unwrap();
        assert!(relayed_from(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
