//! The threads that read the hellos of the connections a rank accepts at rendezvous, each
//! within its deadline, so that silent or trickling connections hold nobody else up — and so
//! that a flood of silent connections from one address (every local process comes from
//! 127.0.0.1) cannot keep the expected peers out: when an address's share is full, a
//! connection that has sent nothing yet makes room first, whatever its age. A rank sends its
//! hello the moment it connects, so its bytes are there (or read) by then.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::wire::ReadBy;

/// How long an accepted connection has to send its whole hello (a rank sends it at once).
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a connection that has sent part of a hello is left before a newer one from the
/// same address may take its place.
const MIN_HELLO_GRACE: Duration = Duration::from_millis(100);
/// Stack of a thread reading one hello.
const HELLO_STACK: usize = 128 << 10;

/// A hello read by its thread: the connection, its source, the hello (`None`: none in time,
/// or malformed).
pub(super) type ReadHello<H> = (TcpStream, SocketAddr, Option<H>);

/// One connection being read.
struct Reading {
    id: u64,
    /// A handle to cut it.
    handle: TcpStream,
    since: Instant,
    /// Its thread has read a byte of it.
    spoke: Arc<AtomicBool>,
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

/// The threads reading hellos, at most `per_source` per address.
pub(super) struct HelloReaders<H> {
    per_source: usize,
    parse: fn(&mut dyn Read) -> io::Result<H>,
    sender: mpsc::Sender<(u64, ReadHello<H>)>,
    receiver: mpsc::Receiver<(u64, ReadHello<H>)>,
    /// Per address, the connections being read, oldest first.
    reading: HashMap<IpAddr, Vec<Reading>>,
    next_id: u64,
}

impl<H: Send + 'static> HelloReaders<H> {
    /// Readers that read each hello with `parse`, at most `per_source` at once per address.
    pub(super) fn new(per_source: usize, parse: fn(&mut dyn Read) -> io::Result<H>) -> Self {
        let (sender, receiver) = mpsc::channel();
        HelloReaders {
            per_source,
            parse,
            sender,
            receiver,
            reading: HashMap::new(),
            next_id: 0,
        }
    }

    /// Starts reading the hello of `s` from `from`, within [`HELLO_TIMEOUT`] and before
    /// `deadline`. Past the address's share, the oldest connection that has sent nothing is
    /// cut; when every one has sent something, the oldest once it had [`MIN_HELLO_GRACE`].
    /// `Err`: why the connection was dropped instead.
    pub(super) fn start(
        &mut self,
        s: TcpStream,
        from: SocketAddr,
        deadline: Instant,
    ) -> std::result::Result<(), &'static str> {
        let handle = s
            .set_nonblocking(false)
            .and_then(|()| s.set_write_timeout(Some(Duration::from_secs(1))))
            .and_then(|()| s.try_clone())
            .map_err(|_| "a socket error")?;
        let mine = self.reading.entry(from.ip()).or_default();
        if mine.len() >= self.per_source {
            let cut = match mine.iter().position(|r| !r.spoke()) {
                Some(silent) => silent,
                // Every one sent part of a hello: the oldest goes once it had time to finish.
                None if mine[0].since.elapsed() >= MIN_HELLO_GRACE => 0,
                None => return Err("too many handshakes from one address"),
            };
            let _ = mine.remove(cut).handle.shutdown(std::net::Shutdown::Both);
        }
        let id = self.next_id;
        self.next_id += 1;
        let sender = self.sender.clone();
        let parse = self.parse;
        let spoke = Arc::new(AtomicBool::new(false));
        let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
        {
            let spoke = Arc::clone(&spoke);
            std::thread::Builder::new()
                .name("ddp-hello".into())
                .stack_size(HELLO_STACK)
                .spawn(move || {
                    let mut reader = Marking {
                        inner: ReadBy::new(&s, by),
                        spoke: &spoke,
                    };
                    let hello = parse(&mut reader).ok();
                    let _ = sender.send((id, (s, from, hello)));
                })
                .map_err(|_| "no thread to read its hello")?;
        }
        mine.push(Reading {
            id,
            handle,
            since: Instant::now(),
            spoke,
        });
        Ok(())
    }

    /// A hello read (or failed) since the last call, if any.
    pub(super) fn finished(&mut self) -> Option<ReadHello<H>> {
        let (id, read) = self.receiver.try_recv().ok()?;
        if let Some(mine) = self.reading.get_mut(&read.1.ip()) {
            mine.retain(|r| r.id != id);
            if mine.is_empty() {
                self.reading.remove(&read.1.ip());
            }
        }
        Some(read)
    }

    /// Cuts every connection still being read (their threads then end at once).
    pub(super) fn cut_all(&mut self) {
        for r in self.reading.drain().flat_map(|(_, v)| v) {
            let _ = r.handle.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    fn read_line(r: &mut dyn Read) -> io::Result<String> {
        let mut buf = [0u8; 5];
        r.read_exact(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// A flood of silent connections from one address, faster than the grace period empties
    /// the share, does not keep a peer that speaks at once out: it is read every time, and
    /// the flood's connections are the ones cut. (Before, a full share of connections younger
    /// than 100 ms refused the newcomer.)
    #[test]
    fn a_silent_flood_from_one_address_never_keeps_a_speaking_peer_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut readers = HelloReaders::new(8, read_line);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut flood = Vec::new();
        let mut read = 0;
        for round in 0..5 {
            // The share filled with silent connections, all younger than the grace period.
            for _ in 0..8 {
                flood.push(TcpStream::connect(addr).unwrap());
                let (s, from) = listener.accept().unwrap();
                readers.start(s, from, deadline).unwrap();
            }
            let mut peer = TcpStream::connect(addr).unwrap();
            peer.write_all(b"hello").unwrap();
            let (s, from) = listener.accept().unwrap();
            assert_eq!(readers.start(s, from, deadline), Ok(()), "round {round}");
            // More silent connections come while it is read.
            for _ in 0..8 {
                flood.push(TcpStream::connect(addr).unwrap());
                let (s, from) = listener.accept().unwrap();
                readers.start(s, from, deadline).unwrap();
            }
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                assert!(
                    Instant::now() < until,
                    "round {round}: the hello was never read"
                );
                match readers.finished() {
                    Some((_, _, Some(h))) => {
                        assert_eq!(h, "hello");
                        read += 1;
                        break;
                    }
                    Some((_, _, None)) => {}
                    None => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        }
        assert_eq!(read, 5);
        readers.cut_all();
    }
}
