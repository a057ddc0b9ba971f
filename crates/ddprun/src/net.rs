//! Small socket helpers of the launcher.

use std::io;
use std::net::TcpListener;

/// A port nothing listens on now, from binding `host:0` (or `127.0.0.1:0` when `host` cannot
/// be bound here). The port is free when this returns; another process may take it later.
pub(crate) fn free_port(host: &str) -> io::Result<u16> {
    let probe = |h: &str| TcpListener::bind((h, 0)).and_then(|l| l.local_addr().map(|a| a.port()));
    probe(host).or_else(|_| probe("127.0.0.1"))
}
