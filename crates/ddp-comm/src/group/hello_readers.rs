//! The threads that read the hellos of the connections a rank accepts at rendezvous, each
//! within its deadline, so that silent or trickling connections hold nobody else up — and so
//! that a flood of connections from one address (every local process comes from 127.0.0.1,
//! and any local user can find a rank's port in /proc/net/tcp) cannot keep the expected peers
//! out. A newcomer is always taken: when [`HelloReaders::capacity`] connections are being
//! read, one is cut to make room — the oldest that has sent nothing for [`SILENT_GRACE`], else
//! the oldest of all. A rank sends its whole hello the moment it connects, and it is read in
//! about a millisecond, so a flood must open `capacity` connections within that time to cut
//! it (256 by default: hundreds of thousands a second).

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::peer_stream::PeerStream;
use crate::refusals::Source;
use crate::wire::ReadBy;

/// How long an accepted connection has to send its whole hello (a rank sends it at once).
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a connection may have sent nothing before it is the first to be cut for a newer
/// one (a rank's hello may still be on its way just after the accept).
const SILENT_GRACE: Duration = Duration::from_millis(50);
/// The fewest connections read at once (more for a world larger than half of it).
pub(super) const MIN_CAPACITY: usize = 256;
/// Stack of a thread reading one hello.
const HELLO_STACK: usize = 128 << 10;

/// A hello read by its thread: the connection, its source, the hello (`None`: none in time,
/// or malformed).
pub(super) type ReadHello<H> = (PeerStream, Source, Option<H>);

/// One connection being read.
struct Reading {
    id: u64,
    /// A handle to cut it.
    handle: PeerStream,
    since: Instant,
    /// Its thread has read a byte of it.
    spoke: Arc<AtomicBool>,
    /// Its thread is done (its result waits in the channel): nothing left to cut.
    done: Arc<AtomicBool>,
}

impl Reading {
    /// Whether the peer has sent anything: its thread read a byte, or bytes wait unread.
    fn spoke(&self) -> bool {
        if self.spoke.load(Ordering::Relaxed) {
            return true;
        }
        let mut byte = 0u8;
        // SAFETY: recv into one valid byte of this stack frame, on a socket this value owns a
        // handle to; MSG_DONTWAIT makes this one call non-blocking without changing the
        // socket's mode (which the reading thread shares).
        let n = unsafe {
            libc::recv(
                self.handle.as_raw_fd(),
                (&raw mut byte).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n > 0
    }
}

/// A reader that marks `spoke` once its peer sent a byte.
struct Marking<'a, R> {
    inner: R,
    spoke: &'a AtomicBool,
}

impl<R: Read> Read for Marking<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 {
            self.spoke.store(true, Ordering::Relaxed);
        }
        Ok(n)
    }
}

/// The threads reading hellos, at most `capacity` at once.
pub(super) struct HelloReaders<H> {
    capacity: usize,
    parse: fn(&mut dyn Read) -> io::Result<H>,
    sender: mpsc::Sender<(u64, ReadHello<H>)>,
    receiver: mpsc::Receiver<(u64, ReadHello<H>)>,
    /// The connections being read, oldest first.
    reading: Vec<Reading>,
    next_id: u64,
}

impl<H: Send + 'static> HelloReaders<H> {
    /// Readers that read each hello with `parse`, at most `capacity` at once.
    pub(super) fn new(capacity: usize, parse: fn(&mut dyn Read) -> io::Result<H>) -> Self {
        let (sender, receiver) = mpsc::channel();
        HelloReaders {
            capacity: capacity.max(1),
            parse,
            sender,
            receiver,
            reading: Vec::new(),
            next_id: 0,
        }
    }

    /// How many connections a rank of a world of `world` reads at once.
    pub(super) fn capacity(world: usize) -> usize {
        MIN_CAPACITY.max(2 * world)
    }

    /// Starts reading the hello of `s` from `from`, within [`HELLO_TIMEOUT`] and before
    /// `deadline`. At capacity, first cuts the oldest connection silent for [`SILENT_GRACE`],
    /// else the oldest still being read. `Err`: why the connection was dropped instead.
    pub(super) fn start(
        &mut self,
        s: PeerStream,
        from: Source,
        deadline: Instant,
    ) -> std::result::Result<(), &'static str> {
        let handle = s
            .set_nonblocking(false)
            .and_then(|()| s.set_write_timeout(Some(Duration::from_secs(1))))
            .and_then(|()| s.try_clone())
            .map_err(|_| "a socket error")?;
        // Connections whose hello is read wait in the channel: nothing left to cut.
        let candidates: Vec<usize> = (0..self.reading.len())
            .filter(|&i| !self.reading[i].done.load(Ordering::Relaxed))
            .collect();
        if candidates.len() >= self.capacity {
            let silent = candidates.iter().copied().find(|&i| {
                let r = &self.reading[i];
                r.since.elapsed() >= SILENT_GRACE && !r.spoke()
            });
            if let Some(cut) = silent.or(candidates.first().copied()) {
                let _ = self
                    .reading
                    .remove(cut)
                    .handle
                    .shutdown(std::net::Shutdown::Both);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let sender = self.sender.clone();
        let parse = self.parse;
        let spoke = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
        {
            let (spoke, done) = (Arc::clone(&spoke), Arc::clone(&done));
            std::thread::Builder::new()
                .name("ddp-hello".into())
                .stack_size(HELLO_STACK)
                .spawn(move || {
                    let mut reader = Marking {
                        inner: ReadBy::new(&s, by),
                        spoke: &spoke,
                    };
                    let hello = parse(&mut reader).ok();
                    done.store(true, Ordering::Relaxed);
                    let _ = sender.send((id, (s, from, hello)));
                })
                .map_err(|_| "no thread to read its hello")?;
        }
        self.reading.push(Reading {
            id,
            handle,
            since: Instant::now(),
            spoke,
            done,
        });
        Ok(())
    }

    /// A hello read (or failed) since the last call, if any.
    pub(super) fn finished(&mut self) -> Option<ReadHello<H>> {
        let (id, read) = self.receiver.try_recv().ok()?;
        self.reading.retain(|r| r.id != id);
        Some(read)
    }

    /// Cuts every connection still being read (their threads then end at once).
    pub(super) fn cut_all(&mut self) {
        for r in self.reading.drain(..) {
            let _ = r.handle.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    /// The next connection to `listener`, as the mesh hands it over.
    fn accept(listener: &TcpListener) -> (PeerStream, Source) {
        let (s, from) = listener.accept().unwrap();
        (PeerStream::Tcp(s), from.ip().into())
    }

    fn read_line(r: &mut dyn Read) -> io::Result<String> {
        let mut buf = [0u8; 5];
        r.read_exact(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Reads connections until `peer_hello` is read (or 5 s pass).
    fn read_until_hello(readers: &mut HelloReaders<String>, what: &str) {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            assert!(Instant::now() < until, "{what}: the hello was never read");
            match readers.finished() {
                Some((_, _, Some(h))) => {
                    assert_eq!(h, "hello");
                    return;
                }
                Some((_, _, None)) => {}
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }

    /// Floods from one address, faster than anything is read: silent connections, and
    /// connections that sent part of a hello and stall. The peer that speaks at once is taken every time and read; the flood's
    /// connections are the ones cut.
    #[test]
    fn a_flood_from_one_address_never_keeps_a_speaking_peer_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut readers = HelloReaders::new(8, read_line);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut flood = Vec::new();
        for round in 0..6 {
            let stalling = round % 2 == 1;
            let mut connect = |readers: &mut HelloReaders<String>| {
                let mut c = TcpStream::connect(addr).unwrap();
                if stalling {
                    c.write_all(b"he").unwrap();
                }
                flood.push(c);
                let (s, from) = accept(&listener);
                assert_eq!(readers.start(s, from, deadline), Ok(()), "round {round}");
            };
            // Capacity filled, all younger than any grace period.
            for _ in 0..8 {
                connect(&mut readers);
            }
            let mut peer = TcpStream::connect(addr).unwrap();
            peer.write_all(b"hello").unwrap();
            let (s, from) = accept(&listener);
            assert_eq!(readers.start(s, from, deadline), Ok(()), "round {round}");
            // More come while it is read (fewer than the capacity: it is not the oldest).
            for _ in 0..4 {
                connect(&mut readers);
            }
            read_until_hello(&mut readers, &format!("round {round}"));
        }
        readers.cut_all();
    }
}
