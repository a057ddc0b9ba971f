//! Small socket helpers of the launcher.

use std::io;
use std::net::{TcpListener, ToSocketAddrs};

use ddp_comm::port_range::PortRange;

/// A port nothing listens on now, from binding `host:0` (or `127.0.0.1:0` when `host` cannot
/// be bound here); inside `DDP_PORT_RANGE` when it is set (an invalid value is an
/// [`io::ErrorKind::InvalidInput`] error naming it). The port is free when this returns;
/// another process may take it later.
pub(crate) fn free_port(host: &str) -> io::Result<u16> {
    let range = PortRange::from_env()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let probe = |h: &str| {
        let listener = match range {
            None => TcpListener::bind((h, 0)),
            Some(range) => {
                let ip = (h, 0)
                    .to_socket_addrs()?
                    .next()
                    .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, h.to_string()))?
                    .ip();
                range.bind(ip, 0)
            }
        };
        listener.and_then(|l| l.local_addr().map(|a| a.port()))
    };
    probe(host).or_else(|_| probe("127.0.0.1"))
}

/// What a TCP connection to an endpoint found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listening {
    /// A connection was accepted: something listens (a stopped process's listening socket
    /// still accepts: the kernel completes the handshake).
    Yes,
    /// Refused, unreachable, unresolvable: nothing listens there now.
    No,
    /// No answer within half a second (a full backlog of a process that does not accept, or
    /// packets dropped on the way): nothing learnt.
    Unknown,
}

/// Whether something listens at `endpoint` (`host:port`), which tells "not started, or gone"
/// from "there, not answering".
pub(crate) fn listening(endpoint: &str) -> Listening {
    use std::net::TcpStream;
    let Ok(addrs) = endpoint.to_socket_addrs() else {
        return Listening::No;
    };
    let mut seen = Listening::No;
    for a in addrs {
        match TcpStream::connect_timeout(&a, std::time::Duration::from_millis(500)) {
            Ok(_) => return Listening::Yes,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => seen = Listening::Unknown,
            Err(_) => {}
        }
    }
    seen
}
