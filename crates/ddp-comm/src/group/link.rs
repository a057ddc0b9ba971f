//! A connection to one peer: a stream (always; the liveness channel: TCP to another host, a Unix
//! socket on this one) and, for a peer on the same host, a shared-memory ring pair that carries
//! all data instead.
//!
//! All calls are non-blocking; the engine decides when to spin, yield or sleep.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::time::Duration;

use super::peer_stream::PeerStream;
use super::shm::{Avail, ShmPair};
use crate::error::CommError;

/// Size of the TCP receive staging buffer (used when received bytes are reduced).
const STAGE_BYTES: usize = 256 * 1024;

/// Why a link operation failed.
#[derive(Debug)]
pub(crate) enum LinkError {
    /// The peer closed the connection (exited, crashed, was killed or gave up).
    Closed,
    /// Another I/O error.
    Io(io::Error),
}

fn classify(e: io::Error) -> LinkError {
    use io::ErrorKind::*;
    match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof | NotConnected => {
            LinkError::Closed
        }
        _ => LinkError::Io(e),
    }
}

/// One peer's connection.
pub(crate) struct Link {
    pub(crate) stream: PeerStream,
    pub(crate) shm: Option<ShmPair>,
    stage: Vec<u8>,
    lo: usize,
    hi: usize,
    /// Bytes sent so far (headers, payloads and padding; tests measure traffic with it).
    sent: u64,
}

impl Link {
    pub(crate) fn new(stream: PeerStream, shm: Option<ShmPair>) -> io::Result<Self> {
        stream.set_nodelay()?;
        stream.set_nonblocking(true)?;
        Ok(Link {
            stream,
            shm,
            stage: Vec::new(),
            lo: 0,
            hi: 0,
            sent: 0,
        })
    }

    /// True when data moves through shared memory.
    pub(crate) fn is_shm(&self) -> bool {
        self.shm.is_some()
    }

    /// True when the stream is a Unix socket (a peer on this host).
    pub(crate) fn is_local(&self) -> bool {
        self.stream.is_local()
    }

    /// Sends a prefix of `data`; returns how many bytes went (0 when the pipe is full).
    pub(crate) fn send_some(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        let n = self.send_inner(data)?;
        self.sent += n as u64;
        Ok(n)
    }

    /// Bytes sent over this link so far.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.sent
    }

    fn send_inner(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        if data.is_empty() {
            return Ok(0);
        }
        if let Some(shm) = &self.shm {
            return shm.write(data).map_err(|()| LinkError::Closed);
        }
        loop {
            match (&self.stream).write(data) {
                Ok(0) => return Err(LinkError::Closed),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(classify(e)),
            }
        }
    }

    /// Makes at least `min` contiguous bytes (or as many as are there) readable; returns how
    /// many are (at most `max`). `min` must not exceed an element size (8).
    pub(crate) fn readable(&mut self, min: usize, max: usize) -> Result<usize, LinkError> {
        if let Some(shm) = &self.shm {
            return match shm.readable(max) {
                Avail::Bytes(n) => Ok(n),
                Avail::Empty => Ok(0),
                Avail::Closed => Err(LinkError::Closed),
            };
        }
        if self.hi - self.lo >= min.max(1) {
            return Ok((self.hi - self.lo).min(max));
        }
        if self.stage.is_empty() {
            self.stage = vec![0; STAGE_BYTES];
        }
        if self.lo > 0 {
            self.stage.copy_within(self.lo..self.hi, 0);
            self.hi -= self.lo;
            self.lo = 0;
        }
        // Reading past this message is fine: the bytes stay staged for the next one.
        let want = STAGE_BYTES - self.hi;
        if want > 0 {
            loop {
                match (&self.stream).read(&mut self.stage[self.hi..self.hi + want]) {
                    Ok(0) => return Err(LinkError::Closed),
                    Ok(n) => {
                        self.hi += n;
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(classify(e)),
                }
            }
        }
        Ok((self.hi - self.lo).min(max))
    }

    /// The `n` bytes made readable by [`Self::readable`].
    pub(crate) fn peek(&self, n: usize) -> &[u8] {
        match &self.shm {
            Some(shm) => shm.peek(n),
            None => &self.stage[self.lo..self.lo + n],
        }
    }

    /// Releases `n` read bytes.
    pub(crate) fn consume(&mut self, n: usize) {
        match &self.shm {
            Some(shm) => shm.consume(n),
            None => {
                self.lo += n;
                if self.lo == self.hi {
                    self.lo = 0;
                    self.hi = 0;
                }
            }
        }
    }

    /// Receives up to `dst.len()` bytes straight into `dst`; returns how many arrived.
    pub(crate) fn recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.shm.is_none() && self.hi == self.lo {
            // Nothing staged: let the kernel copy directly into the destination.
            loop {
                return match (&self.stream).read(dst) {
                    Ok(0) => Err(LinkError::Closed),
                    Ok(n) => Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => Err(classify(e)),
                };
            }
        }
        let n = self.readable(1, dst.len())?;
        if n > 0 {
            super::copy::copy(&mut dst[..n], self.peek(n));
            self.consume(n);
        }
        Ok(n)
    }

    /// For a shared-memory link: whether the ring from the peer holds bytes not read yet
    /// (which a peer that finished and went away wrote before it left).
    pub(crate) fn shm_has_data(&self) -> bool {
        self.shm
            .as_ref()
            .is_some_and(|s| matches!(s.readable(1), Avail::Bytes(_)))
    }

    /// For a shared-memory link: true when the peer's stream shows it went away. Nothing
    /// else is ever sent over the stream of a shared-memory peer, so readability means EOF.
    pub(crate) fn stream_hung_up(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r > 0 && p.revents != 0
    }

    /// The rank a shared-memory peer blamed when it broke the link (see [`Self::abort`]).
    pub(crate) fn blamed(&self) -> Option<usize> {
        self.shm.as_ref().and_then(ShmPair::blame)
    }

    /// Sleeps until the shared-memory ring has data (or `timeout`).
    pub(crate) fn wait_shm_data(&self, timeout: Duration) {
        if let Some(shm) = &self.shm {
            shm.wait_data(timeout);
        }
    }

    /// Sleeps until the shared-memory ring has space (or `timeout`).
    pub(crate) fn wait_shm_space(&self, timeout: Duration) {
        if let Some(shm) = &self.shm {
            shm.wait_space(timeout);
        }
    }

    /// Breaks the link so the peer notices at once: closes the rings (telling the peer which
    /// rank's failure caused it) and sends FIN (queued data is still delivered first, so the
    /// peer can read what we already sent).
    pub(crate) fn abort(&self, blame: Option<usize>) {
        if let Some(shm) = &self.shm {
            shm.close(blame);
        }
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

/// The padding bytes sent after a message (at most 7 of them).
pub(crate) const ZEROS: [u8; 8] = [0; 8];

/// Bytes of padding after a message of `len` bytes.
pub(crate) fn pad8(len: usize) -> usize {
    (8 - len % 8) % 8
}

/// The link to `peer` (the engine is only given ops on connected peers).
pub(crate) fn link_of(links: &mut [Option<Link>], peer: usize) -> &mut Link {
    links[peer]
        .as_mut()
        .expect("the engine is only given ops on connected peers")
}

pub(crate) fn link_err(e: LinkError, peer: usize, what: &str) -> CommError {
    match e {
        LinkError::Closed => CommError::PeerClosed {
            peer,
            op: what.to_string(),
        },
        LinkError::Io(source) => CommError::io(what, Some(peer), source),
    }
}

/// Drops up to `n` padding bytes; returns how many.
pub(crate) fn skip(link: &mut Link, n: usize) -> Result<usize, LinkError> {
    let k = link.readable(1, n)?;
    if k > 0 {
        link.consume(k);
    }
    Ok(k)
}
