//! On-line guessing of the job's token, slowed down: a source whose key exchanges fail waits
//! its turn before its next one.
//!
//! Each key exchange tests one guess of the token (nothing in it can be tested off line), so
//! the guesses an attacker can try are the exchanges the store answers. A source (another
//! host's address; on this host, the user whose process connects, whatever local address it
//! connects from) that failed earns a penalty: 2 ms after its first failure, doubled with each
//! further one up to [`PENALTY_MAX`] (250 ms), one doubling undone for each [`QUIET_STEP`] (5 s)
//! without a failure. While it has one, its exchanges take turns: one at a time, in the order
//! their hellos came, each at least the penalty after the one before. So a guessing source gets
//! about 4 exchanges a second however many connections it opens, where it got a few thousand.
//! At most 16 of them wait at once from one address (IPv6: one /64), the store's share of
//! handshakes per address; a local user's from each address it uses (the store counts
//! handshakes by address and user here), which makes only that user's own connections wait
//! longer.
//!
//! A connection from this host (from loopback, or from any address of this host's interfaces)
//! is its user's, found in the kernel's table of TCP sockets ([`local_peer_uid`]): any local
//! user may bind any of 127.0.0.0/8 or another of the host's addresses as its source, so a key
//! by address would give it a fresh source, with no penalty, for each address it binds. One
//! whose user the kernel does not name (its socket gone, `/proc` and `sock_diag` unreadable) is
//! charged to one shared source of its own ([`Source::local`] with `None`), never to its
//! address: whatever a local process could do to hide its user gains it nothing.
//!
//! The job's own ranks are not locked out:
//!
//! - a process of the **store's own user on this host** is never held back: it could read the
//!   token from the ranks' environment anyway (`/proc/PID/environ`), so a penalty would protect
//!   nothing; another local user's guesses are charged to that user, never to the job's ranks,
//!   although every local process connects from 127.0.0.1 (and the store counts each local
//!   user's handshakes apart, so another user's cannot take the job's user's room);
//! - from elsewhere (another host, or another user here), a client with the right key waits in
//!   the same queue as the guesses from its source: at most 16 turns of 250 ms, 4 s. A
//!   connection that has sent its hello is never cut to make room for a newcomer of its source
//!   (a newcomer is refused when all of the source's room is taken by such connections;
//!   connections that have not sent their hello are cut first), so once in the queue a client
//!   reaches its turn; and a slot freed by a failed exchange opens at a random moment before the
//!   source's next turn ([`reopen_delay`]), so the guesser that just failed has no head start
//!   on the clients retrying for it.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
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
/// client retries within its connect deadline). Half again the 16 turns (4 s) of a full
/// room, so that the last of one reaches its turn however late the turns come on a loaded
/// host, instead of being closed just before it and starting over.
pub(super) const MAX_TURN_WAIT: Duration = Duration::from_secs(6);
/// Sources remembered at once: past it, the one quiet the longest is forgotten.
const MAX_SOURCES: usize = 4096;
/// Failures counted at most (the penalty is long at its largest by then).
const MAX_FAILURES: u32 = 32;

/// Where a key exchange comes from, as the throttle counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Source {
    /// Another host: its address (IPv6 by its /64, which one host holds whole).
    Remote(IpAddr),
    /// A process of this host of this user, whatever local address it connects from.
    LocalUser(u32),
    /// A process of this host whose user the kernel's tables did not name: one source for all
    /// of them, so that hiding its user gains a process nothing.
    LocalUnknown,
}

impl Source {
    /// The source of a connection from another host's `ip`.
    pub(super) fn remote(ip: IpAddr) -> Source {
        Source::Remote(remote_address(ip))
    }

    /// The source of a connection from this host, of user `uid` where the kernel named one.
    pub(super) fn local(uid: Option<u32>) -> Source {
        uid.map_or(Source::LocalUnknown, Source::LocalUser)
    }
}

/// Another host's address as the store counts it: an IPv4 one (IPv4-mapped too) whole, an
/// IPv6 one by its /64, which one host holds whole (and may use any address of).
pub(super) fn remote_address(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
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

    /// A key exchange from `source` failed: its penalty grows; the penalty now.
    pub(super) fn failed(&mut self, source: Source, now: Instant) -> Duration {
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
        record.penalty_at(now)
    }

    /// The penalty of `source` at `now`.
    #[cfg(test)]
    fn penalty(&self, source: Source, now: Instant) -> Duration {
        self.sources
            .get(&source)
            .map_or(Duration::ZERO, |r| r.penalty_at(now))
    }
}

/// How long the handshake slot of an exchange that failed (in a full room) stays taken: a
/// random moment within `penalty`, the time to its source's next turn. The connection that
/// failed learns it at once and could take its own slot back before anyone else (a client
/// retrying for it every 50 ms would hardly ever get one); opened at a moment no one knows,
/// the slot goes to whoever tries next, each retrying client as likely as each guesser's
/// connection.
pub(super) fn reopen_delay(penalty: Duration) -> Duration {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return penalty / 2;
    }
    penalty.mul_f64(u64::from_ne_bytes(bytes) as f64 / u64::MAX as f64)
}

/// How long the list of this host's addresses is trusted before it is read again.
const HOST_ADDRESSES_FRESH: Duration = Duration::from_secs(2);

/// This host's interface addresses, and when they were read.
static HOST_ADDRESSES: Mutex<Option<(Instant, Vec<IpAddr>)>> = Mutex::new(None);

/// An address as IPv4 when it is an IPv4-mapped IPv6 one.
fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        ip => ip,
    }
}

/// Whether a connection from `peer` to this host's `local` comes from this host: from
/// loopback (any of 127.0.0.0/8, `::1`), from the address it reached, or from any other
/// address of this host's interfaces (a local process may bind any of them as its source).
pub(super) fn from_this_host(local: SocketAddr, peer: SocketAddr) -> bool {
    let peer_ip = unmapped(peer.ip());
    peer_ip.is_loopback() || peer_ip == unmapped(local.ip()) || is_this_hosts_address(peer_ip)
}

/// Whether `ip` is an address of one of this host's interfaces (read at most every
/// [`HOST_ADDRESSES_FRESH`]).
fn is_this_hosts_address(ip: IpAddr) -> bool {
    let mut cached = HOST_ADDRESSES.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    let stale = cached
        .as_ref()
        .is_none_or(|(read, _)| now.duration_since(*read) >= HOST_ADDRESSES_FRESH);
    if stale {
        match interface_addresses() {
            Ok(addresses) => *cached = Some((now, addresses)),
            Err(e) => tracing::debug!("rendezvous store: cannot list this host's addresses: {e}"),
        }
    }
    cached
        .as_ref()
        .is_some_and(|(_, addresses)| addresses.contains(&ip))
}

/// The addresses of this host's interfaces (`getifaddrs`), IPv6 link-local ones included.
fn interface_addresses() -> std::io::Result<Vec<IpAddr>> {
    Ok(if_addrs::get_if_addrs()?
        .into_iter()
        .map(|interface| unmapped(interface.ip()))
        .collect())
}

/// The user whose socket is the client's end of a TCP connection between `peer` (its address)
/// and `local` (the server's end), both on this host: the kernel's `sock_diag` answer for that
/// one socket (a lookup by its addresses, cheap enough for every accepted connection), else the
/// `uid` of its entry in `/proc/net/tcp` (or `tcp6`). `None` when neither names it (closed
/// meanwhile, or not on this host).
pub(super) fn local_peer_uid(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    match diag_uid(local, peer) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!("rendezvous store: sock_diag lookup failed ({e}); reading /proc");
            proc_peer_uid(local, peer)
        }
    }
}

/// As [`local_peer_uid`], from the kernel's tables in `/proc/net/tcp` and `tcp6` (read whole).
fn proc_peer_uid(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
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

/// `INET_DIAG_NOCOOKIE` (`linux/inet_diag.h`): look the socket up by its addresses only.
const INET_DIAG_NOCOOKIE: [u8; 8] = [0xff; 8];

/// The uid of the TCP socket whose own address is `peer` and whose peer is `local`, asked of
/// the kernel by `sock_diag` (one exact lookup, as `ss` makes): `Ok(None)` when it has none,
/// `Err` when the kernel cannot be asked (no netlink here, a filter).
fn diag_uid(local: SocketAddr, peer: SocketAddr) -> std::io::Result<Option<u32>> {
    use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
    use netlink_packet_sock_diag::{AF_INET, AF_INET6, IPPROTO_TCP, SockDiagMessage};
    use netlink_sys::{Socket, protocols::NETLINK_SOCK_DIAG};

    let (family, source, destination) = match (unmapped(peer.ip()), unmapped(local.ip())) {
        (p @ IpAddr::V4(_), l @ IpAddr::V4(_)) => (AF_INET, p, l),
        (p, l) => {
            let v6 = |ip: IpAddr| match ip {
                IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
                v6 => v6,
            };
            (AF_INET6, v6(p), v6(l))
        }
    };
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST;
    header.sequence_number = 1;
    let mut request = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id: SocketId {
                source_port: peer.port(),
                destination_port: local.port(),
                source_address: source,
                destination_address: destination,
                interface_id: 0,
                cookie: INET_DIAG_NOCOOKIE,
            },
        })
        .into(),
    );
    request.finalize();
    let mut bytes = vec![0u8; request.buffer_len()];
    request.serialize(&mut bytes);

    let socket = Socket::new(NETLINK_SOCK_DIAG)?;
    // The kernel answers at once; never wait on it for long.
    socket2::SockRef::from(&socket).set_read_timeout(Some(Duration::from_secs(1)))?;
    let sent = socket.send_to(&bytes, &netlink_sys::SocketAddr::new(0, 0), 0)?;
    if sent != bytes.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "a short sock_diag request",
        ));
    }
    let mut answer = Vec::with_capacity(8192);
    socket.recv(&mut answer, 0)?;
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let answer = NetlinkMessage::<SockDiagMessage>::deserialize(&answer)
        .map_err(|e| bad(format!("a sock_diag answer that does not parse: {e}")))?;
    match answer.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
            Ok(Some(response.header.uid))
        }
        // An acknowledgement, or no such socket: none. Another error: the kernel's.
        NetlinkPayload::Error(e) => match e.code.map(|code| code.get()) {
            None => Ok(None),
            Some(code) if code == -libc::ENOENT => Ok(None),
            Some(_) => Err(e.to_io()),
        },
        other => Err(bad(format!(
            "an unexpected sock_diag answer (type {})",
            other.message_type()
        ))),
    }
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
        Source::remote(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)))
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
        let a = Source::remote("2001:db8::1".parse().unwrap());
        let b = Source::remote("2001:db8::ffff:2".parse().unwrap());
        assert_eq!(a, b);
        assert_eq!(Source::remote("::ffff:10.0.0.1".parse().unwrap()), src(1));
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
            t.failed(Source::remote(ip), now);
        }
        assert_eq!(t.sources.len(), MAX_SOURCES);
    }

    /// A failed exchange's slot reopens within the penalty, at moments spread over it.
    #[test]
    fn a_slot_reopens_at_a_random_moment_within_the_penalty() {
        let delays: Vec<Duration> = (0..64).map(|_| reopen_delay(PENALTY_MAX)).collect();
        assert!(delays.iter().all(|d| *d <= PENALTY_MAX), "{delays:?}");
        assert!(delays.iter().any(|d| *d < PENALTY_MAX / 2), "{delays:?}");
        assert!(delays.iter().any(|d| *d > PENALTY_MAX / 2), "{delays:?}");
        assert_eq!(reopen_delay(Duration::ZERO), Duration::ZERO);
    }

    /// A local user's source is the user, whatever address it connects from; one the kernel
    /// does not name shares one source with every other such; none is an address's.
    #[test]
    fn a_local_source_is_its_user_whatever_its_address() {
        let mut t = Throttle::default();
        let now = Instant::now();
        t.failed(Source::local(Some(1000)), now);
        assert!(t.penalty(Source::local(Some(1000)), now) > Duration::ZERO);
        assert_eq!(t.penalty(Source::local(Some(1001)), now), Duration::ZERO);
        assert_eq!(Source::local(None), Source::LocalUnknown);
        t.failed(Source::local(None), now);
        assert!(t.penalty(Source::LocalUnknown, now) > Duration::ZERO);
        let loopback = Source::remote(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(t.penalty(loopback, now), Duration::ZERO);
    }

    /// The kernel names the user of a local client's socket (this process's), by `sock_diag`
    /// and by `/proc/net/tcp` alike, whichever loopback address it connects from.
    #[test]
    fn the_user_of_a_local_connection_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        // SAFETY: geteuid has no preconditions and cannot fail. std has no safe wrapper, and
        // none of this crate's dependencies has one (nix or rustix for one call is not worth it).
        let me = unsafe { libc::geteuid() };
        let mut clients = vec![std::net::TcpStream::connect(to).unwrap()];
        // From another loopback address too, bound as the source (where the host allows it).
        if let Ok(c) = ddp_testkit::connect_from(Ipv4Addr::new(127, 0, 0, 7).into(), to) {
            clients.push(c);
        }
        for client in &clients {
            let (server, peer) = listener.accept().unwrap();
            let local = server.local_addr().unwrap();
            assert_eq!(peer, client.local_addr().unwrap());
            assert!(from_this_host(local, peer));
            assert_eq!(local_peer_uid(local, peer), Some(me), "{peer}");
            assert_eq!(proc_peer_uid(local, peer), Some(me), "{peer}");
            match diag_uid(local, peer) {
                Ok(uid) => assert_eq!(uid, Some(me), "{peer}"),
                Err(e) => eprintln!("no sock_diag here ({e}): /proc only"),
            }
            // A port nothing uses is not found.
            let nobody = SocketAddr::new(peer.ip(), 1);
            assert_eq!(local_peer_uid(local, nobody), None);
        }
        assert!(!from_this_host(to, "192.0.2.1:5".parse().unwrap()));
        let v6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(v6) = v6 {
            let _c = std::net::TcpStream::connect(v6.local_addr().unwrap()).unwrap();
            let (s, p) = v6.accept().unwrap();
            assert_eq!(local_peer_uid(s.local_addr().unwrap(), p), Some(me));
            assert_eq!(proc_peer_uid(s.local_addr().unwrap(), p), Some(me));
        }
    }

    /// Every address of this host's interfaces is from this host (a local process may bind
    /// any of them as its source), loopback or not.
    #[test]
    fn the_hosts_own_addresses_are_from_this_host() {
        let addresses = interface_addresses().unwrap();
        assert!(addresses.iter().any(|ip| ip.is_loopback()), "{addresses:?}");
        let server: SocketAddr = "127.0.0.1:1".parse().unwrap();
        for ip in addresses {
            assert!(from_this_host(server, SocketAddr::new(ip, 40000)), "{ip}");
        }
    }
}
