//! Building the full mesh of peer links once every rank's address is known.
//!
//! Rank `i` connects to every rank below it and accepts every rank above it, so there is no
//! cycle of waits: connectors first send their hello to all lower ranks, then accept the higher
//! ranks, then read the replies. A hello presents the job token and the rank; a wrong token,
//! an out-of-range or duplicate rank is refused (and logged) and the listener keeps accepting.
//! For a peer on the same host the connector creates a shared-memory segment and names it in
//! the hello; the acceptor maps it and says so in its reply; the connector then unlinks it.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::link::Link;
use super::shm::ShmPair;
use crate::error::{CommError, Result};

const HELLO_MAGIC: u32 = 0x4844_4450; // "PDDH"
const VERSION: u16 = 1;
const ACCEPT_NAP: Duration = Duration::from_millis(2);

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
}

impl PeerInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!("{}\n{}", self.addr, self.host).into_bytes()
    }

    pub(crate) fn decode(b: &[u8]) -> Option<PeerInfo> {
        let s = std::str::from_utf8(b).ok()?;
        let (addr, host) = s.split_once('\n')?;
        Some(PeerInfo {
            addr: addr.parse().ok()?,
            host: host.to_string(),
        })
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

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s);
}

fn read_exact_u16_str(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 2];
    r.read_exact(&mut l)?;
    let mut v = vec![0u8; u16::from_le_bytes(l) as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Constant-time comparison of tokens.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Settings for [`establish`].
pub(crate) struct MeshConfig<'a> {
    pub rank: usize,
    pub world: usize,
    pub token: Option<&'a str>,
    pub shared_memory: bool,
    pub deadline: Instant,
    /// When the rendezvous began (for timeout messages).
    pub started: Instant,
}

/// A hello read from a connecting peer.
struct Hello {
    rank: usize,
    world: usize,
    token: Vec<u8>,
    shm_path: String,
}

fn read_hello(s: &mut TcpStream) -> io::Result<Hello> {
    let mut fixed = [0u8; 14];
    s.read_exact(&mut fixed)?;
    let magic = u32::from_le_bytes(fixed[0..4].try_into().expect("4"));
    let version = u16::from_le_bytes(fixed[4..6].try_into().expect("2"));
    if magic != HELLO_MAGIC || version != VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a ddp-comm peer (bad magic or version)",
        ));
    }
    let rank = u32::from_le_bytes(fixed[6..10].try_into().expect("4")) as usize;
    let world = u32::from_le_bytes(fixed[10..14].try_into().expect("4")) as usize;
    let token = read_exact_u16_str(s)?;
    let shm_path = String::from_utf8_lossy(&read_exact_u16_str(s)?).into_owned();
    Ok(Hello {
        rank,
        world,
        token,
        shm_path,
    })
}

/// Connects this rank to every other rank. `infos[r]` is rank `r`'s published info.
pub(crate) fn establish(
    cfg: &MeshConfig<'_>,
    listener: TcpListener,
    infos: &[PeerInfo],
) -> Result<Vec<Option<Link>>> {
    let (rank, world) = (cfg.rank, cfg.world);
    let my_host = &infos[rank].host;
    let token = cfg.token.unwrap_or("").as_bytes();

    // 1. Hellos to every lower rank.
    let mut outgoing: Vec<(usize, TcpStream, Option<(ShmPair, PathBuf)>)> = Vec::new();
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
                    tracing::warn!("rank {rank}: no shared memory with rank {peer} ({e}); using TCP");
                    None
                }
            }
        } else {
            None
        };
        let mut hello = Vec::with_capacity(64);
        hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world as u32).to_le_bytes());
        put_str(&mut hello, token);
        let path = shm
            .as_ref()
            .map(|(_, p)| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        put_str(&mut hello, path.as_bytes());
        let sent = s
            .set_write_timeout(Some(left(cfg.deadline)))
            .and_then(|()| s.write_all(&hello));
        if let Err(e) = sent {
            if let Some((_, p)) = &shm {
                ShmPair::unlink(p);
            }
            return Err(CommError::io(op(), Some(peer), e));
        }
        outgoing.push((peer, s, shm));
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
        let hello = s
            .set_nonblocking(false)
            .and_then(|()| s.set_read_timeout(Some(left(cfg.deadline).min(Duration::from_secs(10)))))
            .and_then(|()| s.set_write_timeout(Some(Duration::from_secs(5))))
            .and_then(|()| read_hello(&mut s));
        let hello = match hello {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("rank {rank}: dropped a connection from {from}: {e}");
                continue;
            }
        };
        if !same_token(&hello.token, token) {
            tracing::warn!(
                "rank {rank}: refused a connection from {from} claiming rank {}: wrong job token",
                hello.rank
            );
            let _ = s.write_all(&[BAD_TOKEN, 0]);
            continue;
        }
        if hello.world != world || !pending.contains(&hello.rank) {
            tracing::warn!(
                "rank {rank}: refused a connection from {from}: rank {} of world {} is not expected",
                hello.rank,
                hello.world
            );
            let _ = s.write_all(&[BAD_RANK, 0]);
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
        s.write_all(&[OK, shm.is_some() as u8])
            .map_err(|e| CommError::io("rendezvous: answering a peer", Some(peer), e))?;
        links[peer] = Some(
            Link::new(s, shm).map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
        );
        pending.retain(|&p| p != peer);
    }

    // 3. Replies from the lower ranks.
    for (peer, mut s, shm) in outgoing {
        let mut reply = [0u8; 2];
        let got = s
            .set_read_timeout(Some(left(cfg.deadline)))
            .and_then(|()| s.read_exact(&mut reply));
        if let Some((_, p)) = &shm {
            ShmPair::unlink(p);
        }
        let op = || format!("rendezvous: handshake with rank {peer}");
        match got {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(CommError::Timeout {
                    op: op(),
                    peer: Some(peer),
                    after: cfg.started.elapsed(),
                });
            }
            Err(e) => return Err(CommError::io(op(), Some(peer), e)),
        }
        match reply[0] {
            OK => {}
            BAD_TOKEN => {
                return Err(CommError::io(
                    op(),
                    Some(peer),
                    io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("rank {peer} refused our job token"),
                    ),
                ));
            }
            code => {
                return Err(CommError::io(
                    op(),
                    Some(peer),
                    io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("rank {peer} refused the connection (code {code})"),
                    ),
                ));
            }
        }
        let shm = if reply[1] == 1 { shm.map(|(p, _)| p) } else { None };
        links[peer] = Some(
            Link::new(s, shm).map_err(|e| CommError::io("rendezvous: socket setup", Some(peer), e))?,
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
