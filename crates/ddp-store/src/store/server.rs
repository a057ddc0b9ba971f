//! The store's server: an accept thread and one thread per connection, the table of keys
//! ([`super::table`]) behind a mutex, and a condition variable that answers waiting requests
//! when keys appear.
//!
//! Before authentication a connection is held to deadlines (its first frame within 2 s, the
//! whole handshake within 4 s) and to a share of the handshake slots (16 per address, and on
//! this host per address and user; 128 in all). A newcomer past either closes a connection that
//! has not sent its hello (the oldest), so that a flood of silent connections, from one address
//! or many, delays a valid client by a handshake at most; one that has sent its hello, and may
//! be waiting for its turn, is never cut for a newcomer of its own address: the newcomer is
//! refused instead (past the 128, a newcomer may close the newest of an address holding more
//! than its own, so that no address holds them all). A source whose key exchanges failed waits
//! its turn for the next ([`super::throttle`]: on-line guessing slowed to a few tries a second,
//! never the job's own user on this host).
//! After it, a connection is held to the table's limits (with per-rank keys, each rank to its
//! share of the store and to [`MAX_CONNECTIONS_PER_RANK`] connections), and its waits end when
//! it closes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::keys;
use super::message::{Reply, Request, VERSION};
use super::table::{ConnectionUse, MAX_WAIT_KEYS, MAX_WAITING_KEYS, Table};
use super::throttle::{self, MAX_TURN_WAIT, Source, Throttle, Turn};
use super::{DEFAULT_IO_TIMEOUT, MAX_FRAME};
use crate::auth::{Exchange, Key, Side};
use crate::error::{CommError, Result};
use crate::refusals::RefusalLog;
use crate::wire::{ReadBy, read_frame, write_frame};

/// Largest handshake frame the server reads from a connection it does not trust yet.
const MAX_HANDSHAKE_FRAME: usize = 4096;
/// How long a new connection has to send its first frame (a client sends it at once).
pub(super) const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a new connection has for its whole handshake.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(4);
/// Most connections that may be in their handshake at once; a newcomer past it closes the
/// oldest that has not sent its hello, else the newest of the address holding the most (if it
/// holds more than the newcomer's), else it is refused (see `Handshakes::admit`).
const MAX_HANDSHAKES: usize = 128;
/// Most connections from one address (from this host: one address and user) that may be in
/// their handshake at once: a new one past it closes the oldest of them that has not sent its
/// hello, or is refused when all have. A flood from one address thus holds at most this many
/// slots, a client from the same address that completes its handshake quickly (about a
/// millisecond) still gets in, and one that waits its turn is never cut for a newer one.
const MAX_HANDSHAKES_PER_SOURCE: usize = 16;
/// Authenticated connections served at once unless [`StoreServer::limit_clients`] says
/// otherwise (each rank holds one or two; each launcher four: its rendezvous, its heartbeat,
/// its round watch and its hang doctor's progress exchange).
const DEFAULT_MAX_CLIENTS: usize = 256;
/// Connections one rank may hold at once in a store with per-rank keys. A rank holds its
/// process group's (for its whole life: the rendezvous, the trace clock, a re-forming) and,
/// while it sets up an NCCL communicator, that one's; a rank that hangs keeps its own until its
/// launcher kills it while its replacement, with the same key, opens the same two. Twice that.
pub const MAX_CONNECTIONS_PER_RANK: usize = 8;
/// Authenticated connections beyond the ranks' in a ranks' store
/// ([`StoreServer::limit_clients_to_ranks`]).
const CLIENTS_HEADROOM: usize = 16;
/// How often a connection waiting for its turn ([`super::throttle`]) looks again, and checks
/// that it is still open.
const TURN_POLL: Duration = Duration::from_millis(50);
/// Stack of a connection's thread (it serves one request at a time, with no recursion).
const CONNECTION_STACK: usize = 256 << 10;
/// The longest a `get`/`wait` waits on the server, whatever timeout it asked for.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How often a waiting request checks that its connection is still open: a client that
/// gave up and closed does not leave its wait (a thread) behind.
const CLOSED_CHECK_EVERY: Duration = Duration::from_millis(250);
/// The roles in the handshake's confirmations.
pub(super) const SERVER_ROLE: &str = "ddp-store server";
pub(super) const CLIENT_ROLE: &str = "ddp-store client";

/// Who the store serves, and the key it checks a client against.
enum Access {
    /// Anyone (a job that opted out of authentication).
    Open,
    /// Holders of the job's key, one key for every process (torchrun, srun, the launchers).
    Job(Key),
    /// Rank `r` with rank `r`'s own key, derived from the round's key held here
    /// ([`Key::rank_key`]); a connection may write only its own rank's entries
    /// ([`keys::owner`]).
    PerRank(Key),
}

/// What both sides of a handshake bind into their key exchange besides the key: the store's
/// protocol and the rank the client claims.
pub(super) fn exchange_context(rank: Option<u32>) -> Vec<u8> {
    let mut c = b"ddp-store v5 rank ".to_vec();
    match rank {
        Some(r) => c.extend_from_slice(r.to_string().as_bytes()),
        None => c.extend_from_slice(b"-"),
    }
    c
}
/// Most keys one connection may ask to be counted when it ends.
const MAX_ON_CLOSE: usize = 4;
/// How often the accept loop checks for shutdown (it wakes at once for new connections).
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Where a connection comes from, as its handshake slots are counted: another host's address
/// (IPv6 by its /64, as the throttle counts it, so that one source's waiting exchanges are at
/// most a room's), or an address of this host and the user whose socket it is, so that another
/// local user's handshakes (from 127.0.0.1 like the job's) never take the job's user's room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Origin {
    /// The address ([`throttle::remote_address`] from another host).
    ip: IpAddr,
    /// From this host (loopback, or an address of this host's interfaces).
    local: bool,
    /// From this host: the user whose socket it is, where the kernel names one.
    uid: Option<u32>,
}

/// What [`Handshakes::admit`] decided for a newcomer.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    /// Admitted, having closed this connection to make room, if any.
    In(Option<(u64, Origin)>),
    /// Refused: the room it could take is held by connections that have sent their hello.
    Refused,
}

/// The handshakes of one origin.
#[derive(Default)]
struct Room {
    /// Its connections in their handshake, oldest first.
    conns: VecDeque<u64>,
    /// Slots of exchanges that failed while the room was full, taken until these moments
    /// ([`throttle::reopen_delay`]).
    reopen: Vec<Instant>,
}

impl Room {
    /// The slots taken: its connections', and those not reopened yet.
    fn taken(&self) -> usize {
        self.conns.len() + self.reopen.len()
    }
}

/// The connections in their handshake, by where they come from.
#[derive(Default)]
struct Handshakes {
    rooms: HashMap<Origin, Room>,
    /// Those that sent a valid hello (and may be waiting for their turn to exchange keys).
    spoken: HashSet<u64>,
    /// Connections in all rooms.
    total: usize,
}

impl Handshakes {
    /// Registers connection `id` from `origin`, unless it is refused; the connection to close
    /// to make room, if any. A client's hello comes at once, so a connection that has not sent
    /// one is a flood's, and is the one closed: `origin`'s oldest when `origin` holds its share,
    /// else the oldest of all when every slot is taken. One that has sent its hello (it may be
    /// waiting for its turn, [`super::throttle`]) is never closed for a newcomer of its own
    /// origin: with `origin`'s share all such, the newcomer is refused. With every slot taken
    /// by such, the newest of the origin holding the most is closed if that origin holds more
    /// than `origin` would (any other origin's, for the store's own user: `priority`), else the
    /// newcomer is refused; the newest, so that a connection waiting for its turn keeps its
    /// place while newer ones come and go.
    fn admit(&mut self, origin: Origin, id: u64, priority: bool, now: Instant) -> Admission {
        self.rooms.retain(|_, room| {
            room.reopen.retain(|at| *at > now);
            room.taken() > 0
        });
        let (taken, held) = self
            .rooms
            .get(&origin)
            .map_or((0, 0), |room| (room.taken(), room.conns.len()));
        let cut = if taken >= MAX_HANDSHAKES_PER_SOURCE {
            match self.oldest_silent(|o| o == origin) {
                Some(cut) => Some(cut),
                None => return Admission::Refused,
            }
        } else if self.total >= MAX_HANDSHAKES {
            match self
                .oldest_silent(|_| true)
                .or_else(|| self.newest_of_the_largest(origin, held, priority))
            {
                Some(cut) => Some(cut),
                None => return Admission::Refused,
            }
        } else {
            None
        };
        if let Some((old, from)) = cut {
            self.finish(from, old);
        }
        self.rooms.entry(origin).or_default().conns.push_back(id);
        self.total += 1;
        Admission::In(cut)
    }

    /// The oldest connection that has not sent its hello, of the origins `of` takes.
    fn oldest_silent(&self, of: impl Fn(Origin) -> bool) -> Option<(u64, Origin)> {
        self.rooms
            .iter()
            .filter(|(o, _)| of(**o))
            .filter_map(|(o, room)| {
                room.conns
                    .iter()
                    .copied()
                    .find(|c| !self.spoken.contains(c))
                    .map(|id| (id, *o))
            })
            .min_by_key(|(id, _)| *id)
    }

    /// The newest connection of the origin, other than `newcomer` (which holds `held`), that
    /// holds the most: only if it holds at least two more than `held` (so that it is left with
    /// no fewer than the newcomer's), or any with `priority`.
    fn newest_of_the_largest(
        &self,
        newcomer: Origin,
        held: usize,
        priority: bool,
    ) -> Option<(u64, Origin)> {
        self.rooms
            .iter()
            .filter(|(o, room)| **o != newcomer && (priority || room.conns.len() >= held + 2))
            .filter_map(|(o, room)| {
                let newest = room.conns.iter().max()?;
                Some((room.conns.len(), *newest, *o))
            })
            .max_by_key(|(len, newest, _)| (*len, *newest))
            .map(|(_, newest, o)| (newest, o))
    }

    /// Connection `id` sent a valid hello.
    fn spoke(&mut self, id: u64) {
        self.spoken.insert(id);
    }

    /// The key exchange of a connection from `origin` failed: if its room is full, the slot
    /// stays taken `for_` after the connection ends.
    fn failed(&mut self, origin: Origin, for_: Duration, now: Instant) {
        if let Some(room) = self.rooms.get_mut(&origin)
            && room.taken() >= MAX_HANDSHAKES_PER_SOURCE
        {
            room.reopen.push(now + for_);
        }
    }

    /// Connection `id` from `origin` ended its handshake (unless it was closed already).
    fn finish(&mut self, origin: Origin, id: u64) {
        self.spoken.remove(&id);
        if let Some(room) = self.rooms.get_mut(&origin) {
            if let Some(i) = room.conns.iter().position(|&c| c == id) {
                room.conns.remove(i);
                self.total -= 1;
            }
            if room.taken() == 0 {
                self.rooms.remove(&origin);
            }
        }
    }
}

struct Shared {
    table: Mutex<Table>,
    changed: Condvar,
    /// Who is served, and with which key.
    access: Access,
    shutdown: AtomicBool,
    /// Clones of open connections, so that shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Connections that have not finished their handshake.
    handshakes: Mutex<Handshakes>,
    /// Authenticated connections open now, and the most allowed.
    clients: AtomicUsize,
    max_clients: AtomicUsize,
    /// Authenticated connections open now by rank (with per-rank keys).
    rank_clients: Mutex<HashMap<u32, usize>>,
    /// The penalties of sources whose key exchanges failed.
    throttle: Mutex<Throttle>,
    /// The user whose processes on this host are never held back by the throttle (the
    /// store's own: they could read the token anyway); `None`: every user is.
    trusted_uid: Mutex<Option<u32>>,
    refusals: RefusalLog,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic in a connection thread must not take the store down with it.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handshakes(&self) -> MutexGuard<'_, Handshakes> {
        self.handshakes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn throttle(&self) -> MutexGuard<'_, Throttle> {
        self.throttle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn rank_clients(&self) -> MutexGuard<'_, HashMap<u32, usize>> {
        self.rank_clients.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where a connection from `peer` over `stream` comes from: from this host, the user whose
    /// socket it is, asked of the kernel (one `sock_diag` lookup) as soon as it is accepted.
    fn origin_of(&self, stream: &TcpStream, peer: SocketAddr) -> Origin {
        let local = stream
            .local_addr()
            .ok()
            .filter(|local| throttle::from_this_host(*local, peer));
        Origin {
            ip: match local {
                Some(_) => peer.ip(),
                None => throttle::remote_address(peer.ip()),
            },
            local: local.is_some(),
            uid: local.and_then(|local| throttle::local_peer_uid(local, peer)),
        }
    }

    /// Whether `origin` is a process of the store's own user on this host, never held back.
    fn trusted(&self, origin: Origin) -> bool {
        let trusted = *self.trusted_uid.lock().unwrap_or_else(|p| p.into_inner());
        origin.local && origin.uid.is_some() && origin.uid == trusted
    }

    /// The source a key exchange from `origin` is charged to: another host's address, or on
    /// this host the user (one source for all of a user's local addresses, and one for all
    /// whose user is unknown); `None` for the store's own user on this host, never held back.
    fn source_of(&self, origin: Origin) -> Option<Source> {
        if !origin.local {
            Some(Source::remote(origin.ip))
        } else if self.trusted(origin) {
            None
        } else {
            Some(Source::local(origin.uid))
        }
    }
}

/// Serves the store on a background thread until dropped.
///
/// Each connection gets its own thread. Dropping the server stops accepting, closes every
/// connection (clients see an error naming the store), wakes every waiting request and joins
/// all threads.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field(
                "access",
                &match self.shared.access {
                    Access::Open => "open",
                    Access::Job(_) => "job key",
                    Access::PerRank(_) => "per-rank keys",
                },
            )
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and serves until dropped.
    /// Only clients that prove they hold `token`'s key (when `Some`) are served; the proof is
    /// a password-authenticated key exchange ([`crate::auth::Exchange`]): neither the token
    /// nor anything to test a guess of it against crosses the wire, and the server proves it
    /// holds the key too. `None` serves anyone: only for a job that opted out of
    /// authentication.
    ///
    /// Exactly the given address is bound; pass `0.0.0.0:PORT` explicitly to listen on all
    /// interfaces.
    pub fn bind(addr: &str, token: Option<String>) -> Result<Self> {
        let access = match token {
            Some(t) => Access::Job(Key::from_token(&t)),
            None => Access::Open,
        };
        Self::bind_with(addr, access)
    }

    /// As [`Self::bind`], for ranks that each hold a key of their own (`ddprun`'s):
    /// `round_token` is the round's token, rank `r`'s key is `Key::from_token(round_token)
    /// .rank_key(r)`, a client proves the key of the rank it claims to be, and may then write
    /// only that rank's entries ([`keys::owner`]: its address, and rank 0's NCCL id) — a
    /// process holding one rank's key cannot pass for another rank. Every entry is charged to
    /// the rank that writes it, each rank held to its share of the store, and to
    /// [`MAX_CONNECTIONS_PER_RANK`] connections (see [`Self::limit_clients_to_ranks`]): one
    /// rank's key can fill neither the store nor its connections.
    pub fn bind_per_rank(addr: &str, round_token: &str) -> Result<Self> {
        Self::bind_with(addr, Access::PerRank(Key::from_token(round_token)))
    }

    fn bind_with(addr: &str, access: Access) -> Result<Self> {
        let op = || format!("binding the rendezvous store to {addr}");
        let listener = TcpListener::bind(addr).map_err(|e| CommError::io(op(), None, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| CommError::io(op(), None, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io(op(), None, e))?;
        let table = match access {
            Access::PerRank(_) => Table::per_rank(),
            _ => Table::default(),
        };
        // SAFETY: no preconditions.
        let own_uid = unsafe { libc::geteuid() };
        let shared = Arc::new(Shared {
            table: Mutex::new(table),
            changed: Condvar::new(),
            access,
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            handshakes: Mutex::new(Handshakes::default()),
            clients: AtomicUsize::new(0),
            max_clients: AtomicUsize::new(DEFAULT_MAX_CLIENTS),
            rank_clients: Mutex::new(HashMap::new()),
            throttle: Mutex::new(Throttle::default()),
            trusted_uid: Mutex::new(Some(own_uid)),
            refusals: RefusalLog::new(format!("rendezvous store at {local}")),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("ddp-store-accept".into())
                .spawn(move || accept_loop(listener, shared))
                .map_err(|e| CommError::io("starting the rendezvous store thread", None, e))?
        };
        tracing::debug!(addr = %local, "rendezvous store listening");
        Ok(StoreServer {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Serves at most `n` authenticated connections at once (256 unless set); a client past
    /// the limit is told so and closed. Size it from the job: each rank holds one or two
    /// connections, each launcher four.
    pub fn limit_clients(&self, n: usize) {
        self.shared.max_clients.store(n.max(1), Ordering::Relaxed);
    }

    /// Sizes the limits of the ranks' store of a job of `world` ranks. With per-rank keys
    /// ([`Self::bind_per_rank`]): each rank may hold [`MAX_CONNECTIONS_PER_RANK`] connections
    /// (one rank's key cannot take another's), `MAX_CONNECTIONS_PER_RANK × world + 16` in all,
    /// and each rank's share of the store is its room divided by `world` (by 4 at most).
    /// With one key for every rank (torchrun's): 2 × `world` + 16 connections (each rank holds
    /// one, and a second while it reconnects or a replacement rejoins).
    pub fn limit_clients_to_ranks(&self, world: usize) {
        self.shared.lock().set_world(world);
        let n = match self.shared.access {
            Access::PerRank(_) => MAX_CONNECTIONS_PER_RANK * world + CLIENTS_HEADROOM,
            _ => 2 * world + CLIENTS_HEADROOM,
        };
        self.limit_clients(n);
    }

    /// Holds back every user's key exchanges after failures, the store's own user's too (the
    /// throttle's tests, whose guesses come from this process).
    #[cfg(test)]
    pub(super) fn trust_no_local_user(&self) {
        *self
            .shared
            .trusted_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// What rank `rank`'s entries use of its share of the store: keys, and their cost in bytes.
    pub fn rank_usage(&self, rank: u32) -> (usize, usize) {
        let used = self.shared.lock().rank_usage(rank);
        (used.keys, used.bytes)
    }

    /// Authenticated connections open now.
    pub fn open_connections(&self) -> usize {
        self.shared.clients.load(Ordering::SeqCst)
    }

    /// How many keys the store holds, and what they cost it in bytes (keys, values and each
    /// entry's overhead, as the 64 MiB quota counts them).
    pub fn usage(&self) -> (usize, usize) {
        self.shared.lock().usage()
    }

    /// Connections refused so far: without a valid handshake, closed to make room for
    /// newer ones, or past the client limit.
    pub fn refused_connections(&self) -> u64 {
        self.shared.refusals.total()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
        }
        self.shared.changed.notify_all();
        if let Some(handle) = self.accept.take() {
            let _ = handle.join();
        }
        self.shared.refusals.flush(true);
        tracing::debug!(addr = %self.addr, "rendezvous store stopped");
    }
}

/// Waits until the listening socket is readable (a connection is pending) or `timeout` passes.
fn poll_readable(listener: &TcpListener, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
    unsafe {
        libc::poll(&mut pfd, 1, ms);
    }
}

/// Whether the peer of `stream` has closed its end (or the connection broke).
fn peer_closed(stream: &TcpStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.shutdown.load(Ordering::SeqCst) {
        shared.refusals.flush(false);
        match listener.accept() {
            Ok((stream, peer)) => {
                workers.retain(|h| !h.is_finished());
                admit(stream, peer, &shared, &mut workers);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                poll_readable(&listener, ACCEPT_POLL);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Transient (EMFILE, ECONNABORTED, …): log and keep serving.
                tracing::warn!("rendezvous store: accept failed: {e}");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
    drop(listener);
    for (_, s) in shared.conns().drain() {
        let _ = s.shutdown(Shutdown::Both);
    }
    for h in workers {
        let _ = h.join();
    }
}

/// Starts serving a new connection on a thread of its own, within the handshake limits.
fn admit(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    workers: &mut Vec<JoinHandle<()>>,
) {
    // A port scan or a flood must not exhaust rank 0's threads or memory: at most
    // MAX_HANDSHAKES connections are in their handshake at once, one address (one address and
    // user, from this host) holds at most MAX_HANDSHAKES_PER_SOURCE of them, and a newcomer
    // past either limit closes one that has not sent its hello, or is refused (see
    // `Handshakes::admit`).
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let origin = shared.origin_of(&stream, peer);
    let _ = stream.set_nodelay(true);
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    shared.conns().insert(id, clone);
    // Close the race with shutdown: a connection registered after the final sweep would
    // never be unblocked.
    if shared.shutdown.load(Ordering::SeqCst) {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let admission = shared
        .handshakes()
        .admit(origin, id, shared.trusted(origin), Instant::now());
    match admission {
        Admission::Refused => {
            shared.conns().remove(&id);
            // Closed without a word: a client retries within its connect deadline.
            let _ = stream.shutdown(Shutdown::Both);
            shared.refusals.note(
                peer.ip(),
                "refused: its address's handshakes have all sent their hello",
            );
            return;
        }
        Admission::In(Some((old, from))) => {
            if let Some(s) = shared.conns().remove(&old) {
                let _ = s.shutdown(Shutdown::Both);
            }
            shared.refusals.note(
                from.ip,
                "closed for newer ones (a silent or the newest handshake)",
            );
        }
        Admission::In(None) => {}
    }
    let sh = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("ddp-store-conn".into())
        .stack_size(CONNECTION_STACK)
        .spawn(move || {
            serve_connection(stream, peer, origin, id, &sh);
            sh.conns().remove(&id);
        });
    match spawned {
        Ok(h) => workers.push(h),
        Err(e) => {
            tracing::warn!(%peer, "rendezvous store: cannot start a thread: {e}");
            shared.handshakes().finish(origin, id);
            if let Some(s) = shared.conns().remove(&id) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

fn serve_connection(stream: TcpStream, peer: SocketAddr, origin: Origin, id: u64, shared: &Shared) {
    let authenticated = handshake(stream, peer, origin, id, shared);
    shared.handshakes().finish(origin, id);
    let Some((mut stream, writer)) = authenticated else {
        return;
    };
    // The client proved the key: it may learn why it is refused (and retries).
    let refuse = |stream: &mut TcpStream, why: String, log: &'static str| {
        shared.refusals.note(peer.ip(), log);
        let _ = send(stream, &Reply::Refused(why));
        let _ = stream.shutdown(Shutdown::Both);
    };
    if let Some(rank) = writer {
        let mut by_rank = shared.rank_clients();
        let held = by_rank.entry(rank).or_default();
        if *held >= MAX_CONNECTIONS_PER_RANK {
            drop(by_rank);
            let why = format!(
                "rank {rank} holds {MAX_CONNECTIONS_PER_RANK} connections to the store, the most \
                 one rank may"
            );
            refuse(&mut stream, why, "past its rank's connection limit");
            return;
        }
        *held += 1;
    }
    let max = shared.max_clients.load(Ordering::Relaxed);
    if shared.clients.fetch_add(1, Ordering::SeqCst) >= max {
        shared.clients.fetch_sub(1, Ordering::SeqCst);
        release_rank(shared, writer);
        let why = format!("the store serves at most {max} connections at once");
        refuse(&mut stream, why, "past the client limit");
        return;
    }
    if send(&mut stream, &Reply::Ok).is_ok() {
        tracing::debug!(%peer, "rendezvous store: client connected");
        serve_requests(stream, peer, writer, shared);
    }
    shared.clients.fetch_sub(1, Ordering::SeqCst);
    release_rank(shared, writer);
}

/// A connection of rank `writer` (with per-rank keys) ended: one fewer counted for it.
fn release_rank(shared: &Shared, writer: Option<u32>) {
    let Some(rank) = writer else {
        return;
    };
    let mut by_rank = shared.rank_clients();
    if let Some(held) = by_rank.get_mut(&rank) {
        *held -= 1;
        if *held == 0 {
            by_rank.remove(&rank);
        }
    }
}

/// Waits until connection `id` from `source` may start its key exchange ([`Throttle::turn`]):
/// `true` then, `false` if it closed, was cut for a newer one, the store stops, or its turn
/// is more than [`MAX_TURN_WAIT`] away.
fn wait_for_turn(stream: &TcpStream, id: u64, source: Source, shared: &Shared) -> bool {
    let since = Instant::now();
    if !shared.throttle().queue(source, id, since) {
        return true;
    }
    loop {
        let now = Instant::now();
        let wait = match shared.throttle().turn(source, id, now) {
            Turn::Go => return true,
            Turn::Wait(wait) => wait,
        };
        let gone = shared.shutdown.load(Ordering::SeqCst)
            || !shared.conns().contains_key(&id)
            || now.duration_since(since) >= MAX_TURN_WAIT
            || closed_within(stream, wait.min(TURN_POLL));
        if gone {
            shared.throttle().leave(source, id);
            return false;
        }
    }
}

/// Waits up to `timeout` for `stream` to be closed (by its peer, or shut down here to cut it);
/// whether it was.
fn closed_within(stream: &TcpStream, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn send(stream: &mut TcpStream, reply: &Reply) -> io::Result<()> {
    write_frame(stream, &reply.encode(), MAX_FRAME)
}

/// Reads and checks the client's handshake; the stream of a client that proved the key (not
/// yet answered) and the rank it proved to be (with per-rank keys), else `None`.
fn handshake(
    mut stream: TcpStream,
    peer: SocketAddr,
    origin: Origin,
    id: u64,
    shared: &Shared,
) -> Option<(TcpStream, Option<u32>)> {
    // The peer is not trusted yet: bounded size, and deadlines for the first frame and for
    // the whole handshake however the bytes trickle in.
    let _ = stream.set_write_timeout(Some(FIRST_FRAME_TIMEOUT));
    let started = Instant::now();
    let source_ip = peer.ip();
    let refuse = |stream: &mut TcpStream, why: &'static str| {
        // One closed to make room for newer ones was counted then.
        if shared.conns().contains_key(&id) {
            shared.refusals.note(source_ip, why);
        }
        // The peer is not trusted: it learns nothing but the refusal.
        let _ = send(stream, &Reply::Refused("refused".into()));
        let _ = stream.shutdown(Shutdown::Both);
    };
    let first = read_frame(
        &mut ReadBy::new(&stream, started + FIRST_FRAME_TIMEOUT),
        MAX_HANDSHAKE_FRAME,
    );
    let frame = match first {
        Ok(Some(f)) => f,
        // Connected and closed (a port probe), or closed to make room for newer ones.
        Ok(None) => return None,
        Err(_) if shared.shutdown.load(Ordering::SeqCst) => return None,
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            refuse(&mut stream, "silent past the first frame's deadline");
            return None;
        }
        Err(_) => {
            refuse(&mut stream, "without a valid handshake");
            return None;
        }
    };
    let (claimed, theirs) = match Request::decode(&frame) {
        Ok(Request::Hello {
            version,
            rank,
            exchange,
        }) if version == VERSION => (rank, exchange),
        Ok(Request::Hello { .. }) => {
            refuse(&mut stream, "of another protocol version");
            return None;
        }
        _ => {
            refuse(&mut stream, "without a valid handshake");
            return None;
        }
    };
    let (key, writer) = match (&shared.access, claimed) {
        (Access::Open, _) => return Some((stream, None)),
        (Access::Job(key), _) => (key.clone(), None),
        (Access::PerRank(round), Some(rank)) => (round.rank_key(rank), Some(rank)),
        (Access::PerRank(_), None) => {
            refuse(&mut stream, "without a rank's key");
            return None;
        }
    };
    shared.handshakes().spoke(id);
    // Each exchange tests one guess of the token: a source whose exchanges failed waits its
    // turn (never the store's own user on this host).
    let throttled = shared.source_of(origin);
    if let Some(source) = throttled
        && !wait_for_turn(&stream, id, source, shared)
    {
        if shared.conns().contains_key(&id) && !shared.shutdown.load(Ordering::SeqCst) {
            shared
                .refusals
                .note(source_ip, "waiting past its turn (failed key exchanges)");
        }
        // Closed without a word: a client retries within its connect deadline.
        let _ = stream.shutdown(Shutdown::Both);
        return None;
    }
    let turn = Instant::now();
    let failed = || {
        if let Some(source) = throttled {
            let now = Instant::now();
            let penalty = shared.throttle().failed(source, now);
            shared
                .handshakes()
                .failed(origin, throttle::reopen_delay(penalty), now);
        }
    };
    let context = exchange_context(claimed);
    let (exchange, ours) = Exchange::start(Side::Server, &key, &context);
    let Some(session) = exchange.finish(&theirs) else {
        failed();
        refuse(&mut stream, "without a proof of the job token");
        return None;
    };
    let challenge = Reply::Challenge {
        exchange: ours,
        mac: session.confirm(SERVER_ROLE, &[]).to_vec(),
    };
    if send(&mut stream, &challenge).is_err() {
        return None;
    }
    // A connection that waited for its turn has its first frame's time for the rest.
    let proof_by = (started + HANDSHAKE_TIMEOUT).max(turn + FIRST_FRAME_TIMEOUT);
    let proof = read_frame(&mut ReadBy::new(&stream, proof_by), MAX_HANDSHAKE_FRAME);
    let proven = proof
        .ok()
        .flatten()
        .and_then(|f| match Request::decode(&f) {
            Ok(Request::Proof { mac }) => Some(mac),
            _ => None,
        })
        .is_some_and(|mac| session.verify(&mac, CLIENT_ROLE, &[]));
    if !proven {
        if !shared.shutdown.load(Ordering::SeqCst) {
            // The answer to its guess went out with the challenge: counted, however it ends.
            failed();
            refuse(&mut stream, "without a valid proof of the job token");
        }
        return None;
    }
    Some((stream, writer))
}

/// Serves an accepted client's requests until it closes the connection or the store stops.
/// `writer`: the rank the client proved to be (with per-rank keys), which may write only its
/// own entries.
fn serve_requests(mut stream: TcpStream, peer: SocketAddr, writer: Option<u32>, shared: &Shared) {
    // Accepted clients may stay idle for a whole training run: no read timeout. Shutdown
    // unblocks the read by closing the socket.
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(DEFAULT_IO_TIMEOUT));
    // Counters to add 1 to when this connection ends, however it ends.
    let mut on_close: Vec<String> = Vec::new();
    let mut usage = ConnectionUse::of(writer);
    loop {
        let frame = match read_frame(&mut stream, MAX_FRAME) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                if !shared.shutdown.load(Ordering::SeqCst) {
                    tracing::debug!(%peer, "rendezvous store: connection ended: {e}");
                }
                break;
            }
        };
        let request = Request::decode(&frame);
        let refusal = request.as_ref().ok().and_then(|r| not_its_own(writer, r));
        let reply = match (refusal, request) {
            (Some(refusal), _) => refusal,
            (None, Ok(Request::Hello { .. } | Request::Proof { .. }) | Err(_)) => {
                tracing::warn!(%peer, "rendezvous store: malformed request from {peer}; closing");
                let _ = send(&mut stream, &Reply::Error("malformed request".into()));
                break;
            }
            (None, Ok(Request::OnClose { key })) if keys::forward_only(&key) => {
                Reply::Error(format!(
                    "{} only moves forward by a compare-and-set; it cannot be counted at a \
                     connection's end",
                    super::table::shown(&key)
                ))
            }
            (None, Ok(Request::OnClose { key })) if on_close.len() < MAX_ON_CLOSE => {
                match Table::check_key(&key) {
                    Ok(()) => {
                        on_close.push(key);
                        Reply::Ok
                    }
                    Err(reply) => reply,
                }
            }
            (None, Ok(Request::OnClose { .. })) => Reply::Error(format!(
                "at most {MAX_ON_CLOSE} keys per connection may be counted at its end"
            )),
            (None, Ok(request)) => handle_request(request, shared, &stream, &mut usage),
        };
        if send(&mut stream, &reply).is_err() {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
    for key in on_close {
        // Counted whatever this connection created: the count is how its end is seen.
        let _ = shared.lock().add(key, 1, &mut ConnectionUse::of(writer));
        shared.changed.notify_all();
    }
}

/// The error for a rank-keyed client that asks to change another rank's entry, if it does.
fn not_its_own(writer: Option<u32>, request: &Request) -> Option<Reply> {
    let rank = writer?;
    let key = match request {
        Request::Set { key, .. }
        | Request::SetOnce { key, .. }
        | Request::Add { key, .. }
        | Request::CompareSet { key, .. }
        | Request::OnClose { key } => key,
        _ => return None,
    };
    let owner = keys::owner(key)?;
    (owner != rank as usize).then(|| {
        Reply::Error(format!(
            "rank {rank} may not change {}: it is rank {owner}'s",
            super::table::shown(key)
        ))
    })
}

fn handle_request(
    request: Request,
    shared: &Shared,
    stream: &TcpStream,
    usage: &mut ConnectionUse,
) -> Reply {
    let changes = matches!(
        request,
        Request::Set { .. }
            | Request::SetOnce { .. }
            | Request::Add { .. }
            | Request::CompareSet { .. }
    );
    let reply = match request {
        Request::Set { key, value } => shared.lock().set(key, value, usage),
        Request::SetOnce { key, value } => shared.lock().set_once(key, value, usage),
        Request::Add { key, delta } => shared.lock().add(key, delta, usage),
        Request::CompareSet {
            key,
            expected,
            desired,
        } => shared.lock().compare_set(key, expected, desired, usage),
        Request::TryGet { key } => match Table::check_key(&key) {
            Err(reply) => reply,
            Ok(()) => match shared.lock().get(&key) {
                Some(v) => Reply::Value(v.clone()),
                None => Reply::Missing,
            },
        },
        Request::Get { key, timeout } => {
            match wait_for(shared, std::slice::from_ref(&key), timeout, stream) {
                Ok(st) => st
                    .get(&key)
                    .map_or(Reply::Missing, |v| Reply::Value(v.clone())),
                Err(reply) => reply,
            }
        }
        Request::Wait { keys, timeout } => match wait_for(shared, &keys, timeout, stream) {
            Ok(_) => Reply::Ok,
            Err(reply) => reply,
        },
        Request::Hello { .. } | Request::Proof { .. } | Request::OnClose { .. } => {
            Reply::Error("malformed request".into())
        }
    };
    if changes && matches!(reply, Reply::Ok | Reply::Int(_)) {
        shared.changed.notify_all();
    }
    reply
}

/// Waits up to `timeout` (at most [`MAX_WAIT`]) until every key in `keys` exists: the table,
/// still locked, once they all do; else the reply to send (a timeout naming a missing key,
/// the store's shutdown, a limit). A wait whose client closed its connection ends early.
fn wait_for<'a>(
    shared: &'a Shared,
    keys: &[String],
    timeout: Duration,
    stream: &TcpStream,
) -> std::result::Result<MutexGuard<'a, Table>, Reply> {
    if keys.len() > MAX_WAIT_KEYS {
        return Err(Reply::Error(format!(
            "a wait names {} keys, more than the store's limit of {MAX_WAIT_KEYS}",
            keys.len()
        )));
    }
    for key in keys {
        Table::check_key(key)?;
    }
    // No request waits forever: `Duration::MAX` and the like are clamped.
    let deadline = Instant::now() + timeout.min(MAX_WAIT);
    let mut st = shared.lock();
    if st.waiting_keys + keys.len() > MAX_WAITING_KEYS {
        return Err(Reply::Error(format!(
            "the store's waits already name {} keys, its limit",
            st.waiting_keys
        )));
    }
    st.waiting_keys += keys.len();
    // Keys never disappear: the ones found stay found.
    let mut found = 0;
    let outcome = loop {
        if st.shutdown {
            break Err(Reply::Error(
                "the store is shutting down (did rank 0 exit?)".into(),
            ));
        }
        while found < keys.len() && st.contains(&keys[found]) {
            found += 1;
        }
        if found == keys.len() {
            break Ok(());
        }
        let now = Instant::now();
        if deadline <= now {
            break Err(Reply::Timeout(keys[found].clone()));
        }
        st = shared
            .changed
            .wait_timeout(st, (deadline - now).min(CLOSED_CHECK_EVERY))
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if peer_closed(stream) {
            break Err(Reply::Error("the client closed its connection".into()));
        }
    };
    st.waiting_keys -= keys.len();
    outcome.map(|()| st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(n: u8) -> Origin {
        Origin {
            ip: IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, n)),
            local: false,
            uid: None,
        }
    }

    fn local(uid: u32) -> Origin {
        Origin {
            ip: IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            local: true,
            uid: Some(uid),
        }
    }

    /// Fills `origin`'s room with connections `ids`, each having sent its hello if `spoken`.
    fn fill(h: &mut Handshakes, origin: Origin, ids: std::ops::Range<u64>, spoken: bool) {
        let now = Instant::now();
        for id in ids {
            assert_eq!(h.admit(origin, id, false, now), Admission::In(None));
            if spoken {
                h.spoke(id);
            }
        }
    }

    /// A newcomer to a full room closes the room's oldest silent connection; with every
    /// connection of the room spoken (waiting for its turn), it is refused and none is cut.
    #[test]
    fn a_connection_that_sent_its_hello_is_never_cut_for_its_own_origins_newcomer() {
        let mut h = Handshakes::default();
        let now = Instant::now();
        let a = remote(1);
        fill(&mut h, a, 0..14, true);
        fill(&mut h, a, 14..16, false);
        assert_eq!(h.admit(a, 16, false, now), Admission::In(Some((14, a))));
        h.spoke(16);
        assert_eq!(h.admit(a, 17, false, now), Admission::In(Some((15, a))));
        h.spoke(17);
        // All 16 spoken: refused, whoever comes, the store's own user's priority included.
        assert_eq!(h.admit(a, 18, false, now), Admission::Refused);
        assert_eq!(h.admit(a, 19, true, now), Admission::Refused);
        assert_eq!(h.total, 16);
        // Another origin has its own room; another local user too.
        assert_eq!(h.admit(remote(2), 20, false, now), Admission::In(None));
        fill(&mut h, local(1000), 21..37, true);
        assert_eq!(h.admit(local(0), 37, false, now), Admission::In(None));
        // One ends: its slot is free at once.
        h.finish(a, 3);
        assert_eq!(h.admit(a, 38, false, now), Admission::In(None));
    }

    /// A slot freed by an exchange that failed in a full room stays taken until its moment.
    #[test]
    fn a_failed_exchanges_slot_in_a_full_room_reopens_later() {
        let mut h = Handshakes::default();
        let now = Instant::now();
        let a = remote(1);
        fill(&mut h, a, 0..16, true);
        h.failed(a, Duration::from_millis(100), now);
        h.finish(a, 0);
        assert_eq!(h.admit(a, 16, false, now), Admission::Refused);
        let later = now + Duration::from_millis(101);
        assert_eq!(h.admit(a, 17, false, later), Admission::In(None));
        // In a room with space, a failure holds nothing.
        let b = remote(2);
        fill(&mut h, b, 100..104, true);
        h.failed(b, Duration::from_secs(60), now);
        h.finish(b, 100);
        fill(&mut h, b, 104..117, false);
        assert_eq!(h.rooms[&b].taken(), 16);
    }

    /// Past the 128 slots, all spoken: a newcomer closes the newest connection of the origin
    /// holding the most, if it holds at least two more than the newcomer's; else it is refused,
    /// unless it is the store's own user's.
    #[test]
    fn past_every_slot_the_largest_origin_gives_up_its_newest() {
        let mut h = Handshakes::default();
        let now = Instant::now();
        for n in 0..8u8 {
            let first = u64::from(n) * 16;
            fill(&mut h, remote(n), first..first + 16, true);
        }
        assert_eq!(h.total, MAX_HANDSHAKES);
        // The newest of the (equally) largest origins: 127, of remote(7).
        assert_eq!(
            h.admit(remote(100), 200, false, now),
            Admission::In(Some((127, remote(7))))
        );
        h.spoke(200);
        // Every origin but remote(7) holds 16; remote(7) 15, remote(100) 1.
        assert_eq!(
            h.admit(remote(100), 201, false, now),
            Admission::In(Some((111, remote(6))))
        );
        h.spoke(201);
        // Now 128 origins of one spoken connection each: a newcomer of one is refused...
        let mut h = Handshakes::default();
        for n in 0..128u64 {
            let o = Origin {
                ip: IpAddr::V4(std::net::Ipv4Addr::from(0x0a01_0000 + n as u32)),
                local: false,
                uid: None,
            };
            fill(&mut h, o, n..n + 1, true);
        }
        assert_eq!(h.admit(remote(1), 500, false, now), Admission::Refused);
        // ...but the store's own user gets in.
        assert!(matches!(
            h.admit(local(0), 501, true, now),
            Admission::In(Some(_))
        ));
        // A silent one, anywhere, is always closed first.
        let mut h = Handshakes::default();
        fill(&mut h, remote(1), 0..1, false);
        for n in 0..8u8 {
            let first = 1 + u64::from(n) * 16;
            fill(&mut h, remote(2 + n), first..(first + 16).min(128), true);
        }
        assert_eq!(h.total, MAX_HANDSHAKES);
        assert_eq!(
            h.admit(remote(50), 128, false, now),
            Admission::In(Some((0, remote(1))))
        );
        // A full room of spoken ones refuses its own newcomer even so.
        assert_eq!(h.admit(remote(3), 129, false, now), Admission::Refused);
    }
}
