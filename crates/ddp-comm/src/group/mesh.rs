//! Building the full mesh of peer links once every rank's address is known.
//!
//! Rank `i` connects to every rank below it and accepts every rank above it, so there is no
//! cycle of waits: connectors first send their hello to all lower ranks, then accept the higher
//! ranks, then read the replies. Every rank publishes, once and unchangeably (the store's
//! `set_once`), its address, a fresh nonce and the public half of a fresh identity
//! ([`crate::auth::Identity`]). A hello carries the connector's rank, its own nonce and its
//! signature over both nonces and the rank: the identities come from the authenticated store
//! (where, under `ddprun`, only rank `r` may write rank `r`'s entry), so only rank `r` can sign
//! as rank `r`, a hello recorded in an earlier rendezvous proves nothing in this one, and
//! nothing on these links depends on the token (a recorded hello gives nothing to test a
//! guess of it against). The acceptor's reply carries its signature in turn (whoever squats a
//! rank's port cannot answer). Hellos are read concurrently, each within a few seconds and
//! with a share per address, so silent connections cannot hold the rendezvous; one without a
//! valid signature, an out-of-range or duplicate rank is refused (counted in a summary log) and
//! the listener keeps accepting.
//! A rank connects to a peer on the same host through the Unix socket the peer published (in a
//! directory only the job's user can enter, see [`super::local_socket`]), to one on another
//! host over TCP.
//! For a peer it reaches through the Unix socket the connector creates a shared-memory segment
//! and names it in the hello; the acceptor maps it (only from a hello that came on its Unix
//! socket, and only a segment of this user's, see [`ShmPair::open`]) and says so in its reply;
//! the connector then unlinks it. The connector holds each segment it created as a
//! [`SegmentFile`] until then, so every way out of [`establish`] (an error at any stage, a
//! timeout, a group that moved on, a panic) unlinks them too.
//! Hellos and replies are frames of the crate's codec ([`crate::wire`]).

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use super::hello_readers::HelloReaders;
use super::link::Link;
use super::local_socket::{self, LocalListener};
use super::peer_stream::PeerStream;
use super::shm::{SegmentFile, ShmPair};
use crate::auth::{self, Identity};
use crate::error::{CommError, Result};
use crate::refusals::{RefusalLog, Source};
use crate::wire::{Malformed, ReadBy, Reader, Writer, read_frame, write_frame};

const HELLO_MAGIC: u32 = 0x4844_4450; // "PDDH"
const VERSION: u16 = 6;
/// The roles in the handshake's signatures.
const HELLO_ROLE: &str = "ddp-mesh hello";
const REPLY_ROLE: &str = "ddp-mesh reply";
const ACCEPT_NAP: Duration = Duration::from_millis(2);
/// Largest handshake frame read from a peer not trusted yet.
const MAX_HELLO: usize = 4096;

/// Reply codes of the handshake.
const OK: u8 = 0;
const BAD_SIGNATURE: u8 = 1;
const BAD_RANK: u8 = 2;

/// What every rank publishes about itself in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerInfo {
    /// Where its listener is.
    pub addr: SocketAddr,
    /// Host identity (ranks with equal identities can share memory).
    pub host: String,
    /// Its Unix socket for the ranks on its host ("" for none).
    pub socket: String,
    /// A fresh nonce of this rendezvous: the hellos it accepts are signed over it.
    pub nonce: [u8; auth::LEN],
    /// The public half of its identity: the hellos and replies it sends are signed by it.
    pub identity: [u8; auth::PUBLIC_LEN],
}

impl PeerInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = format!("{}\n{}\n{}\n", self.addr, self.host, self.socket).into_bytes();
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&self.identity);
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<PeerInfo> {
        let mut parts = b.splitn(4, |&c| c == b'\n');
        let addr = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
        let host = String::from_utf8(parts.next()?.to_vec()).ok()?;
        let socket = String::from_utf8(parts.next()?.to_vec()).ok()?;
        let rest = parts.next()?;
        if rest.len() != auth::LEN + auth::PUBLIC_LEN {
            return None;
        }
        let (nonce, identity) = rest.split_at(auth::LEN);
        Some(PeerInfo {
            addr,
            host,
            socket,
            nonce: nonce.try_into().ok()?,
            identity: identity.try_into().ok()?,
        })
    }
}

#[cfg(test)]
thread_local! {
    /// The host identity of a rank thread in the in-process tests (`DDP_HOST_ID` is one per
    /// process, and they emulate several hosts in one).
    pub(crate) static TEST_HOST_ID: std::cell::RefCell<Option<String>> =
        const { std::cell::RefCell::new(None) };
}

/// This machine's identity: `DDP_HOST_ID` if set (tests use it to emulate several hosts),
/// else the host name and the kernel's boot id.
pub fn host_identity() -> String {
    #[cfg(test)]
    if let Some(id) = TEST_HOST_ID.with(|h| h.borrow().clone()) {
        return id;
    }
    if let Ok(id) = std::env::var("DDP_HOST_ID")
        && !id.is_empty()
    {
        return id.replace('\n', " ");
    }
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let host = read("/proc/sys/kernel/hostname");
    let boot = read("/proc/sys/kernel/random/boot_id");
    format!("{host}/{boot}")
}

/// The local address of the interface that reaches `endpoint` (no packet is sent).
pub(crate) fn local_ip_towards(endpoint: &str) -> io::Result<IpAddr> {
    let target = endpoint
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))?;
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let s = UdpSocket::bind(any)?;
    s.connect(target)?;
    Ok(s.local_addr()?.ip())
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// A connection to a lower rank awaiting its reply, with the segment offered to it (its file
/// unlinked when dropped) and the hello sent.
type Outgoing = (usize, PeerStream, Option<(ShmPair, SegmentFile)>, Hello);

/// Settings for [`establish`].
pub(crate) struct MeshConfig<'a> {
    pub rank: usize,
    pub world: usize,
    /// This rank's identity (its public half published as [`PeerInfo::identity`]).
    pub identity: &'a Identity,
    /// The nonce this rank published ([`PeerInfo::nonce`]).
    pub nonce: [u8; auth::LEN],
    pub shared_memory: bool,
    pub deadline: Instant,
    /// When the rendezvous began (for timeout messages).
    pub started: Instant,
}

/// The hello a connecting rank sends: one frame of the crate's codec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: usize,
    pub world: usize,
    /// The connector's nonce.
    pub nonce: Vec<u8>,
    /// The shared-memory segment offered to the acceptor ("" for none).
    pub shm_path: String,
    /// Its signature over both nonces and the fields above, by the identity `rank` published.
    pub signature: Vec<u8>,
}

impl Hello {
    /// What both sides sign besides the nonces.
    fn context(&self) -> Vec<u8> {
        Writer::default()
            .u32(self.rank as u32)
            .u32(self.world as u32)
            .bytes(self.shm_path.as_bytes())
            .finish()
    }

    /// A hello from `rank` (holding `identity`) to the rank that published
    /// `acceptor_nonce`, with its signature.
    pub(crate) fn new(
        identity: &Identity,
        rank: usize,
        world: usize,
        shm_path: String,
        acceptor_nonce: &[u8],
    ) -> Hello {
        let mut h = Hello {
            rank,
            world,
            nonce: auth::nonce().to_vec(),
            shm_path,
            signature: Vec::new(),
        };
        let context = h.context();
        h.signature = identity
            .sign(HELLO_ROLE, &[&h.nonce, acceptor_nonce, &context])
            .to_vec();
        h
    }

    /// Whether the hello is signed by the identity `public` (the one its rank published).
    fn signed_by(&self, public: &[u8], acceptor_nonce: &[u8]) -> bool {
        auth::signed_by(
            public,
            &self.signature,
            HELLO_ROLE,
            &[&self.nonce, acceptor_nonce, &self.context()],
        )
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        Writer::with_capacity(128)
            .u32(HELLO_MAGIC)
            .u16(VERSION)
            .u32(self.rank as u32)
            .u32(self.world as u32)
            .bytes(&self.nonce)
            .bytes(self.shm_path.as_bytes())
            .bytes(&self.signature)
            .finish()
    }

    fn decode(frame: &[u8]) -> io::Result<Hello> {
        let mut r = Reader::new(frame);
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "not a ddp-comm peer (bad magic or version)",
            )
        };
        if r.u32() != Ok(HELLO_MAGIC) || r.u16() != Ok(VERSION) {
            return Err(bad());
        }
        let parsed = (|| {
            let hello = Hello {
                rank: r.u32()? as usize,
                world: r.u32()? as usize,
                nonce: r.bytes()?.to_vec(),
                shm_path: String::from_utf8_lossy(r.bytes()?).into_owned(),
                signature: r.bytes()?.to_vec(),
            };
            r.end()?;
            Ok::<_, Malformed>(hello)
        })();
        parsed.map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "malformed hello"))
    }
}

/// What the acceptor's signature of its answer `code` to `hello` covers besides the nonces.
fn reply_context(hello: &Hello, code: u8, shm: bool) -> Vec<u8> {
    [hello.context(), vec![code, shm as u8]].concat()
}

/// The acceptor's accepting reply to `hello` (and whether it mapped the segment), with its
/// signature.
fn accepting_reply(cfg: &MeshConfig<'_>, hello: &Hello, shm: bool) -> Vec<u8> {
    let context = reply_context(hello, OK, shm);
    let signature = cfg
        .identity
        .sign(REPLY_ROLE, &[&hello.nonce, &cfg.nonce, &context]);
    encode_reply(&Reply {
        code: OK,
        shm,
        signature: signature.to_vec(),
    })
}

/// The acceptor's answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    /// [`OK`] or why not.
    pub code: u8,
    /// Whether it mapped the offered segment.
    pub shm: bool,
    /// Its signature by the identity it published (empty for a refusal).
    pub signature: Vec<u8>,
}

/// A refusal with `code`: nothing but the code.
fn refusal(code: u8) -> Vec<u8> {
    encode_reply(&Reply {
        code,
        shm: false,
        signature: Vec::new(),
    })
}

/// The frame of a reply.
pub(crate) fn encode_reply(reply: &Reply) -> Vec<u8> {
    Writer::default()
        .u8(reply.code)
        .u8(reply.shm as u8)
        .bytes(&reply.signature)
        .finish()
}

/// Parses the acceptor's answer.
pub(crate) fn decode_reply(frame: &[u8]) -> Option<Reply> {
    let mut r = Reader::new(frame);
    let code = r.u8().ok()?;
    let shm = r.u8().ok()?;
    let signature = r.bytes().ok()?.to_vec();
    r.end().ok()?;
    Some(Reply {
        code,
        shm: shm == 1,
        signature,
    })
}

/// Reads one handshake frame (a hello or a reply); a clean close is an error here.
pub(crate) fn read_handshake(s: &mut impl io::Read) -> io::Result<Vec<u8>> {
    read_frame(s, MAX_HELLO)?.ok_or_else(|| io::ErrorKind::UnexpectedEof.into())
}

/// Writes one handshake frame.
pub(crate) fn write_handshake(s: &mut PeerStream, frame: &[u8]) -> io::Result<()> {
    write_frame(s, frame, MAX_HELLO)
}

fn read_hello(mut s: &mut dyn io::Read) -> io::Result<Hello> {
    Hello::decode(&read_handshake(&mut s)?)
}

/// Connects this rank to every other rank. `infos[r]` is rank `r`'s published info; the
/// ranks above it connect to `listener` (from other hosts) or `local` (from this host). `local`
/// is closed and its directory removed on return.
///
/// `superseded` is asked while this rank waits (to connect, for a peer to connect): once it
/// says yes (the group moved on to a later generation), the handshake is given up with an
/// error and the caller forms the later one.
pub(crate) fn establish(
    cfg: &MeshConfig<'_>,
    listener: TcpListener,
    local: Option<LocalListener>,
    infos: &[PeerInfo],
    superseded: &dyn Fn() -> bool,
) -> Result<Vec<Option<Link>>> {
    let (rank, world) = (cfg.rank, cfg.world);
    let my_host = &infos[rank].host;

    // 1. Hellos to every lower rank. The segments offered are unlinked when `outgoing` drops,
    // on any early return below too.
    let mut outgoing: Vec<Outgoing> = Vec::new();
    for (peer, info) in infos.iter().enumerate().take(rank) {
        let same_host = info.host == *my_host;
        let s = connect(cfg, peer, info, same_host, superseded)?;
        outgoing.push(send_hello(cfg, peer, info, s)?);
    }

    // 2. Accept every higher rank. Each connection's hello is read on a thread of its own
    // (within its deadline), so silent or trickling connections hold nobody else up; at
    // capacity an older one is cut for a newer one (see `hello_readers`).
    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    let mut pending: Vec<usize> = (rank + 1..world).collect();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("rendezvous: listener", None, e))?;
    let refusals = RefusalLog::new(format!("rank {rank}'s rendezvous"));
    let mut hellos = HelloReaders::new(HelloReaders::<Hello>::capacity(world), read_hello);
    let result = (|| {
        while !pending.is_empty() {
            while let Some((mut s, from, hello)) = hellos.finished() {
                let Some(hello) = hello else {
                    refusals.note(from, "no complete hello in time");
                    continue;
                };
                if let Some(code) = check_hello(cfg, infos, &pending, &hello) {
                    refusals.note(
                        from,
                        if code == BAD_RANK {
                            "an unexpected rank"
                        } else {
                            "no valid signature"
                        },
                    );
                    let _ = write_handshake(&mut s, &refusal(code));
                    continue;
                }
                let peer = hello.rank;
                let shm = if hello.shm_path.is_empty() || !cfg.shared_memory {
                    None
                } else if !s.is_local() {
                    // Only a peer on this host, on the Unix socket only this user can open,
                    // may put a file in the data path (rank `peer` offers none over TCP).
                    tracing::warn!(
                        "rank {rank}: ignoring the shared-memory segment {:?} offered by rank {peer} over TCP (only a hello on this host's Unix socket may offer one); using the stream",
                        hello.shm_path
                    );
                    None
                } else {
                    match ShmPair::open(&hello.shm_path) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            tracing::warn!(
                                "rank {rank}: not mapping rank {peer}'s segment: {e}; using the Unix socket"
                            );
                            None
                        }
                    }
                };
                write_handshake(&mut s, &accepting_reply(cfg, &hello, shm.is_some()))
                    .map_err(|e| CommError::io("rendezvous: answering a peer", Some(peer), e))?;
                links[peer] = Some(
                    Link::new(s, shm)
                        .map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
                );
                pending.retain(|&p| p != peer);
            }
            if pending.is_empty() {
                break;
            }
            let accepted = match local.as_ref().map(LocalListener::accept) {
                Some(Ok(s)) => Ok((PeerStream::Local(s), Source::LocalSocket)),
                Some(Err(e)) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
                _ => listener
                    .accept()
                    .map(|(s, from)| (PeerStream::Tcp(s), from.ip().into())),
            };
            match accepted {
                Ok((s, from)) => {
                    if let Err(reason) = hellos.start(s, from, cfg.deadline) {
                        refusals.note(from, reason);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if superseded() {
                        return Err(given_up(cfg, &pending));
                    }
                    if Instant::now() >= cfg.deadline {
                        return Err(CommError::Timeout {
                            op: format!(
                                "rendezvous: rank(s) {} did not connect to rank {rank}",
                                list(&pending)
                            ),
                            peer: pending.first().copied(),
                            after: cfg.started.elapsed(),
                        });
                    }
                    std::thread::sleep(ACCEPT_NAP);
                }
                Err(e) => return Err(CommError::io("rendezvous: accepting a peer", None, e)),
            }
        }
        Ok(())
    })();
    hellos.cut_all();
    refusals.flush(true);
    // Every rank that connects here has: the socket and its directory go.
    drop(local);
    result?;

    // 3. Replies from the lower ranks. Each segment is unlinked once its reply came (the peer
    // mapped it, or never will); those of the replies still to read, when one fails, as the
    // rest of `outgoing` drops.
    for (peer, s, shm, hello) in outgoing {
        let got = read_handshake(&mut ReadBy::new(&s, cfg.deadline));
        let shm = shm.map(|(pair, _file)| pair);
        let op = || format!("rendezvous: handshake with rank {peer}");
        let reply = match got {
            Ok(frame) => decode_reply(&frame).ok_or_else(|| {
                CommError::io(
                    op(),
                    Some(peer),
                    io::Error::new(io::ErrorKind::InvalidData, "malformed handshake reply"),
                )
            })?,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(CommError::Timeout {
                    op: op(),
                    peer: Some(peer),
                    after: cfg.started.elapsed(),
                });
            }
            Err(e) => return Err(CommError::io(op(), Some(peer), e)),
        };
        let denied = |why: String| {
            CommError::io(
                op(),
                Some(peer),
                io::Error::new(io::ErrorKind::PermissionDenied, why),
            )
        };
        match reply.code {
            OK if reply_signed(&hello, &infos[peer], &reply) => {}
            OK => {
                return Err(denied(format!(
                    "whoever answered at rank {peer}'s address could not prove it is rank {peer} of this job (a port squatter?)"
                )));
            }
            BAD_SIGNATURE => {
                return Err(denied(format!(
                    "rank {peer} refused our signature: it does not hold the identity we published (two processes started as rank {rank}?)"
                )));
            }
            code => {
                return Err(denied(format!(
                    "rank {peer} refused the connection (code {code})"
                )));
            }
        }
        let shm = if reply.shm { shm } else { None };
        links[peer] = Some(
            Link::new(s, shm)
                .map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
        );
    }
    Ok(links)
}

/// Sends this rank's hello to `peer` over `s`. A peer reached through its Unix socket (on this
/// host) is offered a new shared-memory segment when shared memory is on; a peer reached over
/// TCP never is. On an error the segment is unlinked (its [`SegmentFile`] drops here); else it
/// is returned with the stream, for the reply.
fn send_hello(
    cfg: &MeshConfig<'_>,
    peer: usize,
    info: &PeerInfo,
    mut s: PeerStream,
) -> Result<Outgoing> {
    let rank = cfg.rank;
    let shm = if cfg.shared_memory && s.is_local() {
        match ShmPair::create(rank, peer) {
            Ok(x) => Some(x),
            Err(e) => {
                tracing::warn!(
                    "rank {rank}: no shared memory with rank {peer} ({e}); using the Unix socket"
                );
                None
            }
        }
    } else {
        None
    };
    let hello = Hello::new(
        cfg.identity,
        rank,
        cfg.world,
        shm.as_ref()
            .map(|(_, f)| f.path().to_string_lossy().into_owned())
            .unwrap_or_default(),
        &info.nonce,
    );
    s.set_write_timeout(Some(left(cfg.deadline)))
        .and_then(|()| write_handshake(&mut s, &hello.encode()))
        .map_err(|e| {
            let op = format!("rendezvous: connecting to rank {peer} at {}", info.addr);
            CommError::io(op, Some(peer), e)
        })?;
    Ok((peer, s, shm, hello))
}

/// The error of a handshake given up for a later generation, while `pending` had not
/// connected.
fn given_up(cfg: &MeshConfig<'_>, pending: &[usize]) -> CommError {
    CommError::Io {
        op: format!(
            "rendezvous: the group moved on to a later generation while rank(s) {} had not connected to rank {}",
            list(pending),
            cfg.rank
        ),
        peer: pending.first().copied(),
        source: io::ErrorKind::Interrupted.into(),
    }
}

/// Why `hello` is refused (a reply code), if it is: a rank not awaited, or not signed by the
/// identity its rank published.
fn check_hello(
    cfg: &MeshConfig<'_>,
    infos: &[PeerInfo],
    pending: &[usize],
    hello: &Hello,
) -> Option<u8> {
    if hello.world != cfg.world || !pending.contains(&hello.rank) {
        return Some(BAD_RANK);
    }
    if !hello.signed_by(&infos[hello.rank].identity, &cfg.nonce) {
        return Some(BAD_SIGNATURE);
    }
    None
}

/// Whether an accepting `reply` to `hello` is signed by the identity `acceptor` published.
fn reply_signed(hello: &Hello, acceptor: &PeerInfo, reply: &Reply) -> bool {
    let context = reply_context(hello, OK, reply.shm);
    auth::signed_by(
        &acceptor.identity,
        &reply.signature,
        REPLY_ROLE,
        &[&hello.nonce, &acceptor.nonce, &context],
    )
}

/// A stream to `peer`: through its Unix socket when it is on this host (TCP when it has none, or
/// when its socket is not on this machine: equal host identities on two machines), else TCP.
fn connect(
    cfg: &MeshConfig<'_>,
    peer: usize,
    info: &PeerInfo,
    same_host: bool,
    superseded: &dyn Fn() -> bool,
) -> Result<PeerStream> {
    let timed_out = |op: String| CommError::Timeout {
        op,
        peer: Some(peer),
        after: cfg.started.elapsed(),
    };
    if same_host && !info.socket.is_empty() {
        let op = || format!("rendezvous: connecting to rank {peer} at {}", info.socket);
        match local_socket::connect(Path::new(&info.socket), cfg.deadline, superseded) {
            Ok(s) => return Ok(PeerStream::Local(s)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => tracing::warn!(
                "rank {}: rank {peer}'s socket {} is not on this machine (equal DDP_HOST_ID on two hosts?); using TCP",
                cfg.rank,
                info.socket
            ),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(timed_out(op())),
            Err(e) => return Err(CommError::io(op(), Some(peer), e)),
        }
    }
    let op = || format!("rendezvous: connecting to rank {peer} at {}", info.addr);
    connect_retry(info.addr, cfg.deadline, superseded)
        .map(PeerStream::Tcp)
        .map_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                timed_out(op())
            } else {
                CommError::io(op(), Some(peer), e)
            }
        })
}

fn connect_retry(
    addr: SocketAddr,
    deadline: Instant,
    superseded: &dyn Fn() -> bool,
) -> io::Result<TcpStream> {
    let mut refused_since: Option<Instant> = None;
    loop {
        match TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, e));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                let since = *refused_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= local_socket::REFUSED_GRACE {
                    return Err(e);
                }
            }
            Err(_) => refused_since = None,
        }
        if superseded() {
            return Err(io::ErrorKind::Interrupted.into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// "1, 2, 3" for messages.
pub(crate) fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shared-memory side of the handshake: no segment outlives [`establish`] whatever stage
/// it fails at, and a segment is taken only from a hello on this host's Unix socket.
#[cfg(test)]
mod shm_tests {
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::path::PathBuf;

    use super::*;
    use crate::group::local_socket::LocalListener;
    use crate::group::shm::created_on_this_thread;

    /// Long enough for anything a loaded machine does in these tests; reached only on failure.
    const GENEROUS: Duration = Duration::from_secs(30);
    /// A deadline the tests that time out wait for.
    const SHORT: Duration = Duration::from_millis(300);

    /// A lower rank on this host: it listens on its Unix socket (connections wait in the
    /// backlog) and answers only what the test makes it answer.
    struct Lower {
        listener: UnixListener,
        socket: PathBuf,
        _dir: tempfile::TempDir,
        identity: Identity,
        nonce: [u8; auth::LEN],
    }

    impl Lower {
        fn new() -> Lower {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("peers.sock");
            let listener = UnixListener::bind(&socket).unwrap();
            listener.set_nonblocking(true).unwrap();
            Lower {
                listener,
                socket,
                _dir: dir,
                identity: Identity::generate(),
                nonce: auth::nonce(),
            }
        }

        fn info(&self) -> PeerInfo {
            info(&self.socket, &self.identity, self.nonce)
        }

        /// The next connection and the hello on it.
        fn hello(&self) -> (UnixStream, Hello) {
            let until = Instant::now() + GENEROUS;
            let s = loop {
                match self.listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(Instant::now() < until, "nobody connected");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => panic!("{e}"),
                }
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(GENEROUS)).unwrap();
            let hello = Hello::decode(&read_handshake(&mut &s).unwrap()).unwrap();
            (s, hello)
        }
    }

    /// Rank info on this host ("host") with the Unix socket `socket` (none for "").
    fn info(socket: &Path, identity: &Identity, nonce: [u8; auth::LEN]) -> PeerInfo {
        PeerInfo {
            // Never dialled: the peers of these tests are reached by their sockets.
            addr: "127.0.0.1:9".parse().unwrap(),
            host: "host".into(),
            socket: socket.to_string_lossy().into_owned(),
            nonce,
            identity: identity.public(),
        }
    }

    /// A lower rank whose socket nobody listens on any more (it died or moved on): connecting
    /// is refused.
    fn gone() -> (PeerInfo, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("peers.sock");
        drop(UnixListener::bind(&socket).unwrap());
        (info(&socket, &Identity::generate(), auth::nonce()), dir)
    }

    /// The rank under test.
    struct Me {
        identity: Identity,
        listener: TcpListener,
        nonce: [u8; auth::LEN],
    }

    impl Me {
        fn new() -> Me {
            Me {
                identity: Identity::generate(),
                listener: TcpListener::bind("127.0.0.1:0").unwrap(),
                nonce: auth::nonce(),
            }
        }

        fn info(&self) -> PeerInfo {
            let mut i = info(Path::new(""), &self.identity, self.nonce);
            i.addr = self.listener.local_addr().unwrap();
            i
        }

        /// Runs [`establish`] as `rank` on this thread until `within`; returns its outcome
        /// (the links made) and the segments it created.
        fn establish(
            self,
            rank: usize,
            infos: &[PeerInfo],
            within: Duration,
            superseded: &dyn Fn() -> bool,
        ) -> (Result<usize>, Vec<PathBuf>) {
            created_on_this_thread();
            let started = Instant::now();
            let cfg = MeshConfig {
                rank,
                world: infos.len(),
                identity: &self.identity,
                nonce: self.nonce,
                shared_memory: true,
                deadline: started + within,
                started,
            };
            let got = establish(&cfg, self.listener, None, infos, superseded)
                .map(|links| links.iter().flatten().count());
            (got, created_on_this_thread())
        }
    }

    /// Each segment offered in `hellos` was created by the rank under test (`created`), and
    /// none of those it created is left in `/dev/shm`. (Only these paths are checked: other
    /// tests of this process create `ddp-pg-{pid}-…` segments at the same time.)
    fn assert_none_left(created: &[PathBuf], hellos: &[&Hello]) {
        assert!(
            !created.is_empty(),
            "no segment was created: the stage under test was not reached"
        );
        for h in hellos {
            assert!(
                created.contains(&PathBuf::from(&h.shm_path)),
                "the hello offered {:?}, not one of {created:?}",
                h.shm_path
            );
        }
        let prefix = format!("/dev/shm/ddp-pg-{}-", std::process::id());
        for p in created {
            assert!(p.to_string_lossy().starts_with(&prefix), "{}", p.display());
            match std::fs::symlink_metadata(p) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                other => panic!("{} left behind ({other:?})", p.display()),
            }
        }
    }

    /// Stage: a segment created, its hello not sent (the peer's end is closed).
    #[test]
    fn a_hello_that_cannot_be_sent_leaves_no_segment() {
        let lower = Lower::new();
        let me = Me::new();
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        created_on_this_thread();
        let now = Instant::now();
        let cfg = MeshConfig {
            rank: 1,
            world: 2,
            identity: &me.identity,
            nonce: me.nonce,
            shared_memory: true,
            deadline: now + GENEROUS,
            started: now,
        };
        let e = send_hello(&cfg, 0, &lower.info(), PeerStream::Local(ours))
            .err()
            .expect("the hello cannot be sent");
        assert!(e.to_string().contains("rank 0"), "{e}");
        assert_none_left(&created_on_this_thread(), &[]);
    }

    /// Stage: the hello (with its segment) sent to rank 0, its reply not read, when the
    /// connection to rank 1 fails: rank 1 is gone (its socket refuses), or the group moved on
    /// while rank 2 waited for it.
    #[test]
    fn a_failed_connect_after_an_offer_leaves_no_segment() {
        for moved_on in [false, true] {
            let zero = Lower::new();
            let (one, _dir) = gone();
            let me = Me::new();
            let infos = [zero.info(), one, me.info()];
            let (got, created) = me.establish(2, &infos, GENEROUS, &|| moved_on);
            let e = got.expect_err("rank 1 is gone");
            assert!(e.to_string().contains("rank 1"), "moved_on={moved_on}: {e}");
            let (_s, hello) = zero.hello();
            assert!(!hello.shm_path.is_empty(), "rank 0 was offered a segment");
            assert_none_left(&created, &[&hello]);
        }
    }

    /// Stage: during the accept, after the hello to rank 0: rank 2 never connects, and the
    /// group moves on (the `superseded` give-up) or the deadline passes.
    #[test]
    fn giving_up_while_accepting_leaves_no_segment() {
        for moved_on in [true, false] {
            let zero = Lower::new();
            let me = Me::new();
            let two = Me::new();
            let infos = [zero.info(), me.info(), two.info()];
            let (got, created) = me.establish(1, &infos, SHORT, &|| moved_on);
            match got.expect_err("rank 2 never connects") {
                CommError::Io { source, .. } if moved_on => {
                    assert_eq!(source.kind(), io::ErrorKind::Interrupted)
                }
                CommError::Timeout { op, .. } if !moved_on => {
                    assert!(op.contains("rank(s) 2"), "{op}")
                }
                e => panic!("moved_on={moved_on}: {e}"),
            }
            let (_s, hello) = zero.hello();
            assert_none_left(&created, &[&hello]);
        }
    }

    /// How rank 0 answers (or not) in [`a_failed_reply_leaves_no_segment`].
    #[derive(Debug, Clone, Copy)]
    enum Answer {
        Closes,
        Refuses,
        Unsigned,
        Silent,
    }

    /// Stage: reading the replies. Rank 0's reply fails (rank 0 closes, refuses, answers
    /// without its signature, or says nothing until the deadline), so rank 1's reply is never
    /// read: neither segment is left.
    #[test]
    fn a_failed_reply_leaves_no_segment() {
        for answer in [
            Answer::Closes,
            Answer::Refuses,
            Answer::Unsigned,
            Answer::Silent,
        ] {
            let (zero, one) = (Lower::new(), Lower::new());
            let me = Me::new();
            let infos = [zero.info(), one.info(), me.info()];
            let within = match answer {
                Answer::Silent => SHORT,
                _ => GENEROUS,
            };
            let (got, created, hello0) = std::thread::scope(|scope| {
                let zero = &zero;
                let rank0 = scope.spawn(move || {
                    if let Answer::Silent = answer {
                        return None;
                    }
                    let (s, hello) = zero.hello();
                    let mut s = PeerStream::Local(s);
                    let frame = match answer {
                        Answer::Refuses => refusal(BAD_RANK),
                        _ => encode_reply(&Reply {
                            code: OK,
                            shm: true,
                            signature: vec![0; 64],
                        }),
                    };
                    if !matches!(answer, Answer::Closes) {
                        write_handshake(&mut s, &frame).unwrap();
                    }
                    Some(hello)
                });
                let (got, created) = me.establish(2, &infos, within, &|| false);
                (got, created, rank0.join().unwrap())
            });
            let e = got.expect_err("rank 0's reply fails");
            assert!(e.to_string().contains("rank 0"), "{answer:?}: {e}");
            let hello0 = hello0.unwrap_or_else(|| zero.hello().1);
            let (_s, hello1) = one.hello();
            assert_eq!(created.len(), 2, "{answer:?}: a segment for each");
            assert_none_left(&created, &[&hello0, &hello1]);
        }
    }

    /// A hello on the TCP port (from a rank of another host, or any local user) never makes a
    /// rank map a file: the same signed offer of a valid segment of this user is declined over
    /// TCP (the link uses the stream) and taken over the Unix socket.
    #[test]
    fn a_segment_offered_over_tcp_is_never_mapped() {
        for over_tcp in [true, false] {
            let zero = Identity::generate();
            let one = Identity::generate();
            let local = LocalListener::bind().unwrap();
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut infos = vec![
                info(local.path(), &zero, auth::nonce()),
                info(Path::new(""), &one, auth::nonce()),
            ];
            infos[0].addr = listener.local_addr().unwrap();
            let (segment, file) = ShmPair::create(1, 0).unwrap();
            let hello = Hello::new(
                &one,
                1,
                2,
                file.path().to_string_lossy().into_owned(),
                &infos[0].nonce,
            );
            let (reply, mapped) = std::thread::scope(|scope| {
                let infos = &infos;
                let zero = &zero;
                let rank0 = scope.spawn(move || {
                    let started = Instant::now();
                    let cfg = MeshConfig {
                        rank: 0,
                        world: 2,
                        identity: zero,
                        nonce: infos[0].nonce,
                        shared_memory: true,
                        deadline: started + GENEROUS,
                        started,
                    };
                    let links = establish(&cfg, listener, Some(local), infos, &|| false).unwrap();
                    links[1].as_ref().expect("rank 1's link").is_shm()
                });
                let mut s = if over_tcp {
                    PeerStream::Tcp(TcpStream::connect(infos[0].addr).unwrap())
                } else {
                    PeerStream::Local(UnixStream::connect(&infos[0].socket).unwrap())
                };
                write_handshake(&mut s, &hello.encode()).unwrap();
                let reply = decode_reply(&read_handshake(&mut &s).unwrap()).unwrap();
                (reply, rank0.join().unwrap())
            });
            assert_eq!(reply.code, OK, "over_tcp={over_tcp}: rank 1 is accepted");
            assert!(reply_signed(&hello, &infos[0], &reply));
            assert_eq!(reply.shm, !over_tcp, "over_tcp={over_tcp}: the reply");
            assert_eq!(mapped, !over_tcp, "over_tcp={over_tcp}: rank 0's link");
            drop((segment, file));
        }
    }
}
