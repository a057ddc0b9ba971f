//! Building the full mesh of peer links once every rank's address is known.
//!
//! Rank `i` connects to every rank below it and accepts every rank above it, so there is no
//! cycle of waits: connectors first send their hello to all lower ranks, then accept the higher
//! ranks, then read the replies. Every rank publishes a fresh nonce with its address; a hello
//! carries the connector's rank, its own nonce and its proof of the job's key over both nonces
//! and the rank ([`crate::auth`]: the token never crosses the wire, and a hello recorded in
//! an earlier rendezvous proves nothing in this one), and the acceptor's reply carries its
//! proof in turn (whoever squats a rank's port cannot answer). A hello without a valid proof,
//! an out-of-range or duplicate rank is refused (and logged) and the listener keeps accepting.
//! For a peer on the same host the connector creates a shared-memory segment and names it in
//! the hello; the acceptor maps it and says so in its reply; the connector then unlinks it.
//! Hellos and replies are frames of the crate's codec ([`crate::wire`]).

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::link::Link;
use super::shm::ShmPair;
use crate::auth::{self, Key};
use crate::error::{CommError, Result};
use crate::wire::{Malformed, ReadBy, Reader, Writer, read_frame, write_frame};

const HELLO_MAGIC: u32 = 0x4844_4450; // "PDDH"
const VERSION: u16 = 3;
/// The roles in the handshake's proofs.
const HELLO_ROLE: &str = "ddp-mesh hello";
const REPLY_ROLE: &str = "ddp-mesh reply";
const ACCEPT_NAP: Duration = Duration::from_millis(2);
/// Largest handshake frame read from a peer not trusted yet.
const MAX_HELLO: usize = 4096;

/// Reply codes of the handshake.
const OK: u8 = 0;
const BAD_TOKEN: u8 = 1;
const BAD_RANK: u8 = 2;

/// What every rank publishes about itself in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerInfo {
    /// Where its listener is.
    pub addr: SocketAddr,
    /// Host identity (ranks with equal identities can share memory).
    pub host: String,
    /// A fresh nonce of this rendezvous: the hellos it accepts prove the key over it.
    pub nonce: [u8; auth::LEN],
}

impl PeerInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = format!("{}\n{}\n", self.addr, self.host).into_bytes();
        b.extend_from_slice(&self.nonce);
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<PeerInfo> {
        let mut parts = b.splitn(3, |&c| c == b'\n');
        let addr = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
        let host = String::from_utf8(parts.next()?.to_vec()).ok()?;
        let nonce = parts.next()?.try_into().ok()?;
        Some(PeerInfo { addr, host, nonce })
    }
}

/// This machine's identity: `DDP_HOST_ID` if set (tests use it to emulate several hosts),
/// else the host name and the kernel's boot id.
pub(crate) fn host_identity() -> String {
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

/// A connection to a lower rank awaiting its reply, with the segment offered to it and the
/// hello sent.
type Outgoing = (usize, TcpStream, Option<(ShmPair, PathBuf)>, Hello);

/// Settings for [`establish`].
pub(crate) struct MeshConfig<'a> {
    /// The job's key (from the job token; from "" without one).
    pub rank: usize,
    pub world: usize,
    pub key: &'a Key,
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
    /// Its proof of the key over both nonces and the fields above ([`Hello::proof`]).
    pub mac: Vec<u8>,
    /// The shared-memory segment offered to the acceptor ("" for none).
    pub shm_path: String,
}

impl Hello {
    /// What both sides prove the key over besides the nonces.
    fn context(&self) -> Vec<u8> {
        Writer::default()
            .u32(self.rank as u32)
            .u32(self.world as u32)
            .bytes(self.shm_path.as_bytes())
            .finish()
    }

    /// A hello from `rank` to the rank that published `acceptor_nonce`, with its proof.
    pub(crate) fn new(
        key: &Key,
        rank: usize,
        world: usize,
        shm_path: String,
        acceptor_nonce: &[u8],
    ) -> Hello {
        let mut h = Hello {
            rank,
            world,
            nonce: auth::nonce().to_vec(),
            mac: Vec::new(),
            shm_path,
        };
        h.mac = key
            .prove(HELLO_ROLE, &h.nonce, acceptor_nonce, &h.context())
            .to_vec();
        h
    }

    /// Whether the hello proves `key` to the rank whose nonce is `acceptor_nonce`.
    fn proves(&self, key: &Key, acceptor_nonce: &[u8]) -> bool {
        key.verify(
            &self.mac,
            HELLO_ROLE,
            &self.nonce,
            acceptor_nonce,
            &self.context(),
        )
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        Writer::with_capacity(128)
            .u32(HELLO_MAGIC)
            .u16(VERSION)
            .u32(self.rank as u32)
            .u32(self.world as u32)
            .bytes(&self.nonce)
            .bytes(&self.mac)
            .bytes(self.shm_path.as_bytes())
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
                mac: r.bytes()?.to_vec(),
                shm_path: String::from_utf8_lossy(r.bytes()?).into_owned(),
            };
            r.end()?;
            Ok::<_, Malformed>(hello)
        })();
        parsed.map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "malformed hello"))
    }
}

/// What the acceptor's proof of its answer `code` to `hello` covers besides the nonces.
fn reply_context(hello: &Hello, code: u8, shm: bool) -> Vec<u8> {
    [hello.context(), vec![code, shm as u8]].concat()
}

/// The acceptor's proof for its answer `code` (and whether it mapped the segment) to `hello`.
fn reply_proof(key: &Key, hello: &Hello, acceptor_nonce: &[u8], code: u8, shm: bool) -> Vec<u8> {
    key.prove(
        REPLY_ROLE,
        &hello.nonce,
        acceptor_nonce,
        &reply_context(hello, code, shm),
    )
    .to_vec()
}

/// The acceptor's answer to a [`Hello`]: a code, whether it mapped the offered segment, and
/// its proof of the key (empty for a refusal: a refused peer learns nothing).
pub(crate) fn encode_reply(code: u8, shm: bool, mac: &[u8]) -> Vec<u8> {
    Writer::default().u8(code).u8(shm as u8).bytes(mac).finish()
}

/// Parses the acceptor's answer: `(code, mapped the segment, proof)`.
pub(crate) fn decode_reply(frame: &[u8]) -> Option<(u8, bool, Vec<u8>)> {
    let mut r = Reader::new(frame);
    let code = r.u8().ok()?;
    let shm = r.u8().ok()?;
    let mac = r.bytes().ok()?.to_vec();
    r.end().ok()?;
    Some((code, shm == 1, mac))
}

/// How long an accepted connection has to send its whole hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads one handshake frame (a hello or a reply); a clean close is an error here.
pub(crate) fn read_handshake(s: &mut impl io::Read) -> io::Result<Vec<u8>> {
    read_frame(s, MAX_HELLO)?.ok_or_else(|| io::ErrorKind::UnexpectedEof.into())
}

/// Writes one handshake frame.
pub(crate) fn write_handshake(s: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    write_frame(s, frame, MAX_HELLO)
}

fn read_hello(s: &mut impl io::Read) -> io::Result<Hello> {
    Hello::decode(&read_handshake(s)?)
}

/// Connects this rank to every other rank. `infos[r]` is rank `r`'s published info.
pub(crate) fn establish(
    cfg: &MeshConfig<'_>,
    listener: TcpListener,
    infos: &[PeerInfo],
) -> Result<Vec<Option<Link>>> {
    let (rank, world) = (cfg.rank, cfg.world);
    let my_host = &infos[rank].host;
    let key = cfg.key;

    // 1. Hellos to every lower rank.
    let mut outgoing: Vec<Outgoing> = Vec::new();
    for (peer, info) in infos.iter().enumerate().take(rank) {
        let op = || format!("rendezvous: connecting to rank {peer} at {}", info.addr);
        let mut s = connect_retry(info.addr, cfg.deadline).map_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                CommError::Timeout {
                    op: op(),
                    peer: Some(peer),
                    after: cfg.started.elapsed(),
                }
            } else {
                CommError::io(op(), Some(peer), e)
            }
        })?;
        let shm = if cfg.shared_memory && info.host == *my_host {
            match ShmPair::create(rank, peer) {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::warn!(
                        "rank {rank}: no shared memory with rank {peer} ({e}); using TCP"
                    );
                    None
                }
            }
        } else {
            None
        };
        let hello = Hello::new(
            key,
            rank,
            world,
            shm.as_ref()
                .map(|(_, p)| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            &info.nonce,
        );
        let sent = s
            .set_write_timeout(Some(left(cfg.deadline)))
            .and_then(|()| write_handshake(&mut s, &hello.encode()));
        if let Err(e) = sent {
            if let Some((_, p)) = &shm {
                ShmPair::unlink(p);
            }
            return Err(CommError::io(op(), Some(peer), e));
        }
        outgoing.push((peer, s, shm, hello));
    }

    // 2. Accept every higher rank.
    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    let mut pending: Vec<usize> = (rank + 1..world).collect();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("rendezvous: listener", None, e))?;
    while !pending.is_empty() {
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
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
                continue;
            }
            Err(e) => return Err(CommError::io("rendezvous: accepting a peer", None, e)),
        };
        // One deadline for the whole hello (at most 10 s, never past the rendezvous's): a peer
        // trickling bytes cannot hold the accept loop.
        let hello_by = cfg.deadline.min(Instant::now() + HELLO_TIMEOUT);
        let hello = s
            .set_nonblocking(false)
            .and_then(|()| s.set_write_timeout(Some(Duration::from_secs(5))))
            .and_then(|()| read_hello(&mut ReadBy::new(&s, hello_by)));
        let hello = match hello {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("rank {rank}: dropped a connection from {from}: {e}");
                continue;
            }
        };
        if !hello.proves(key, &cfg.nonce) {
            tracing::warn!(
                "rank {rank}: refused a connection from {from} claiming rank {}: no valid proof of the job token",
                hello.rank
            );
            let _ = write_handshake(&mut s, &encode_reply(BAD_TOKEN, false, &[]));
            continue;
        }
        if hello.world != world || !pending.contains(&hello.rank) {
            tracing::warn!(
                "rank {rank}: refused a connection from {from}: rank {} of world {} is not expected",
                hello.rank,
                hello.world
            );
            let _ = write_handshake(&mut s, &encode_reply(BAD_RANK, false, &[]));
            continue;
        }
        let peer = hello.rank;
        let shm = if hello.shm_path.is_empty() || !cfg.shared_memory {
            None
        } else {
            match ShmPair::open(&hello.shm_path) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(
                        "rank {rank}: cannot map rank {peer}'s segment {} ({e}); using TCP",
                        hello.shm_path
                    );
                    None
                }
            }
        };
        let mac = reply_proof(key, &hello, &cfg.nonce, OK, shm.is_some());
        write_handshake(&mut s, &encode_reply(OK, shm.is_some(), &mac))
            .map_err(|e| CommError::io("rendezvous: answering a peer", Some(peer), e))?;
        links[peer] = Some(
            Link::new(s, shm)
                .map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
        );
        pending.retain(|&p| p != peer);
    }

    // 3. Replies from the lower ranks.
    for (peer, s, shm, hello) in outgoing {
        let got = read_handshake(&mut ReadBy::new(&s, cfg.deadline));
        if let Some((_, p)) = &shm {
            ShmPair::unlink(p);
        }
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
        match reply.0 {
            OK if key.verify(
                &reply.2,
                REPLY_ROLE,
                &hello.nonce,
                &infos[peer].nonce,
                &reply_context(&hello, OK, reply.1),
            ) => {}
            OK => {
                return Err(denied(format!(
                    "whoever answered at rank {peer}'s address could not prove it holds the job token (a port squatter?)"
                )));
            }
            BAD_TOKEN => {
                return Err(denied(format!(
                    "rank {peer} refused our proof of the job token (is DDP_JOB_TOKEN the same on every rank?)"
                )));
            }
            code => {
                return Err(denied(format!(
                    "rank {peer} refused the connection (code {code})"
                )));
            }
        }
        let shm = if reply.1 { shm.map(|(p, _)| p) } else { None };
        links[peer] = Some(
            Link::new(s, shm)
                .map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
        );
    }
    Ok(links)
}

fn connect_retry(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, e));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
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
