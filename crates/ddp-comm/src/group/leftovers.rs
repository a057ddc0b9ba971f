//! Removing what an exited process left in a shared directory (its `/dev/shm` segments, its
//! local sockets' private directories): one sweep for both, so that each applies the same rules
//! — only names with the process's prefix, only entries of the expected type owned by this
//! process's effective user, symbolic links looked at and never followed, an entry that
//! vanishes meanwhile skipped, and every entry tried before the first other error is returned.

use std::fs::FileType;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// `e` with `path` in its message (its kind kept).
pub(super) fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// What a file of type `t` is, for messages.
pub(super) fn describe(t: FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// This process's effective user.
pub(super) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Calls `remove` on every entry of `dir` whose name starts with `prefix`, whose type (lstat:
/// a link is not followed) passes `wanted` and which this process's effective user owns, on
/// behalf of the exited process `pid` (for the log). `remove` names the path in its errors; a
/// `NotFound` from it means the entry vanished meanwhile. Returns how many were removed; no
/// `dir` at all is `Ok(0)`; the first other error is returned after every entry was tried.
pub(super) fn remove_owned(
    dir: &Path,
    prefix: &str,
    wanted: fn(FileType) -> bool,
    pid: u32,
    remove: impl Fn(&Path) -> io::Result<()>,
) -> io::Result<usize> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(named(dir, e)),
    };
    let me = euid();
    let (mut removed, mut first_error) = (0, None);
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                first_error.get_or_insert(named(dir, e));
                continue;
            }
        };
        if !entry.file_name().as_bytes().starts_with(prefix.as_bytes()) {
            continue;
        }
        let path = entry.path();
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                first_error.get_or_insert(named(&path, e));
                continue;
            }
        };
        if !wanted(meta.file_type()) || meta.uid() != me {
            tracing::debug!(
                "left {} alone: {}, owner uid {}",
                path.display(),
                describe(meta.file_type()),
                meta.uid()
            );
            continue;
        }
        match remove(&path) {
            Ok(()) => {
                tracing::debug!("removed {} (process {pid} has exited)", path.display());
                removed += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}
