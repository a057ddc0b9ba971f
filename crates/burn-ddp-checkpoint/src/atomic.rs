//! Atomic file replacement and the temporary files it leaves: a writer writes
//! `.NAME.tmp-HOST-PID-RANDOM` next to `NAME` while holding an exclusive `flock` on it, fsyncs
//! it, renames it over `NAME` and fsyncs the directory. A reader removes only temporaries whose
//! lock it can take — their writer is gone (a killed save) — never a live writer's, whatever
//! host or container it runs on (the random part keeps names unique where pids are not).
//!
//! Locks are `flock(2)`: local file systems and NFSv4 honour them across hosts; on a file
//! system that ignores them a reader could take a live writer's lock, so keep checkpoint
//! directories of running jobs on one that honours them.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The marker between a file's name and a temporary's own part.
const TMP_MARK: &str = ".tmp-";

/// This host's name (for temporaries' names; `host` when it cannot be read).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if ok && !name.is_empty() {
        name
    } else {
        "host".into()
    }
}

/// The prefix every temporary of `path` starts with (`.NAME.tmp-`).
fn prefix(path: &Path) -> Option<String> {
    Some(format!(
        ".{}{TMP_MARK}",
        path.file_name()?.to_string_lossy()
    ))
}

/// A fresh temporary name for `path`: `.NAME.tmp-HOST-PID-RANDOM`.
pub(super) fn temporary_name(path: &Path) -> Option<PathBuf> {
    let p = prefix(path)?;
    Some(path.with_file_name(format!(
        "{p}{}-{}-{:016x}",
        host_name(),
        std::process::id(),
        rand::random::<u64>()
    )))
}

fn flock(f: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: flock on an open descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Creates and locks a new temporary for `path`. Retried when a reader removed the file
/// between its creation and the lock (it saw an unlocked temporary).
fn create_locked(path: &Path) -> io::Result<(PathBuf, File)> {
    for _ in 0..8 {
        let tmp = temporary_name(path).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name")
        })?;
        let f = File::options().write(true).create_new(true).open(&tmp)?;
        flock(&f, libc::LOCK_EX)?;
        // Still the file at that name? (A reader may have unlinked it before we locked it.)
        match std::fs::metadata(&tmp) {
            Ok(m) if m.ino() == f.metadata()?.ino() => return Ok((tmp, f)),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(
        "temporary files keep disappearing before they can be locked",
    ))
}

/// Writes `bytes` to `path` atomically (see the module): a reader sees the old file or the
/// new one, never a part. `write` produces the bytes into the temporary (the checkpoint's
/// fault tests pause in it); `pause` is how long it waits half-way.
///
/// # Errors
/// The I/O error of any step, the directory's fsync included. The temporary is removed on
/// every error, and the previous file at `path` is untouched.
pub(super) fn write_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let (tmp, mut f) = create_locked(path)?;
    let result = write(&mut f)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The lock goes with the descriptor; the file now has `path`'s name.
    drop(f);
    sync_dir(path)
}

/// Writes `bytes` in two halves, sleeping `pause` between them when given.
pub(super) fn halves(
    bytes: &[u8],
    pause: Option<Duration>,
) -> impl FnOnce(&mut File) -> io::Result<()> + '_ {
    move |f| {
        let (first, second) = bytes.split_at(bytes.len() / 2);
        f.write_all(first)?;
        if let Some(pause) = pause {
            f.flush()?;
            tracing::warn!("pausing {pause:?} in the middle of a checkpoint write");
            std::thread::sleep(pause);
        }
        f.write_all(second)
    }
}

/// Makes a rename in `path`'s directory durable: fsync of the directory.
fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let d = File::open(dir)?;
    match d.sync_all() {
        // A file system that cannot sync directories says so with EINVAL: nothing to report.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        other => other,
    }
}

/// Removes the temporaries next to `path` that no live writer holds (their lock can be taken):
/// what saves killed half-way left. A temporary being written — by this process or any
/// other, on any host — is left alone. Returns how many were removed.
pub fn remove_stale_temporaries(path: &Path) -> usize {
    let (Some(dir), Some(prefix)) = (path.parent(), prefix(path)) else {
        return 0;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let p = entry.path();
        let Ok(f) = File::open(&p) else { continue };
        if flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            continue; // a live writer holds it
        }
        if std::fs::remove_file(&p).is_ok() {
            tracing::info!(
                "removed {}, left by a save that did not finish",
                p.display()
            );
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_host_pid_and_a_random_part() {
        let p = Path::new("/ck/checkpoint.bin");
        let a = temporary_name(p).unwrap();
        let b = temporary_name(p).unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".checkpoint.bin.tmp-"), "{name}");
        assert!(
            name.contains(&format!("-{}-", std::process::id())),
            "{name}"
        );
    }

    /// A reader during a save (an evaluation process, another host) must not delete the
    /// writer's temporary: before the lock, any temporary of another pid was removed.
    #[test]
    fn a_live_writers_temporary_survives_a_reader() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("checkpoint.bin");
        // A writer of another process: its own name, its lock held.
        let live = p.with_file_name(".checkpoint.bin.tmp-otherhost-999999-0123456789abcdef");
        let held = File::create(&live).unwrap();
        flock(&held, libc::LOCK_EX).unwrap();
        // A killed writer: a temporary nobody holds.
        let dead = p.with_file_name(".checkpoint.bin.tmp-otherhost-888888-fedcba9876543210");
        std::fs::write(&dead, b"half").unwrap();
        assert_eq!(remove_stale_temporaries(&p), 1);
        assert!(live.exists(), "a live writer's temporary was removed");
        assert!(!dead.exists());
        drop(held);
        assert_eq!(remove_stale_temporaries(&p), 1, "unlocked now: stale");
    }

    /// A save in progress in another thread while a reader cleans up: the save completes.
    #[test]
    fn a_concurrent_reader_does_not_break_a_save() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("checkpoint.bin");
        let writer = {
            let p = p.clone();
            std::thread::spawn(move || {
                write_with(
                    &p,
                    halves(b"new checkpoint bytes", Some(Duration::from_millis(300))),
                )
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(remove_stale_temporaries(&p), 0);
        writer.join().unwrap().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new checkpoint bytes");
    }

    /// A write that fails half-way (ENOSPC, EIO) removes its temporary and keeps the old file.
    #[test]
    fn a_failed_write_leaves_no_temporary_and_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("checkpoint.bin");
        write_with(&p, halves(b"old", None)).unwrap();
        let e = write_with(&p, |f| {
            f.write_all(b"par")?;
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        })
        .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// The directory's fsync is reported: here the directory is gone by then.
    #[test]
    fn a_failed_directory_sync_is_an_error() {
        let e = sync_dir(Path::new("/nonexistent-dir-for-burn-ddp/checkpoint.bin")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
