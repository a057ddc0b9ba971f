//! Shared-memory byte rings between two ranks of one host.
//!
//! One file in `/dev/shm` per pair of ranks holds two single-producer single-consumer rings,
//! one per direction. The higher rank creates the file (`/dev/shm/ddp-pg-{pid}-…`, mode 0600),
//! the lower rank maps it during the handshake, and the creator unlinks it as soon as both have
//! mapped it, so nothing is left behind even if a rank is killed later. The creator holds the
//! file as a [`SegmentFile`], which unlinks it when dropped: on every way out of the handshake,
//! an error or a panic included. Only a process killed between creating a segment and the
//! peer's reply leaves it behind; the launcher removes a dead rank's segments with
//! [`remove_segments_of`].
//!
//! The lower rank maps a segment only when it is this user's: the path must be a
//! `/dev/shm/ddp-pg-*` name, the file is opened without following a symbolic link and must be a
//! regular file owned by this process's effective user, of mode exactly 0600 and of the size its
//! header gives ([`ShmPair::open`]). The handshake takes an offer only over a Unix socket (a
//! peer on this host, see `mesh`).
//!
//! Each ring is a byte stream: the producer copies into free space and publishes a new `head`,
//! the consumer reads and publishes a new `tail`. Both positions only grow. Waiting sides park on
//! a futex (`data_seq` / `space_seq`) after a short spin; the other side wakes them only when a
//! `*_waiting` flag says somebody sleeps, so the fast path has no system call.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapMut, MmapOptions};

use super::leftovers::{self, describe, euid};

/// Default bytes of data in each ring (a multiple of 8). `DDP_SHM_RING_KIB` overrides it on
/// the creating side; the other side reads the size from the segment.
pub(crate) const RING_CAPACITY: usize = 512 * 1024;
/// Most bytes moved by one `write`/`read` call, so producer and consumer interleave.
pub(crate) const MAX_STEP: usize = 64 * 1024;
/// The largest ring `DDP_SHM_RING_KIB` may ask for, in KiB (1 GiB).
const MAX_RING_KIB: usize = 1 << 20;

const FILE_MAGIC: u64 = 0x6464_705f_7368_6d31; // "ddp_shm1"
const FILE_HEADER: usize = 64;
const RING_HEADER: usize = 256;

fn ring_capacity() -> usize {
    std::env::var("DDP_SHM_RING_KIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&k| (64..=MAX_RING_KIB).contains(&k))
        .map_or(RING_CAPACITY, |k| k * 1024)
}

fn file_bytes(cap: usize) -> usize {
    FILE_HEADER + 2 * (RING_HEADER + cap)
}

// Offsets inside a ring header (each group on its own cache line).
const OFF_HEAD: usize = 0;
const OFF_DATA_SEQ: usize = 8;
const OFF_READER_WAITING: usize = 12;
const OFF_TAIL: usize = 64;
const OFF_SPACE_SEQ: usize = 72;
const OFF_WRITER_WAITING: usize = 76;
const OFF_CLOSED: usize = 128;

/// Where shared-memory files live.
const SHM_DIR: &str = "/dev/shm";
/// Prefix of every file this module creates.
const SHM_PREFIX: &str = "ddp-pg-";
/// The only mode a segment may have.
const SEGMENT_MODE: u32 = 0o600;

/// The file name of a segment process `pid` creates for its rank `creator` and the peer `peer`
/// (`unique` makes it new): `ddp-pg-{pid}-{creator}-{peer}-{unique}`. [`remove_segments_of`]
/// relies on the `ddp-pg-{pid}-` prefix.
fn segment_name(pid: u32, creator: usize, peer: usize, unique: &str) -> String {
    format!("{SHM_PREFIX}{pid}-{creator}-{peer}-{unique}")
}

/// The prefix of every segment process `pid` creates.
fn segment_prefix(pid: u32) -> String {
    format!("{SHM_PREFIX}{pid}-")
}

#[cfg(test)]
thread_local! {
    /// The segments created on this thread (the tests check that none is left behind).
    static CREATED: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The paths of the segments created on this thread since the last call.
#[cfg(test)]
pub(crate) fn created_on_this_thread() -> Vec<PathBuf> {
    CREATED.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// A segment file this process created: unlinked when dropped (once the peer has mapped it, or
/// on any failure, a panic included).
#[derive(Debug)]
pub(crate) struct SegmentFile {
    path: PathBuf,
}

impl SegmentFile {
    /// Where it is (offered to the peer in the hello).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => tracing::debug!(
                "shared-memory segment {} was already removed",
                self.path.display()
            ),
            Err(e) => tracing::warn!(
                "could not remove shared-memory segment {}: {e}",
                self.path.display()
            ),
        }
    }
}

/// Why a segment offered by a peer is not mapped ([`ShmPair::open`]).
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The path is not a `/dev/shm/ddp-pg-*` name.
    NotASegmentPath,
    /// The path is a symbolic link.
    SymbolicLink,
    /// Not a regular file (what it is instead).
    NotRegular(&'static str),
    /// Owned by another user.
    Owner {
        /// The file's owner.
        owner: u32,
        /// This process's effective user.
        me: u32,
    },
    /// A mode other than 0600 (its permission bits).
    Mode(u32),
    /// A size no segment has.
    Size(u64),
    /// Not laid out as this version lays out a segment.
    Layout,
    /// It could not be opened, examined or mapped.
    Io(io::Error),
}

/// A segment offered by a peer that was not mapped: its path and why.
#[derive(Debug)]
pub(crate) struct OpenError {
    /// The path offered.
    pub path: String,
    /// What is wrong with it.
    pub refusal: Refusal,
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shared-memory segment {:?}: ", self.path)?;
        match &self.refusal {
            Refusal::NotASegmentPath => write!(f, "not a {SHM_DIR}/{SHM_PREFIX}* path"),
            Refusal::SymbolicLink => write!(f, "a symbolic link (not followed)"),
            Refusal::NotRegular(what) => write!(f, "not a regular file but {what}"),
            Refusal::Owner { owner, me } => {
                write!(f, "owned by uid {owner}, not by this user (uid {me})")
            }
            Refusal::Mode(mode) => write!(f, "mode {mode:04o}, not {SEGMENT_MODE:04o}"),
            Refusal::Size(size) => write!(f, "{size} bytes, no segment's size"),
            Refusal::Layout => {
                write!(f, "a different layout (another ddp-comm version?)")
            }
            Refusal::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for OpenError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.refusal {
            Refusal::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// Removes the shared-memory segments process `pid` created (`/dev/shm/ddp-pg-{pid}-*`) and
/// returns how many it removed.
///
/// For the launcher, once it has reaped a rank: a rank unlinks its segments itself on every way
/// out of its handshake, but one killed in the middle of a handshake leaves those it created
/// behind, and only this removes them. Call it only for a process that has exited (it removes
/// the segments of a live one too, breaking its handshake).
///
/// Only regular files owned by this process's effective user are removed; symbolic links
/// (never followed), directories and other users' files are left alone. An entry that vanishes
/// meanwhile is skipped. The first other error is returned, naming the path, after every other
/// entry has been tried; no `/dev/shm` at all is `Ok(0)`.
pub fn remove_segments_of(pid: u32) -> io::Result<usize> {
    remove_segments_in(Path::new(SHM_DIR), pid)
}

/// [`remove_segments_of`] in the directory `dir`.
fn remove_segments_in(dir: &Path, pid: u32) -> io::Result<usize> {
    leftovers::remove_owned(
        dir,
        &segment_prefix(pid),
        |t| t.is_file(),
        pid,
        |path| std::fs::remove_file(path).map_err(|e| leftovers::named(path, e)),
    )
}

/// One direction of a pair: a view into the mapping.
struct Ring {
    base: *mut u8,
    cap: usize,
}

impl Ring {
    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: the offset is inside the ring header, 8-byte aligned (the mapping is page
        // aligned), and the mapping outlives every `Ring` (both live in `ShmPair`).
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as above, 4-byte aligned.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }
    fn head(&self) -> &AtomicU64 {
        self.atomic_u64(OFF_HEAD)
    }
    fn tail(&self) -> &AtomicU64 {
        self.atomic_u64(OFF_TAIL)
    }
    fn data_seq(&self) -> &AtomicU32 {
        self.atomic_u32(OFF_DATA_SEQ)
    }
    fn reader_waiting(&self) -> &AtomicU32 {
        self.atomic_u32(OFF_READER_WAITING)
    }
    fn space_seq(&self) -> &AtomicU32 {
        self.atomic_u32(OFF_SPACE_SEQ)
    }
    fn writer_waiting(&self) -> &AtomicU32 {
        self.atomic_u32(OFF_WRITER_WAITING)
    }
    fn closed(&self) -> &AtomicU32 {
        self.atomic_u32(OFF_CLOSED)
    }
    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.base.add(RING_HEADER) }
    }

    /// `code` 1 = closed; `2 + r` = closed because rank `r` failed. The first blame stays: a
    /// rank that drops its group right after failing (closing everything again, blaming no
    /// one) must not erase the culprit before the peer has read it.
    fn close(&self, code: u32) {
        let _ = self
            .closed()
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| match now {
                0 => Some(code),
                1 if code >= 2 => Some(code),
                _ => None,
            });
        self.data_seq().fetch_add(1, Ordering::SeqCst);
        self.space_seq().fetch_add(1, Ordering::SeqCst);
        futex_wake(self.data_seq());
        futex_wake(self.space_seq());
    }
}

/// The two rings shared with one peer: `tx` we produce into, `rx` we consume from.
pub(crate) struct ShmPair {
    _map: MmapMut,
    tx: Ring,
    rx: Ring,
}

// SAFETY: the raw pointers point into `_map`, which moves with the struct; all cross-process
// state is accessed through atomics, and each ring has exactly one producer and one consumer.
unsafe impl Send for ShmPair {}

/// The result of trying to read: bytes available, nothing yet, or the peer closed the ring.
pub(crate) enum Avail {
    Bytes(usize),
    Empty,
    Closed,
}

impl ShmPair {
    /// Creates a new segment for the pair (`creator` → `peer`); returns it with its file,
    /// which unlinks it when dropped.
    pub(crate) fn create(creator: usize, peer: usize) -> io::Result<(Self, SegmentFile)> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let unique = format!("{nanos:08x}{:08x}", rand::random::<u32>());
        let name = segment_name(std::process::id(), creator, peer, &unique);
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(SEGMENT_MODE)
            .open(&path)?;
        #[cfg(test)]
        CREATED.with(|c| c.borrow_mut().push(path.clone()));
        let cap = ring_capacity();
        let setup = || -> io::Result<MmapMut> {
            // Exactly 0600 whatever the umask (the peer refuses any other mode).
            file.set_permissions(std::fs::Permissions::from_mode(SEGMENT_MODE))?;
            file.set_len(file_bytes(cap) as u64)?;
            let mut map = map_file(&file, file_bytes(cap))?;
            map[..8].copy_from_slice(&FILE_MAGIC.to_le_bytes());
            map[8..16].copy_from_slice(&(cap as u64).to_le_bytes());
            Ok(map)
        };
        // From here on the file is removed when `segment` drops, a failed setup included.
        let segment = SegmentFile { path };
        // The creator produces into ring 0 and consumes from ring 1.
        Ok((Self::from_map(setup()?, 0, cap), segment))
    }

    /// Maps a segment created by the peer (the path came over the authenticated handshake, on
    /// this host's Unix socket) if it is this user's own: a `/dev/shm/ddp-pg-*` path, opened
    /// without following a symbolic link, a regular file owned by this process's effective
    /// user, of mode exactly 0600, of the size its header gives. Refused otherwise, saying why.
    pub(crate) fn open(path: &str) -> Result<Self, OpenError> {
        let refused = |refusal| OpenError {
            path: path.to_string(),
            refusal,
        };
        let p = Path::new(path);
        let valid = p.parent() == Some(Path::new(SHM_DIR))
            && p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(SHM_PREFIX) && !n.contains(".."));
        if !valid {
            return Err(refused(Refusal::NotASegmentPath));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            // No symbolic link, and no wait on a FIFO put in its place.
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(p)
            .map_err(|e| {
                refused(match e.raw_os_error() {
                    Some(libc::ELOOP) => Refusal::SymbolicLink,
                    Some(libc::EISDIR) => Refusal::NotRegular("a directory"),
                    _ => Refusal::Io(e),
                })
            })?;
        // fstat of what was opened: no path is looked up again.
        let meta = file.metadata().map_err(|e| refused(Refusal::Io(e)))?;
        if !meta.file_type().is_file() {
            return Err(refused(Refusal::NotRegular(describe(meta.file_type()))));
        }
        let me = euid();
        if meta.uid() != me {
            return Err(refused(Refusal::Owner {
                owner: meta.uid(),
                me,
            }));
        }
        if meta.mode() & 0o7777 != SEGMENT_MODE {
            return Err(refused(Refusal::Mode(meta.mode() & 0o7777)));
        }
        let size = meta.len();
        if size < FILE_HEADER as u64 || size > file_bytes(MAX_RING_KIB * 1024) as u64 {
            return Err(refused(Refusal::Size(size)));
        }
        let size = size as usize;
        let map = map_file(&file, size).map_err(|e| refused(Refusal::Io(e)))?;
        let magic = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        let cap = u64::from_le_bytes(map[8..16].try_into().expect("8 bytes")) as usize;
        if magic != FILE_MAGIC || !cap.is_multiple_of(8) || cap == 0 {
            return Err(refused(Refusal::Layout));
        }
        if cap > MAX_RING_KIB * 1024 || file_bytes(cap) != size {
            return Err(refused(Refusal::Size(size as u64)));
        }
        Ok(Self::from_map(map, 1, cap))
    }

    fn from_map(mut map: MmapMut, tx_index: usize, cap: usize) -> Self {
        let base = map.as_mut_ptr();
        // SAFETY: both rings lie inside the mapping (file_bytes(cap) long).
        let ring = |i: usize| Ring {
            base: unsafe { base.add(FILE_HEADER + i * (RING_HEADER + cap)) },
            cap,
        };
        ShmPair {
            tx: ring(tx_index),
            rx: ring(1 - tx_index),
            _map: map,
        }
    }

    /// Copies as much of `data` as fits (at most [`MAX_STEP`]); returns the bytes written.
    /// `Err` when the peer closed its end.
    pub(crate) fn write(&self, data: &[u8]) -> Result<usize, ()> {
        let r = &self.tx;
        if r.closed().load(Ordering::Relaxed) != 0 {
            return Err(());
        }
        let head = r.head().load(Ordering::Relaxed);
        let tail = r.tail().load(Ordering::Acquire);
        let used = (head - tail) as usize;
        let pos = (head % r.cap as u64) as usize;
        let n = data.len().min(r.cap - used).min(r.cap - pos).min(MAX_STEP);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: [pos, pos+n) is free space owned by the producer until `head` moves.
        let dst = unsafe { std::slice::from_raw_parts_mut(r.data().add(pos), n) };
        super::copy::copy(dst, &data[..n]);
        r.head().store(head + n as u64, Ordering::SeqCst);
        r.data_seq().fetch_add(1, Ordering::SeqCst);
        if r.reader_waiting().load(Ordering::SeqCst) != 0 {
            futex_wake(r.data_seq());
        }
        Ok(n)
    }

    /// How many contiguous bytes can be read now (at most `max` and [`MAX_STEP`]).
    pub(crate) fn readable(&self, max: usize) -> Avail {
        let r = &self.rx;
        let head = r.head().load(Ordering::Acquire);
        let tail = r.tail().load(Ordering::Relaxed);
        let avail = (head - tail) as usize;
        if avail == 0 {
            if r.closed().load(Ordering::Acquire) != 0 {
                // Data written before the close has been read; nothing more will come.
                if r.head().load(Ordering::Acquire) == tail {
                    return Avail::Closed;
                }
            }
            return Avail::Empty;
        }
        let pos = (tail % r.cap as u64) as usize;
        Avail::Bytes(avail.min(r.cap - pos).min(max).min(MAX_STEP))
    }

    /// The `n` readable bytes at the read position (call after [`Self::readable`]).
    pub(crate) fn peek(&self, n: usize) -> &[u8] {
        let r = &self.rx;
        let tail = r.tail().load(Ordering::Relaxed);
        let pos = (tail % r.cap as u64) as usize;
        debug_assert!(pos + n <= r.cap);
        // SAFETY: `readable` said these bytes are published by the producer (Acquire on head)
        // and they stay ours until `consume` moves the tail.
        unsafe { std::slice::from_raw_parts(r.data().add(pos), n) }
    }

    /// Releases `n` bytes after reading them.
    pub(crate) fn consume(&self, n: usize) {
        let r = &self.rx;
        let tail = r.tail().load(Ordering::Relaxed);
        r.tail().store(tail + n as u64, Ordering::SeqCst);
        r.space_seq().fetch_add(1, Ordering::SeqCst);
        if r.writer_waiting().load(Ordering::SeqCst) != 0 {
            futex_wake(r.space_seq());
        }
    }

    /// Sleeps until data arrives in `rx`, the peer closes, or `timeout` passes.
    pub(crate) fn wait_data(&self, timeout: Duration) {
        let r = &self.rx;
        r.reader_waiting().store(1, Ordering::SeqCst);
        let seq = r.data_seq().load(Ordering::SeqCst);
        let idle = r.head().load(Ordering::SeqCst) == r.tail().load(Ordering::Relaxed)
            && r.closed().load(Ordering::SeqCst) == 0;
        if idle {
            futex_wait(r.data_seq(), seq, timeout);
        }
        r.reader_waiting().store(0, Ordering::SeqCst);
    }

    /// Sleeps until space frees up in `tx`, the peer closes, or `timeout` passes.
    pub(crate) fn wait_space(&self, timeout: Duration) {
        let r = &self.tx;
        r.writer_waiting().store(1, Ordering::SeqCst);
        let seq = r.space_seq().load(Ordering::SeqCst);
        let full = (r.head().load(Ordering::Relaxed) - r.tail().load(Ordering::SeqCst)) as usize
            == r.cap
            && r.closed().load(Ordering::SeqCst) == 0;
        if full {
            futex_wait(r.space_seq(), seq, timeout);
        }
        r.writer_waiting().store(0, Ordering::SeqCst);
    }

    /// Marks both directions closed and wakes the peer (on error and on drop); `blame` is
    /// the rank whose failure caused it, passed on to the peer.
    pub(crate) fn close(&self, blame: Option<usize>) {
        let code = blame.map_or(1, |r| r as u32 + 2);
        self.tx.close(code);
        self.rx.close(code);
    }

    /// The rank the peer blamed when it closed the rings, if any.
    pub(crate) fn blame(&self) -> Option<usize> {
        let code = self.rx.closed().load(Ordering::Acquire);
        (code >= 2).then(|| (code - 2) as usize)
    }
}

impl Drop for ShmPair {
    fn drop(&mut self) {
        // Keep a blame set by `abort`; otherwise mark a plain close.
        if self.tx.closed().load(Ordering::Relaxed) == 0 {
            self.close(None);
        }
    }
}

fn map_file(file: &File, len: usize) -> io::Result<MmapMut> {
    // SAFETY: the file is a private /dev/shm segment of `len` bytes; the only other process
    // mapping it is the peer, and all shared state is accessed through atomics.
    unsafe { MmapOptions::new().len(len).populate().map_mut(file) }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 in a shared mapping; FUTEX_WAIT only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above; FUTEX_WAKE does not touch memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_through_a_pair_across_threads() {
        let (a, file) = ShmPair::create(1, 0).unwrap();
        let path = file.path().to_path_buf();
        let b = ShmPair::open(path.to_str().unwrap()).unwrap();
        drop(file);
        assert!(!path.exists());
        let total = 3 * RING_CAPACITY + 12345;
        let data: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
        let expect = data.clone();
        let t = std::thread::spawn(move || {
            let mut sent = 0;
            while sent < data.len() {
                let n = a.write(&data[sent..]).unwrap();
                if n == 0 {
                    a.wait_space(Duration::from_millis(10));
                }
                sent += n;
            }
            a
        });
        let mut got = Vec::with_capacity(total);
        while got.len() < total {
            match b.readable(usize::MAX) {
                Avail::Bytes(n) => {
                    got.extend_from_slice(b.peek(n));
                    b.consume(n);
                }
                Avail::Empty => b.wait_data(Duration::from_millis(10)),
                Avail::Closed => panic!("closed early"),
            }
        }
        assert_eq!(got, expect);
        let a = t.join().unwrap();
        drop(a);
        assert!(matches!(b.readable(usize::MAX), Avail::Closed));
        assert!(b.write(&[1]).is_err());
    }

    #[test]
    fn refuses_foreign_paths() {
        for path in ["/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/other"] {
            let e = ShmPair::open(path).err().expect(path);
            assert!(matches!(e.refusal, Refusal::NotASegmentPath), "{path}: {e}");
            assert!(e.to_string().contains(path), "{e}");
        }
    }

    /// A fresh name under `/dev/shm` with this process's segment prefix.
    fn scratch_name(what: &str) -> PathBuf {
        Path::new(SHM_DIR).join(segment_name(
            std::process::id(),
            9,
            9,
            &format!("{what}-{:016x}", rand::random::<u64>()),
        ))
    }

    /// Removes what a test put under `/dev/shm`, whatever it is.
    struct Scratch(Vec<PathBuf>);

    impl Drop for Scratch {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_file(p).or_else(|_| std::fs::remove_dir(p));
            }
        }
    }

    /// Running as root (as CI runs): a file of user `nobody`; else `None` (no other user can
    /// own a file this process makes).
    fn chown_to_nobody(path: &Path) -> Option<()> {
        if euid() != 0 {
            return None;
        }
        std::os::unix::fs::lchown(path, Some(65534), Some(65534)).unwrap();
        Some(())
    }

    fn refusal_of(path: &Path) -> Refusal {
        match ShmPair::open(path.to_str().unwrap()) {
            Ok(_) => panic!("{} was mapped", path.display()),
            Err(e) => {
                assert!(
                    e.to_string().contains(path.to_str().unwrap()),
                    "the error names the path: {e}"
                );
                e.refusal
            }
        }
    }

    /// A segment is mapped only when it is this user's own regular file of mode 0600: a
    /// symbolic link (to a valid segment), a file of mode 0644, a directory and (as root) a
    /// file of another user are each refused, saying why; the segment itself is accepted.
    #[test]
    fn only_this_users_own_segment_of_mode_0600_is_opened() {
        let (_creator, file) = ShmPair::create(9, 9).unwrap();
        let segment = file.path().to_path_buf();
        let mut scratch = Scratch(Vec::new());

        // The segment as created: accepted.
        let meta = std::fs::metadata(&segment).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o600);
        ShmPair::open(segment.to_str().unwrap()).expect("our own segment is mapped");

        // A symbolic link to it, under a valid name: not followed.
        let link = scratch_name("link");
        scratch.0.push(link.clone());
        std::os::unix::fs::symlink(&segment, &link).unwrap();
        assert!(matches!(refusal_of(&link), Refusal::SymbolicLink));

        // A directory.
        let dir = scratch_name("dir");
        scratch.0.push(dir.clone());
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o600)).unwrap();
        let r = refusal_of(&dir);
        assert!(matches!(r, Refusal::NotRegular("a directory")), "{r:?}");

        // A copy of the segment, ours, of mode 0644 (or 0640, 0606, 0700).
        let copy = scratch_name("mode");
        scratch.0.push(copy.clone());
        std::fs::copy(&segment, &copy).unwrap();
        for mode in [0o644, 0o640, 0o606, 0o700, 0o4600] {
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = refusal_of(&copy);
            assert!(
                matches!(r, Refusal::Mode(m) if m == mode),
                "{mode:o}: {r:?}"
            );
        }
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600)).unwrap();
        ShmPair::open(copy.to_str().unwrap()).expect("the copy at 0600 is mapped");

        // Of the wrong size for its header.
        let f = OpenOptions::new().write(true).open(&copy).unwrap();
        f.set_len(std::fs::metadata(&copy).unwrap().len() - 8)
            .unwrap();
        let r = refusal_of(&copy);
        assert!(matches!(r, Refusal::Size(_)), "{r:?}");

        // Of another user, mode 0600.
        let foreign = scratch_name("owner");
        scratch.0.push(foreign.clone());
        std::fs::copy(&segment, &foreign).unwrap();
        std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o600)).unwrap();
        if chown_to_nobody(&foreign).is_some() {
            let r = refusal_of(&foreign);
            assert!(
                matches!(
                    r,
                    Refusal::Owner {
                        owner: 65534,
                        me: 0
                    }
                ),
                "{r:?}"
            );
        } else {
            // Not root: no file of another user can be made here; the owner check is the
            // same comparison of `st_uid` with the effective user as the mode's.
            eprintln!("not root: the case of another user's file is skipped");
        }
    }

    /// A fake pid no process can have (Linux pids stay below 2^22), fresh for each test.
    fn fake_pid() -> u32 {
        4_000_000_000 + rand::random::<u32>() % 100_000_000
    }

    /// `remove_segments_of(pid)` removes that process's segments (regular files of this user
    /// named `ddp-pg-{pid}-…`) and nothing else: not another pid's, not one whose pid only
    /// starts alike, not a symbolic link (nor what it points to), not a directory, not (as
    /// root) another user's file.
    #[test]
    fn the_segments_of_a_dead_process_are_removed_and_nothing_else() {
        let pid = fake_pid();
        let dir = Path::new(SHM_DIR);
        let at = |name: String| dir.join(name);
        let make = |p: &Path| {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(SEGMENT_MODE)
                .open(p)
                .unwrap();
        };
        let ours = [
            at(segment_name(pid, 1, 0, "0123456789abcdef")),
            at(segment_name(pid, 3, 2, "fedcba9876543210")),
        ];
        for p in &ours {
            make(p);
        }
        let target = at(segment_name(pid + 1, 1, 0, "target"));
        let mut kept = vec![
            at(segment_name(pid + 1, 1, 0, "other-pid")),
            at(format!("{SHM_PREFIX}{pid}0-1-0-longer-pid")),
            target.clone(),
        ];
        for p in &kept {
            make(p);
        }
        let link = at(segment_name(pid, 1, 0, "link"));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let subdir = at(segment_name(pid, 1, 0, "dir"));
        std::fs::create_dir(&subdir).unwrap();
        kept.extend([link.clone(), subdir.clone()]);
        let foreign = at(segment_name(pid, 1, 0, "nobody"));
        make(&foreign);
        if chown_to_nobody(&foreign).is_some() {
            kept.push(foreign.clone());
        } else {
            // Not root: no file of another user can be made here.
            eprintln!("not root: the case of another user's file is skipped");
            std::fs::remove_file(&foreign).unwrap();
        }
        let _scratch = Scratch(ours.iter().chain(&kept).cloned().collect());

        let removed = remove_segments_of(pid).unwrap();
        for p in &ours {
            assert!(!p.exists(), "{} left behind", p.display());
        }
        for p in &kept {
            assert!(
                std::fs::symlink_metadata(p).is_ok(),
                "{} was removed",
                p.display()
            );
        }
        assert_eq!(removed, ours.len());
        assert_eq!(
            remove_segments_of(pid).unwrap(),
            0,
            "nothing left to remove"
        );
    }

    /// A directory that does not exist holds no segment; one that cannot be read is an error
    /// naming it.
    #[test]
    fn removing_in_a_missing_directory_removes_nothing() {
        let missing = Path::new("/nonexistent-ddp-comm-shm");
        assert_eq!(remove_segments_in(missing, 1).unwrap(), 0);
        let file = tempfile::NamedTempFile::new().unwrap();
        let e = remove_segments_in(file.path(), 1).unwrap_err();
        assert!(e.to_string().contains(file.path().to_str().unwrap()), "{e}");
    }
}
