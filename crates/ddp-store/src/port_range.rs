//! Keeping the ports a job listens on inside a range a firewall lets through
//! (`DDP_PORT_RANGE=LO-HI`).
//!
//! Without it, every rank's listener for its peers takes a port the kernel picks, and so does
//! the ranks' store `ddprun` opens for each round of a job on several nodes. With it, both
//! take the first free port of the range (a rank starts its search at its own offset, so the
//! ranks of one host seldom try the same port twice); a range with no free port left is an
//! error naming the variable. NCCL's own sockets are NCCL's (see its `NCCL_*` settings).

use std::io;
use std::net::{IpAddr, TcpListener};

use crate::env::EnvError;

/// The variable: `LO-HI`, two ports (1–65535), `LO <= HI`.
pub const PORT_RANGE_VAR: &str = "DDP_PORT_RANGE";

/// An inclusive range of TCP ports to listen on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    /// The first port.
    pub lo: u16,
    /// The last port.
    pub hi: u16,
}

impl PortRange {
    /// The range [`PORT_RANGE_VAR`] sets, if it is set (and not empty).
    pub fn from_env() -> Result<Option<PortRange>, EnvError> {
        match std::env::var(PORT_RANGE_VAR) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v).map(Some),
            _ => Ok(None),
        }
    }

    /// Parses `LO-HI`.
    pub fn parse(value: &str) -> Result<PortRange, EnvError> {
        let invalid = |why: &str| EnvError::Invalid {
            var: PORT_RANGE_VAR,
            value: value.to_string(),
            why: why.to_string(),
        };
        let (lo, hi) = value
            .trim()
            .split_once('-')
            .ok_or_else(|| invalid("expected two ports, LO-HI (e.g. 29600-29699)"))?;
        let port = |s: &str| {
            s.trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| invalid("each end must be a port, 1-65535"))
        };
        let (lo, hi) = (port(lo)?, port(hi)?);
        if lo > hi {
            return Err(invalid("the first port must not be above the last"));
        }
        Ok(PortRange { lo, hi })
    }

    /// How many ports the range holds.
    fn ports(&self) -> usize {
        usize::from(self.hi - self.lo) + 1
    }

    /// A listener on `ip` at the first port of the range that is free, trying from the port at
    /// `offset` (e.g. the rank) and wrapping round; an [`io::ErrorKind::AddrInUse`] error
    /// naming the range when none is.
    pub fn bind(&self, ip: IpAddr, offset: usize) -> io::Result<TcpListener> {
        let n = self.ports();
        let mut last = None;
        for i in 0..n {
            let port = self.lo + ((offset + i) % n) as u16;
            match TcpListener::bind((ip, port)) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "no port of {PORT_RANGE_VAR}={}-{} is free on {ip} ({} tried; last: {})",
                self.lo,
                self.hi,
                n,
                last.map_or_else(String::new, |e| e.to_string())
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_two_ports_and_refuses_anything_else_naming_the_variable() {
        assert_eq!(
            PortRange::parse(" 29600-29699 "),
            Ok(PortRange {
                lo: 29600,
                hi: 29699
            })
        );
        assert_eq!(PortRange::parse("7-7").unwrap().ports(), 1);
        for bad in ["29600", "0-10", "10-5", "a-b", "1-70000", "-5"] {
            let e = PortRange::parse(bad).unwrap_err();
            assert!(e.to_string().contains(PORT_RANGE_VAR), "{bad}: {e}");
        }
    }

    #[test]
    fn binds_the_free_ports_of_the_range_then_says_none_is_left() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        // A range of two free ports: find two adjacent ones.
        let (lo, _first) = (30000..60000u16)
            .find_map(|p| {
                let a = TcpListener::bind((ip, p)).ok()?;
                TcpListener::bind((ip, p + 1)).ok().map(|_| (p, a))
            })
            .expect("two free adjacent ports");
        drop(_first);
        let range = PortRange { lo, hi: lo + 1 };
        let a = range.bind(ip, 1).unwrap();
        assert_eq!(
            a.local_addr().unwrap().port(),
            lo + 1,
            "starts at its offset"
        );
        let b = range.bind(ip, 1).unwrap();
        assert_eq!(b.local_addr().unwrap().port(), lo, "then wraps round");
        let e = range.bind(ip, 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains(PORT_RANGE_VAR), "{e}");
    }
}
