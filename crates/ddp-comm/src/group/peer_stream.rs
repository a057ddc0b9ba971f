//! The byte stream to one peer: TCP to a rank on another host, a Unix socket to a rank on this
//! one (see [`super::local_socket`]). Both are read, written, polled and shut down alike.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::wire::TimedSocket;

/// A connection to a peer.
#[derive(Debug)]
pub(crate) enum PeerStream {
    /// To a rank on another host.
    Tcp(TcpStream),
    /// To a rank on this host, through the socket in its private directory.
    Local(UnixStream),
}

impl PeerStream {
    /// Whether this is a Unix socket to a rank on this host.
    pub(crate) fn is_local(&self) -> bool {
        matches!(self, PeerStream::Local(_))
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            PeerStream::Tcp(s) => s.set_nonblocking(on),
            PeerStream::Local(s) => s.set_nonblocking(on),
        }
    }

    /// Sends small writes at once (TCP's `TCP_NODELAY`; a Unix socket never delays them).
    pub(crate) fn set_nodelay(&self) -> io::Result<()> {
        match self {
            PeerStream::Tcp(s) => s.set_nodelay(true),
            PeerStream::Local(_) => Ok(()),
        }
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            PeerStream::Tcp(s) => s.set_write_timeout(timeout),
            PeerStream::Local(s) => s.set_write_timeout(timeout),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<PeerStream> {
        Ok(match self {
            PeerStream::Tcp(s) => PeerStream::Tcp(s.try_clone()?),
            PeerStream::Local(s) => PeerStream::Local(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            PeerStream::Tcp(s) => s.shutdown(how),
            PeerStream::Local(s) => s.shutdown(how),
        }
    }
}

impl AsRawFd for PeerStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            PeerStream::Tcp(s) => s.as_raw_fd(),
            PeerStream::Local(s) => s.as_raw_fd(),
        }
    }
}

impl Read for &PeerStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            PeerStream::Tcp(s) => (&mut &*s).read(buf),
            PeerStream::Local(s) => (&mut &*s).read(buf),
        }
    }
}

impl Write for &PeerStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            PeerStream::Tcp(s) => (&mut &*s).write(buf),
            PeerStream::Local(s) => (&mut &*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for PeerStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl TimedSocket for PeerStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            PeerStream::Tcp(s) => s.set_read_timeout(timeout),
            PeerStream::Local(s) => s.set_read_timeout(timeout),
        }
    }

    fn read_shared(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&mut &*self).read(buf)
    }
}
