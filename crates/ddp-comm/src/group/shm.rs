//! Shared-memory byte rings between two ranks of one host.
//!
//! One file in `/dev/shm` per pair of ranks holds two single-producer single-consumer rings,
//! one per direction. The higher rank creates the file, the lower rank maps it during the
//! handshake, and the creator unlinks it as soon as both have mapped it, so nothing is left
//! behind even if a rank is killed later.
//!
//! Each ring is a byte stream: the producer copies into free space and publishes a new `head`,
//! the consumer reads and publishes a new `tail`. Both positions only grow. Waiting sides park on
//! a futex (`data_seq` / `space_seq`) after a short spin; the other side wakes them only when a
//! `*_waiting` flag says somebody sleeps, so the fast path has no system call.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapMut, MmapOptions};

/// Default bytes of data in each ring (a multiple of 8). `DDP_SHM_RING_KIB` overrides it on
/// the creating side; the other side reads the size from the segment.
pub(crate) const RING_CAPACITY: usize = 512 * 1024;
/// Most bytes moved by one `write`/`read` call, so producer and consumer interleave.
pub(crate) const MAX_STEP: usize = 64 * 1024;

const FILE_MAGIC: u64 = 0x6464_705f_7368_6d31; // "ddp_shm1"
const FILE_HEADER: usize = 64;
const RING_HEADER: usize = 256;

fn ring_capacity() -> usize {
    std::env::var("DDP_SHM_RING_KIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&k| (64..=1 << 20).contains(&k))
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
    /// Creates a new segment for the pair (`creator` → `peer`); returns it with its path.
    pub(crate) fn create(creator: usize, peer: usize) -> io::Result<(Self, PathBuf)> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "{SHM_PREFIX}{}-{creator}-{peer}-{nanos:08x}{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let cap = ring_capacity();
        let setup = || -> io::Result<MmapMut> {
            file.set_len(file_bytes(cap) as u64)?;
            let mut map = map_file(&file, file_bytes(cap))?;
            map[..8].copy_from_slice(&FILE_MAGIC.to_le_bytes());
            map[8..16].copy_from_slice(&(cap as u64).to_le_bytes());
            Ok(map)
        };
        match setup() {
            // The creator produces into ring 0 and consumes from ring 1.
            Ok(map) => Ok((Self::from_map(map, 0, cap), path)),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Maps a segment created by the peer (the path came over the authenticated handshake).
    pub(crate) fn open(path: &str) -> io::Result<Self> {
        let p = Path::new(path);
        let valid = p.parent() == Some(Path::new(SHM_DIR))
            && p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(SHM_PREFIX) && !n.contains(".."));
        if !valid {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a process-group segment: {path}"),
            ));
        }
        let file = OpenOptions::new().read(true).write(true).open(p)?;
        let size = file.metadata()?.len() as usize;
        if size < FILE_HEADER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared-memory segment is too small",
            ));
        }
        let map = map_file(&file, size)?;
        let magic = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        let cap = u64::from_le_bytes(map[8..16].try_into().expect("8 bytes")) as usize;
        if magic != FILE_MAGIC || !cap.is_multiple_of(8) || cap == 0 || file_bytes(cap) != size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared-memory segment has a different layout (another ddp-comm version?)",
            ));
        }
        Ok(Self::from_map(map, 1, cap))
    }

    /// Removes a segment file (after both sides mapped it, or on failure).
    pub(crate) fn unlink(path: &Path) {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(
                "could not remove shared-memory segment {}: {e}",
                path.display()
            );
        }
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
        let (a, path) = ShmPair::create(1, 0).unwrap();
        let b = ShmPair::open(path.to_str().unwrap()).unwrap();
        ShmPair::unlink(&path);
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
        assert!(ShmPair::open("/etc/passwd").is_err());
        assert!(ShmPair::open("/dev/shm/../etc/passwd").is_err());
    }
}
