//! The one binary codec of the crate: little-endian fields, length-prefixed byte strings and
//! length-prefixed frames.
//!
//! Every message ddp-comm sends between processes is built with [`Writer`] and parsed with
//! [`Reader`]: the rendezvous store's requests and replies ([`crate::store`]), the peer
//! handshake of the process group's mesh, the header in front of every collective, and the
//! NCCL unique id published through the store. Messages that travel alone on a TCP stream
//! (store requests and replies, mesh hellos and replies) are wrapped in a frame: a `u32`
//! length, then that many bytes (`write_frame`, `read_frame`).
//! The handshakes' proofs are [`crate::auth`]'s.

use std::io::{self, Read, Write};

/// Builds one message: fields are appended in order, integers little-endian.
#[derive(Debug, Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    /// An empty message with room for `n` bytes.
    pub fn with_capacity(n: usize) -> Self {
        Writer(Vec::with_capacity(n))
    }
    /// Appends a byte.
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    /// Appends a `u16`.
    pub fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a `u32`.
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a `u64`.
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends an `i64`.
    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A byte string: its length as a `u32`, then the bytes.
    pub fn bytes(self, v: &[u8]) -> Self {
        self.u32(v.len() as u32).raw(v)
    }
    /// Bytes with no length in front (magics, fixed-size fields).
    pub fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    /// The message built so far.
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// A message that does not parse (too short, too long, a bad tag or magic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// Result of parsing a message.
pub type Parsed<T> = std::result::Result<T, Malformed>;

/// Reads the fields of one message in order; every read checks the length.
#[derive(Debug)]
pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// A reader at the start of `message`.
    pub fn new(message: &'a [u8]) -> Self {
        Reader(message)
    }
    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Parsed<&'a [u8]> {
        if self.0.len() < n {
            return Err(Malformed);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    /// `N` bytes with no length in front.
    pub fn array<const N: usize>(&mut self) -> Parsed<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }
    /// Reads a byte.
    pub fn u8(&mut self) -> Parsed<u8> {
        Ok(self.take(1)?[0])
    }
    /// Reads a `u16`.
    pub fn u16(&mut self) -> Parsed<u16> {
        self.array().map(u16::from_le_bytes)
    }
    /// Reads a `u32`.
    pub fn u32(&mut self) -> Parsed<u32> {
        self.array().map(u32::from_le_bytes)
    }
    /// Reads a `u64`.
    pub fn u64(&mut self) -> Parsed<u64> {
        self.array().map(u64::from_le_bytes)
    }
    /// Reads an `i64`.
    pub fn i64(&mut self) -> Parsed<i64> {
        self.array().map(i64::from_le_bytes)
    }
    /// A byte string written by [`Writer::bytes`].
    pub fn bytes(&mut self) -> Parsed<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// A UTF-8 string written by [`Writer::bytes`].
    pub fn string(&mut self) -> Parsed<String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| Malformed)
    }
    /// Succeeds when every byte has been read.
    pub fn end(&self) -> Parsed<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed)
        }
    }
}

/// Writes one frame: `payload`'s length as a `u32`, then `payload`, in one write.
///
/// Fails with [`io::ErrorKind::InvalidInput`] when `payload` is over `max` bytes.
#[doc(hidden)]
pub fn write_frame(w: &mut impl Write, payload: &[u8], max: usize) -> io::Result<()> {
    if payload.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "message of {} bytes exceeds the store's limit of {max} bytes",
                payload.len()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

/// Reads one frame of at most `max` bytes. `Ok(None)`: the peer closed the connection cleanly
/// between frames.
#[doc(hidden)]
pub fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(Some(buf))
}

/// A socket whose reads can be given a timeout: TCP, a Unix socket, or a stream that is one
/// of them.
#[doc(hidden)]
pub trait TimedSocket {
    /// Sets the timeout of the next reads (`None`: none).
    fn set_read_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()>;
    /// Reads some bytes (a shared reference, as `&TcpStream` reads).
    fn read_shared(&self, buf: &mut [u8]) -> io::Result<usize>;
}

impl TimedSocket for std::net::TcpStream {
    fn set_read_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, timeout)
    }
    fn read_shared(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&mut &*self).read(buf)
    }
}

impl TimedSocket for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, timeout)
    }
    fn read_shared(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&mut &*self).read(buf)
    }
}

/// Reads from a socket with one deadline for the whole exchange: each read's timeout is what
/// is left of it, so a peer that trickles one byte now and then cannot stretch a handshake
/// past its limit (a per-read timeout would let it hold the connection for hours).
#[doc(hidden)]
pub struct ReadBy<'a, S: TimedSocket + ?Sized = std::net::TcpStream> {
    stream: &'a S,
    deadline: std::time::Instant,
}

impl<'a, S: TimedSocket + ?Sized> ReadBy<'a, S> {
    /// Reads from `stream` until `deadline`.
    pub fn new(stream: &'a S, deadline: std::time::Instant) -> Self {
        ReadBy { stream, deadline }
    }
}

impl<S: TimedSocket + ?Sized> Read for ReadBy<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read_shared(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_short_input_is_malformed() {
        let msg = Writer::default()
            .u8(7)
            .u16(0xBEEF)
            .u32(1 << 30)
            .u64(u64::MAX - 1)
            .i64(-5)
            .bytes(b"key")
            .raw(b"MAGC")
            .finish();
        let mut r = Reader::new(&msg);
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u16(), Ok(0xBEEF));
        assert_eq!(r.u32(), Ok(1 << 30));
        assert_eq!(r.u64(), Ok(u64::MAX - 1));
        assert_eq!(r.i64(), Ok(-5));
        assert_eq!(r.string().as_deref(), Ok("key"));
        assert_eq!(r.array::<4>(), Ok(*b"MAGC"));
        assert_eq!(r.end(), Ok(()));
        assert_eq!(r.u8(), Err(Malformed));
        let mut r = Reader::new(&msg[..3]);
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u32(), Err(Malformed));
    }

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello", 16).unwrap();
        write_frame(&mut buf, b"", 16).unwrap();
        assert!(write_frame(&mut buf, &[0; 17], 16).is_err());
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r, 16).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 16).unwrap().unwrap(), b"");
        assert!(read_frame(&mut r, 16).unwrap().is_none());
        let mut big = Vec::new();
        write_frame(&mut big, &[0; 8], 16).unwrap();
        assert!(read_frame(&mut &big[..], 4).is_err());
    }
}
