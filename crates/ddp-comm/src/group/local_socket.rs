//! The channel ranks on one host meet through: a Unix socket in a directory of this rank's own
//! (a fresh random name, mode 0700, under `$XDG_RUNTIME_DIR` or else the temporary directory),
//! so only the job's user (and root) can open it. Another local user cannot connect to it, flood
//! it or squat its name (the directory is created by this process, atomically, and a name
//! already taken is never reused), as they can a TCP port on loopback. Ranks on other hosts
//! still meet over TCP. The listener lives for the rendezvous only: once every peer is
//! connected it is closed and its directory removed. A rank killed before that leaves its
//! directory behind (named by its pid, `ddp-comm-{pid}-…`); its launcher removes it with
//! [`remove_local_dirs_of`] once it has reaped the process.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::leftovers;

/// Longest socket path the kernel takes (`sockaddr_un`'s 108 bytes, less the final NUL).
const MAX_PATH: usize = 107;
/// The socket's name in its directory.
const SOCKET_NAME: &str = "peers.sock";

/// This rank's listener for the ranks on its host.
#[derive(Debug)]
pub(crate) struct LocalListener {
    listener: UnixListener,
    path: PathBuf,
    /// Removed (with the socket) when the listener is dropped.
    _dir: tempfile::TempDir,
}

impl LocalListener {
    /// Binds a listener in a new private directory (non-blocking).
    pub(crate) fn bind() -> io::Result<LocalListener> {
        let (base, temp) = (base_dir(), std::env::temp_dir());
        let dir = match private_dir(&base) {
            Err(e) if base != temp => private_dir(&temp).map_err(|_| e)?,
            made => made?,
        };
        let path = dir.path().join(SOCKET_NAME);
        if path.as_os_str().len() > MAX_PATH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the socket path {} is longer than a Unix socket's {MAX_PATH} bytes",
                    path.display()
                ),
            ));
        }
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        Ok(LocalListener {
            listener,
            path,
            _dir: dir,
        })
    }

    /// Where the peers on this host connect.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A connection waiting to be accepted, if any (`WouldBlock` when none).
    pub(crate) fn accept(&self) -> io::Result<UnixStream> {
        self.listener.accept().map(|(s, _)| s)
    }
}

/// `$XDG_RUNTIME_DIR` when it names a directory (the user's own, 0700, cleaned at logout),
/// else the temporary directory.
fn base_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// A new directory under `base` only this user can enter: created by this call (never one
/// that existed), mode 0700, owned by this process's user, which is checked.
fn private_dir(base: &Path) -> io::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix(&dir_prefix(std::process::id()))
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(base)?;
    let meta = std::fs::metadata(dir.path())?;
    let me = leftovers::euid();
    if meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not private to this user (owner {}, mode {:o})",
                dir.path().display(),
                meta.uid(),
                meta.mode() & 0o777
            ),
        ));
    }
    Ok(dir)
}

/// The name of a rank's private directory starts with this and its pid: what
/// [`remove_local_dirs_of`] looks for.
fn dir_prefix(pid: u32) -> String {
    format!("ddp-comm-{pid}-")
}

/// Removes the private directories (and their sockets) that the rank process `pid` created for
/// its local listener and did not remove: it was killed before its mesh stood. Looks where
/// a rank's local listener creates them (`$XDG_RUNTIME_DIR`, the temporary directory). Call it
/// only for a process that has exited. Only directories owned by this process's effective user
/// and holding nothing but the socket are removed; symbolic links are never followed. An entry
/// that vanishes meanwhile is skipped; the first other error is returned, naming the path, after
/// every other entry has been tried. Returns how many were removed.
pub fn remove_local_dirs_of(pid: u32) -> io::Result<usize> {
    let (base, temp) = (base_dir(), std::env::temp_dir());
    let mut removed = remove_local_dirs_in(&base, pid)?;
    if base != temp {
        removed += remove_local_dirs_in(&temp, pid)?;
    }
    Ok(removed)
}

/// [`remove_local_dirs_of`] under `base`.
fn remove_local_dirs_in(base: &Path, pid: u32) -> io::Result<usize> {
    leftovers::remove_owned(
        base,
        &dir_prefix(pid),
        |t| t.is_dir(),
        pid,
        |dir| {
            let socket = dir.join(SOCKET_NAME);
            match std::fs::remove_file(&socket) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(leftovers::named(&socket, e)),
            }
            // Not recursive: a directory holding anything else is not ours to empty.
            std::fs::remove_dir(dir).map_err(|e| leftovers::named(dir, e))
        },
    )
}

/// How long a peer's published listener (its Unix socket, or its TCP port) may refuse
/// connections before the peer counts as gone: it bound the listener before publishing it, so
/// a refusal means it closed it (it died, or left for a later generation); a moment's grace
/// covers a full backlog.
pub(crate) const REFUSED_GRACE: Duration = Duration::from_millis(500);

/// Connects to the local socket at `path`, retrying until `deadline` (or until `superseded`
/// says the group moved on). `NotFound` at once: no such socket on this host (the peer is on
/// another host with an equal host identity); `ConnectionRefused` once nobody listened there
/// for [`REFUSED_GRACE`].
pub(crate) fn connect(
    path: &Path,
    deadline: Instant,
    superseded: &dyn Fn() -> bool,
) -> io::Result<UnixStream> {
    let addr = socket2::SockAddr::unix(path)?;
    let mut refused_since: Option<Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)
            .and_then(|s| {
                s.connect_timeout(
                    &addr,
                    left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
                )?;
                Ok(UnixStream::from(std::os::fd::OwnedFd::from(s)))
            });
        match attempt {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(e),
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, e));
            }
            // Nobody listens there any more: the peer closed its socket (it died, or left
            // for a later generation of the group).
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                let since = *refused_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= REFUSED_GRACE {
                    return Err(e);
                }
            }
            Err(_) => refused_since = None,
        }
        if superseded() {
            return Err(io::ErrorKind::Interrupted.into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A dead rank's directory (its socket inside) goes; a live name of another pid, a
    /// directory holding more than the socket, a symbolic link and another name stay.
    #[test]
    fn a_dead_rank_s_directory_is_removed_and_nothing_else() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path();
        let made = |name: &str| {
            let d = b.join(name);
            std::fs::create_dir(&d).unwrap();
            drop(UnixListener::bind(d.join(SOCKET_NAME)).unwrap());
            d
        };
        let dead = made("ddp-comm-4242-aB3xYz");
        let other_pid = made("ddp-comm-42420-aB3xYz");
        let crowded = made("ddp-comm-4242-crowded");
        std::fs::write(crowded.join("notes"), "kept").unwrap();
        let target = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(target.path(), b.join("ddp-comm-4242-link")).unwrap();
        let e = remove_local_dirs_in(b, 4242).unwrap_err();
        assert!(e.to_string().contains("crowded"), "{e}");
        assert!(!dead.exists());
        assert!(other_pid.join(SOCKET_NAME).exists());
        assert!(crowded.join("notes").exists());
        assert!(target.path().exists() && b.join("ddp-comm-4242-link").exists());
        std::fs::remove_file(crowded.join("notes")).unwrap();
        assert_eq!(remove_local_dirs_in(b, 4242).unwrap(), 1);
        assert_eq!(remove_local_dirs_in(&b.join("absent"), 4242).unwrap(), 0);
        // A listener's own directory carries its pid.
        let l = LocalListener::bind().unwrap();
        let name = l
            .path()
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        assert!(name.starts_with(&dir_prefix(std::process::id())), "{name}");
    }

    #[test]
    fn the_socket_lives_in_a_private_directory_removed_with_the_listener() {
        let l = LocalListener::bind().unwrap();
        let dir = l.path().parent().unwrap().to_path_buf();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o700, "{}", dir.display());
        // SAFETY: no preconditions.
        assert_eq!(meta.uid(), unsafe { libc::geteuid() });
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut c = connect(l.path(), deadline, &|| false).unwrap();
        c.write_all(b"hi").unwrap();
        let mut a = loop {
            match l.accept() {
                Ok(s) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no connection to accept");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("{e}"),
            }
        };
        a.set_nonblocking(false).unwrap();
        let mut got = [0u8; 2];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
        drop(l);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }

    #[test]
    fn a_socket_that_is_not_there_is_not_found_at_once() {
        let started = Instant::now();
        let e = connect(
            Path::new("/nonexistent-ddp-comm-dir/peers.sock"),
            started + Duration::from_secs(10),
            &|| false,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Run as root (as CI runs): a process of another user (`nobody`) cannot open the socket,
    /// even one whose own mode lets everyone in, which a TCP port on loopback would have let it. Not as root: only the mode is checked
    /// (by the test above), since no other user can be taken on.
    #[test]
    fn another_user_cannot_open_it() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("not root: cannot run a process as another user; mode checked elsewhere");
            return;
        }
        use std::os::unix::process::CommandExt;
        let l = LocalListener::bind().unwrap();
        // As a umask of 0 would leave it: the socket itself open to all, so that only the
        // directory keeps others out.
        std::fs::set_permissions(l.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let out = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys\n\
                 s=socket.socket(socket.AF_UNIX)\n\
                 try:\n    s.connect(sys.argv[1]); print('connected')\n\
                 except PermissionError: print('denied')",
            ])
            .arg(l.path())
            .uid(65534)
            .gid(65534)
            .output()
            .expect("python3 (CI installs it) run as user nobody");
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            said.trim(),
            "denied",
            "{said} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
