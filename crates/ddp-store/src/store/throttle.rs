//! On-line guessing of the job's token, slowed down: a source whose key exchanges fail waits
//! its turn before its next one.
//!
//! Each key exchange tests one guess of the token (nothing in it can be tested off line), so
//! the guesses an attacker can try are the exchanges the store answers. A source (an address;
//! on this host, an address and the user whose process connects) that failed earns a penalty:
//! 2 ms after its first failure, doubled with each further one up to [`PENALTY_MAX`] (250 ms),
//! one doubling undone for each [`QUIET_STEP`] (5 s) without a failure. While it has one, its
//! exchanges take turns: one at a time, in the order their hellos came, each at least the
//! penalty after the one before. So a guessing source gets about 4 exchanges a second however
//! many connections it opens (at most 16 of them wait at once, the store's share of handshakes
//! per address), where it got a few thousand.
//!
//! The job's own ranks are not locked out:
//!
//! - a process of the **store's own user on this host** is never held back: it could read the
//!   token from the ranks' environment anyway (`/proc/PID/environ`), so a penalty would protect
//!   nothing; the user a connection from this host comes from is found in the kernel's table of
//!   TCP sockets (`/proc/net/tcp`), so another local user's guesses are charged to that user,
//!   never to the job's ranks, although every local process connects from 127.0.0.1;
//! - from elsewhere (another host, or another user here), a client with the right key waits in
//!   the same queue as the guesses from its source: at most 16 turns of 250 ms, 4 s, and a
//!   guessing source gains nothing by keeping more than one exchange waiting; connections that
//!   have not sent their hello are cut first to make room for a newcomer, so a flood of silent
//!   ones does not cut a waiting client.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// The penalty after a source's first failed key exchange; each further failure doubles it.
pub(super) const PENALTY_START: Duration = Duration::from_millis(2);
/// The largest penalty: a guessing source gets one exchange in this long (4 a second), and a
/// client queued behind the 16 exchanges one source may have waiting gets its turn within 4 s.
pub(super) const PENALTY_MAX: Duration = Duration::from_millis(250);
/// Each this long without a failure undoes one doubling of a source's penalty (a source at
/// the largest is back to none after 40 s).
pub(super) const QUIET_STEP: Duration = Duration::from_secs(5);
/// The longest a connection waits for its turn: then it is closed without an answer (a
/// client retries within its connect deadline).
pub(super) const MAX_TURN_WAIT: Duration = Duration::from_secs(4);
/// Sources remembered at once: past it, the one quiet the longest is forgotten.
const MAX_SOURCES: usize = 4096;
/// Failures counted at most (the penalty is long at its largest by then).
const MAX_FAILURES: u32 = 32;

/// Where a key exchange comes from: an address (IPv6 by its /64, which one host holds whole),
/// and, from this host, the user whose socket it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Source {
    ip: IpAddr,
    uid: Option<u32>,
}

impl Source {
    /// The source of a connection from `ip`, of user `uid` (from this host, where known).
    pub(super) fn new(ip: IpAddr, uid: Option<u32>) -> Source {
        let ip = match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => {
                    let s = v6.segments();
                    IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
                }
            },
            v4 => v4,
        };
        Source { ip, uid }
    }

    /// The address, for the refusal log.
    pub(super) fn ip(&self) -> IpAddr {
        self.ip
    }
}

/// What the store remembers of one source.
#[derive(Debug)]
struct Record {
    failures: u32,
    last_failure: Instant,
    /// The earliest the next exchange may start.
    next_turn: Instant,
    /// Connections waiting for their turn, in the order their hellos came.
    waiting: VecDeque<u64>,
}

impl Record {
    /// Failures still counted at `now` (one forgotten per [`QUIET_STEP`] without one).
    fn failures_at(&self, now: Instant) -> u32 {
        let quiet = now.saturating_duration_since(self.last_failure);
        let forgotten = (quiet.as_nanos() / QUIET_STEP.as_nanos()).min(u32::MAX as u128) as u32;
        self.failures.saturating_sub(forgotten)
    }

    /// The penalty at `now`: none without failures, else [`PENALTY_START`] doubled for each
    /// failure after the first, at most [`PENALTY_MAX`].
    fn penalty_at(&self, now: Instant) -> Duration {
        match self.failures_at(now) {
            0 => Duration::ZERO,
            n => PENALTY_START
                .saturating_mul(1u32 << (n - 1).min(16))
                .min(PENALTY_MAX),
        }
    }
}

/// What a connection waiting for its turn does next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Turn {
    /// Its key exchange starts now.
    Go,
    /// It waits (at most this long before asking again).
    Wait(Duration),
}

/// The penalties of the sources whose key exchanges failed.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    sources: HashMap<Source, Record>,
}

impl Throttle {
    /// Connection `id` from `source` is ready for its key exchange: whether it must wait for
    /// its turn ([`Throttle::turn`]) — only while its source has a penalty or others wait.
    pub(super) fn queue(&mut self, source: Source, id: u64, now: Instant) -> bool {
        let Some(record) = self.sources.get_mut(&source) else {
            return false;
        };
        if record.waiting.is_empty() && record.penalty_at(now).is_zero() {
            self.sources.remove(&source);
            return false;
        }
        record.waiting.push_back(id);
        true
    }

    /// Whether connection `id`, waiting since [`Throttle::queue`], may start its exchange: the
    /// first in its source's queue, once the penalty since the last turn has passed.
    pub(super) fn turn(&mut self, source: Source, id: u64, now: Instant) -> Turn {
        let Some(record) = self.sources.get_mut(&source) else {
            return Turn::Go;
        };
        let penalty = record.penalty_at(now);
        match record.waiting.front() {
            Some(&first) if first == id => {}
            Some(_) => return Turn::Wait(penalty.max(Duration::from_millis(1))),
            None => return Turn::Go,
        }
        if now < record.next_turn {
            return Turn::Wait(record.next_turn - now);
        }
        record.waiting.pop_front();
        record.next_turn = now + penalty;
        Turn::Go
    }

    /// Connection `id` stops waiting (closed, cut, or past [`MAX_TURN_WAIT`]).
    pub(super) fn leave(&mut self, source: Source, id: u64) {
        if let Some(record) = self.sources.get_mut(&source) {
            record.waiting.retain(|&w| w != id);
        }
    }

    /// A key exchange from `source` failed: its penalty grows.
    pub(super) fn failed(&mut self, source: Source, now: Instant) {
        if !self.sources.contains_key(&source) && self.sources.len() >= MAX_SOURCES {
            let quietest = self
                .sources
                .iter()
                .filter(|(_, r)| r.waiting.is_empty())
                .min_by_key(|(_, r)| r.last_failure)
                .map(|(s, _)| *s);
            if let Some(s) = quietest {
                self.sources.remove(&s);
            }
        }
        let record = self.sources.entry(source).or_insert(Record {
            failures: 0,
            last_failure: now,
            next_turn: now,
            waiting: VecDeque::new(),
        });
        record.failures = (record.failures_at(now) + 1).min(MAX_FAILURES);
        record.last_failure = now;
    }

    /// The penalty of `source` at `now`.
    #[cfg(test)]
    pub(super) fn penalty(&self, source: Source, now: Instant) -> Duration {
        self.sources
            .get(&source)
            .map_or(Duration::ZERO, |r| r.penalty_at(now))
    }
}

/// Whether a connection from `peer` to this host's `local` comes from this host: from
/// loopback, or from the address it reached.
pub(super) fn from_this_host(local: SocketAddr, peer: SocketAddr) -> bool {
    let v4 = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        ip => ip,
    };
    let peer_ip = v4(peer.ip());
    peer_ip.is_loopback() || peer_ip == v4(local.ip())
}

/// The user whose socket is the client's end of a TCP connection between `peer` (its address)
/// and `local` (the server's end), both on this host: the `uid` of the kernel's entry for it in
/// `/proc/net/tcp` (or `tcp6`). `None` when it is not there (closed meanwhile, or not on this
/// host).
pub(super) fn local_peer_uid(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    let mapped = |a: SocketAddr| match a.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(|v4| (v4, a.port())),
        IpAddr::V4(v4) => Some((v4, a.port())),
    };
    if let (Some(client), Some(server)) = (mapped(peer), mapped(local)) {
        let found = find_uid(
            "/proc/net/tcp",
            &hex_v4(client.0, client.1),
            &hex_v4(server.0, server.1),
        );
        if found.is_some() {
            return found;
        }
    }
    let v6 = |a: SocketAddr| match a.ip() {
        IpAddr::V6(v6) => v6,
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
    };
    find_uid(
        "/proc/net/tcp6",
        &hex_v6(v6(peer), peer.port()),
        &hex_v6(v6(local), local.port()),
    )
}

/// An IPv4 socket address as `/proc/net/tcp` writes it: the address's 32 bits in this host's
/// byte order, then the port, in upper-case hex.
fn hex_v4(ip: Ipv4Addr, port: u16) -> String {
    format!("{:08X}:{port:04X}", u32::from_ne_bytes(ip.octets()))
}

/// An IPv6 socket address as `/proc/net/tcp6` writes it: four 32-bit words in this host's byte
/// order, then the port.
fn hex_v6(ip: Ipv6Addr, port: u16) -> String {
    let o = ip.octets();
    let mut s = String::with_capacity(37);
    for w in o.chunks_exact(4) {
        s.push_str(&format!(
            "{:08X}",
            u32::from_ne_bytes([w[0], w[1], w[2], w[3]])
        ));
    }
    s.push_str(&format!(":{port:04X}"));
    s
}

/// The `uid` column of the line of `table` whose local and remote addresses are these.
fn find_uid(table: &str, local: &str, remote: &str) -> Option<u32> {
    let file = std::fs::File::open(table).ok()?;
    BufReader::new(file).lines().skip(1).find_map(|line| {
        let line = line.ok()?;
        let mut fields = line.split_whitespace();
        let (_, l, r) = (fields.next()?, fields.next()?, fields.next()?);
        if l != local || r != remote {
            return None;
        }
        // st, tx_queue:rx_queue, tr:tm->when, retrnsmt, uid
        fields.nth(4)?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(n: u8) -> Source {
        Source::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), None)
    }

    #[test]
    fn a_penalty_doubles_with_failures_up_to_its_cap_and_fades_when_quiet() {
        let mut t = Throttle::default();
        let now = Instant::now();
        assert_eq!(t.penalty(src(1), now), Duration::ZERO);
        assert!(!t.queue(src(1), 0, now), "no failure, no queue");
        let mut seen = Vec::new();
        for _ in 0..12 {
            t.failed(src(1), now);
            seen.push(t.penalty(src(1), now).as_millis());
        }
        assert_eq!(seen, [2, 4, 8, 16, 32, 64, 128, 250, 250, 250, 250, 250]);
        assert_eq!(t.penalty(src(2), now), Duration::ZERO, "per source");
        // One doubling undone per quiet step; none after long enough.
        assert_eq!(t.penalty(src(1), now + QUIET_STEP * 5).as_millis(), 128);
        assert_eq!(t.penalty(src(1), now + QUIET_STEP * 12), Duration::ZERO);
        assert!(!t.queue(src(1), 1, now + QUIET_STEP * 12));
        // IPv6 sources by their /64.
        let a = Source::new("2001:db8::1".parse().unwrap(), None);
        let b = Source::new("2001:db8::ffff:2".parse().unwrap(), None);
        assert_eq!(a, b);
        assert_eq!(
            Source::new("::ffff:10.0.0.1".parse().unwrap(), None),
            src(1)
        );
    }

    #[test]
    fn turns_come_in_order_one_penalty_apart() {
        let mut t = Throttle::default();
        let start = Instant::now();
        for _ in 0..8 {
            t.failed(src(1), start);
        }
        let p = t.penalty(src(1), start);
        assert_eq!(p, PENALTY_MAX);
        for id in 0..3 {
            assert!(t.queue(src(1), id, start));
        }
        assert_eq!(t.turn(src(1), 1, start), Turn::Wait(p), "not first");
        assert_eq!(t.turn(src(1), 0, start), Turn::Go);
        assert_eq!(t.turn(src(1), 1, start + p / 2), Turn::Wait(p / 2));
        // The first leaves the queue: the next goes at its time.
        t.leave(src(1), 1);
        assert!(matches!(t.turn(src(1), 2, start + p / 2), Turn::Wait(_)));
        assert_eq!(t.turn(src(1), 2, start + p), Turn::Go);
        // Another source is not held up.
        assert!(!t.queue(src(2), 9, start));
        assert_eq!(t.turn(src(2), 9, start), Turn::Go);
    }

    #[test]
    fn sources_remembered_are_bounded() {
        let mut t = Throttle::default();
        let now = Instant::now();
        for i in 0..(MAX_SOURCES as u32 + 10) {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            t.failed(Source::new(ip, None), now);
        }
        assert_eq!(t.sources.len(), MAX_SOURCES);
    }

    /// The kernel's table names the user of a local client's socket: this process's.
    #[test]
    fn the_user_of_a_local_connection_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer) = listener.accept().unwrap();
        let local = server.local_addr().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert!(from_this_host(local, peer));
        // SAFETY: no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(local_peer_uid(local, peer), Some(me));
        // A port nothing uses is not found.
        let nobody = SocketAddr::new(peer.ip(), 1);
        assert_eq!(local_peer_uid(local, nobody), None);
        assert!(!from_this_host(local, "192.0.2.1:5".parse().unwrap()));
        let v6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(v6) = v6 {
            let _c = std::net::TcpStream::connect(v6.local_addr().unwrap()).unwrap();
            let (s, p) = v6.accept().unwrap();
            assert_eq!(local_peer_uid(s.local_addr().unwrap(), p), Some(me));
        }
    }
}
