//! The progress engine: drives a set of concurrent sends and receives over peer links until all
//! are done, so sending, receiving and reducing overlap in one thread without deadlock.
//!
//! Every message on a link is padded to a multiple of 8 bytes, so shared-memory ring positions
//! stay 8-aligned at message starts and no element ever straddles the ring's wrap-around.
//!
//! Waiting escalates: spin (only when every local rank has its own core), then `sched_yield`,
//! then sleep on a futex (shared memory) or `poll` (TCP). While asleep it checks the TCP socket
//! of each shared-memory peer it waits on, so a peer killed with SIGKILL is seen within a few
//! milliseconds. A stall longer than the timeout is a [`CommError::Timeout`] naming the peer.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::ReduceOp;
use super::link::{Link, LinkError};
use crate::error::CommError;

/// Header bytes in front of every collective's first message.
pub(crate) const HDR: usize = 32;
const MAGIC: u32 = 0x4744_4450; // "PDDG"
const ZEROS: [u8; 8] = [0; 8];
/// Largest inline payload a header may announce (guards against a garbled stream).
const MAX_INLINE: u64 = 64 << 20;

/// Busy-spin this long before yielding (only when ranks are not oversubscribed).
const SPIN: Duration = Duration::from_micros(30);
/// Yield this long before sleeping.
const YIELD: Duration = Duration::from_micros(300);
/// Longest single sleep on a shared-memory futex before re-checking liveness.
const SHM_NAP: Duration = Duration::from_millis(2);
/// Longest single `poll` on TCP before re-checking the deadline.
const TCP_NAP: Duration = Duration::from_millis(100);

/// Bytes of padding after a message of `len` bytes.
pub(crate) fn pad8(len: usize) -> usize {
    (8 - len % 8) % 8
}

/// Which collective a header announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    AllGatherVarlen = 4,
    BroadcastBytes = 5,
    Barrier = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::AllGather,
            4 => Kind::AllGatherVarlen,
            5 => Kind::BroadcastBytes,
            6 => Kind::Barrier,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::AllGatherVarlen => "all_gather_varlen",
            Kind::BroadcastBytes => "broadcast_bytes",
            Kind::Barrier => "barrier",
        }
    }
}

/// The header every rank sends every other rank at the start of a collective; comparing them
/// turns mismatched calls into [`CommError::Mismatch`] on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    /// [`ReduceOp`] code (all_reduce only).
    pub op: u8,
    /// The sender's data follows the header.
    pub inline: bool,
    /// Element size in bytes.
    pub elem: u8,
    /// Call number in this group (1, 2, …).
    pub seq: u64,
    /// Element count (the sender's own count for variable-length calls).
    pub len: u64,
    pub root: u32,
    /// Element type tag.
    pub dtype: u32,
    /// Name of the element type (not sent; for messages).
    pub dtype_name: &'static str,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op;
        b[6] = self.inline as u8;
        b[7] = self.elem;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.root.to_le_bytes());
        b[28..32].copy_from_slice(&self.dtype.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HDR]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC || b[6] > 1 {
            return None;
        }
        Some(Header {
            kind: Kind::from_u8(b[4])?,
            op: b[5],
            inline: b[6] == 1,
            elem: b[7],
            seq: u64_at(8),
            len: u64_at(16),
            root: u32_at(24),
            dtype: u32_at(28),
            dtype_name: "",
        })
    }

    /// Bytes of inline payload after this header.
    pub(crate) fn payload_len(&self) -> Option<usize> {
        if !self.inline {
            return Some(0);
        }
        let n = self.len.checked_mul(self.elem as u64)?;
        (n <= MAX_INLINE).then_some(n as usize)
    }
}

pub(crate) fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Mean => 2,
        ReduceOp::Max => 3,
        ReduceOp::Min => 4,
    }
}

pub(crate) fn op_name(code: u8) -> &'static str {
    match code {
        1 => "sum",
        2 => "mean",
        3 => "max",
        4 => "min",
        _ => "-",
    }
}

/// A received header and its inline payload.
#[derive(Default)]
pub(crate) struct Msg {
    pub hdr: [u8; HDR],
    got: usize,
    pub payload: Vec<u8>,
    want: Option<usize>,
}

impl Msg {
    pub(crate) fn reset(&mut self) {
        self.got = 0;
        self.want = None;
        self.payload.clear();
    }

    /// The decoded header (valid after the exchange).
    pub(crate) fn header(&self) -> Option<Header> {
        Header::decode(&self.hdr)
    }
}

/// A reduction of raw received bytes into a byte view of a typed buffer.
pub(crate) type ReduceFn = fn(&mut [u8], &[u8], ReduceOp);

/// Where received bytes go.
pub(crate) enum Dst<'a> {
    /// Copied as they are.
    Copy(&'a mut [u8]),
    /// Reduced into the buffer, whole elements at a time.
    Reduce {
        dst: &'a mut [u8],
        f: ReduceFn,
        op: ReduceOp,
        elem: usize,
    },
}

impl Dst<'_> {
    fn len(&self) -> usize {
        match self {
            Dst::Copy(d) => d.len(),
            Dst::Reduce { dst, .. } => dst.len(),
        }
    }
}

/// One transfer the engine drives.
pub(crate) enum Op<'a> {
    /// Send `hdr` (if any), then `data`, then padding.
    Send {
        peer: usize,
        hdr: Option<[u8; HDR]>,
        data: &'a [u8],
        done: usize,
    },
    /// Receive `dst.len()` bytes (plus padding).
    Recv { peer: usize, dst: Dst<'a>, done: usize },
    /// Receive `buf` from `from` and forward every byte to `to` as it arrives.
    Relay {
        from: usize,
        to: usize,
        buf: &'a mut [u8],
        got: usize,
        sent: usize,
    },
    /// Receive a header and the inline payload it announces.
    Msg { peer: usize, msg: &'a mut Msg },
}

impl Op<'_> {
    fn finished(&self) -> bool {
        match self {
            Op::Send {
                hdr, data, done, ..
            } => {
                let h = if hdr.is_some() { HDR } else { 0 };
                *done == h + data.len() + pad8(data.len())
            }
            Op::Recv { dst, done, .. } => *done == dst.len() + pad8(dst.len()),
            Op::Relay { buf, got, sent, .. } => {
                let w = buf.len() + pad8(buf.len());
                *got == w && *sent == w
            }
            Op::Msg { msg, .. } => msg.want.is_some_and(|w| msg.got == HDR + w),
        }
    }

    /// The peer this op waits on to receive (preferred in timeout messages), then to send.
    fn waits_on(&self) -> (Option<usize>, Option<usize>) {
        match self {
            Op::Send { peer, .. } => (None, Some(*peer)),
            Op::Recv { peer, .. } | Op::Msg { peer, .. } => (Some(*peer), None),
            Op::Relay {
                from,
                to,
                buf,
                got,
                ..
            } => {
                let w = buf.len() + pad8(buf.len());
                if *got < w {
                    (Some(*from), Some(*to))
                } else {
                    (None, Some(*to))
                }
            }
        }
    }
}

/// How to wait and for how long.
pub(crate) struct Waiting {
    /// Deadline for a stall (no progress at all).
    pub timeout: Duration,
    /// Busy-spin before yielding (every local rank has a core of its own).
    pub spin: bool,
}

fn link_of(links: &mut [Option<Link>], peer: usize) -> &mut Link {
    links[peer]
        .as_mut()
        .expect("the engine is only given ops on connected peers")
}

fn link_err(e: LinkError, peer: usize, what: &str) -> CommError {
    match e {
        LinkError::Closed => CommError::PeerClosed {
            peer,
            op: what.to_string(),
        },
        LinkError::Io(source) => CommError::io(what, Some(peer), source),
    }
}

/// Sends the next piece of an outgoing message; returns bytes sent.
fn send_step(
    link: &mut Link,
    hdr: Option<&[u8; HDR]>,
    data: &[u8],
    done: usize,
) -> Result<usize, LinkError> {
    let h = if hdr.is_some() { HDR } else { 0 };
    let total = h + data.len() + pad8(data.len());
    let piece: &[u8] = if done < h {
        &hdr.expect("header present")[done..]
    } else if done < h + data.len() {
        &data[done - h..]
    } else {
        &ZEROS[..total - done]
    };
    link.send_some(piece)
}

/// Drops up to `n` padding bytes; returns how many.
fn skip(link: &mut Link, n: usize) -> Result<usize, LinkError> {
    let k = link.readable(1, n)?;
    if k > 0 {
        link.consume(k);
    }
    Ok(k)
}

/// Makes progress on one op; returns bytes moved.
fn progress(op: &mut Op<'_>, links: &mut [Option<Link>], what: &str) -> Result<usize, CommError> {
    match op {
        Op::Send {
            peer,
            hdr,
            data,
            done,
        } => {
            let n = send_step(link_of(links, *peer), hdr.as_ref(), data, *done)
                .map_err(|e| link_err(e, *peer, what))?;
            *done += n;
            Ok(n)
        }
        Op::Recv { peer, dst, done } => {
            let link = link_of(links, *peer);
            let len = dst.len();
            let n = if *done < len {
                match dst {
                    Dst::Copy(d) => link.recv_into(&mut d[*done..]),
                    Dst::Reduce { dst, f, op, elem } => {
                        let avail = link.readable(*elem, len - *done);
                        avail.map(|a| {
                            let a = a - a % *elem;
                            if a > 0 {
                                f(&mut dst[*done..*done + a], link.peek(a), *op);
                                link.consume(a);
                            }
                            a
                        })
                    }
                }
            } else {
                skip(link, len + pad8(len) - *done)
            }
            .map_err(|e| link_err(e, *peer, what))?;
            *done += n;
            Ok(n)
        }
        Op::Relay {
            from,
            to,
            buf,
            got,
            sent,
        } => {
            let len = buf.len();
            let wire = len + pad8(len);
            let mut moved = 0;
            if *got < wire {
                let link = link_of(links, *from);
                let n = if *got < len {
                    link.recv_into(&mut buf[*got..])
                } else {
                    skip(link, wire - *got)
                }
                .map_err(|e| link_err(e, *from, what))?;
                *got += n;
                moved += n;
            }
            if *sent < *got {
                let link = link_of(links, *to);
                let n = if *sent < len {
                    link.send_some(&buf[*sent..(*got).min(len)])
                } else {
                    link.send_some(&ZEROS[..wire - *sent])
                }
                .map_err(|e| link_err(e, *to, what))?;
                *sent += n;
                moved += n;
            }
            Ok(moved)
        }
        Op::Msg { peer, msg } => {
            let link = link_of(links, *peer);
            let mut moved = 0;
            if msg.got < HDR {
                let n = link
                    .recv_into(&mut msg.hdr[msg.got..])
                    .map_err(|e| link_err(e, *peer, what))?;
                msg.got += n;
                moved += n;
                if msg.got < HDR {
                    return Ok(moved);
                }
                let len = msg.header().and_then(|h| h.payload_len()).ok_or_else(|| {
                    CommError::io(
                        what,
                        Some(*peer),
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("rank {peer} sent a garbled collective header"),
                        ),
                    )
                })?;
                msg.payload.resize(len, 0);
                msg.want = Some(len + pad8(len));
            }
            let want = msg.want.expect("set after the header");
            let body = msg.got - HDR;
            if body < want {
                let plen = msg.payload.len();
                let n = if body < plen {
                    link.recv_into(&mut msg.payload[body..])
                } else {
                    skip(link, want - body)
                }
                .map_err(|e| link_err(e, *peer, what))?;
                msg.got += n;
                moved += n;
            }
            Ok(moved)
        }
    }
}

/// Runs `ops` to completion, or returns the first error (the caller poisons the group).
pub(crate) fn drive(
    links: &mut [Option<Link>],
    ops: &mut [Op<'_>],
    wait: &Waiting,
    what: &str,
) -> Result<(), CommError> {
    let mut stall_since: Option<Instant> = None;
    let mut naps = 0u32;
    loop {
        let mut moved = 0;
        let mut all_done = true;
        for op in ops.iter_mut() {
            if op.finished() {
                continue;
            }
            moved += progress(op, links, what)?;
            if !op.finished() {
                all_done = false;
            }
        }
        if all_done {
            return Ok(());
        }
        if moved > 0 {
            stall_since = None;
            naps = 0;
            continue;
        }
        let now = Instant::now();
        let since = *stall_since.get_or_insert(now);
        let waited = now - since;
        if waited >= wait.timeout {
            let peer = pending_peer(ops);
            return Err(CommError::Timeout {
                op: what.to_string(),
                peer,
                after: waited,
            });
        }
        if wait.spin && waited < SPIN {
            std::hint::spin_loop();
            continue;
        }
        if waited < YIELD {
            std::thread::yield_now();
            continue;
        }
        naps += 1;
        sleep_until_progress(links, ops, wait.timeout - waited, naps, what)?;
    }
}

/// The peer to blame for a stall: the first one we wait to receive from, else to send to.
fn pending_peer(ops: &[Op<'_>]) -> Option<usize> {
    let pending = ops.iter().filter(|o| !o.finished());
    let mut send_peer = None;
    for op in pending {
        let (r, s) = op.waits_on();
        if r.is_some() {
            return r;
        }
        send_peer = send_peer.or(s);
    }
    send_peer
}

fn sleep_until_progress(
    links: &mut [Option<Link>],
    ops: &[Op<'_>],
    left: Duration,
    naps: u32,
    what: &str,
) -> Result<(), CommError> {
    // Liveness of shared-memory peers: their TCP socket only ever carries EOF.
    let mut shm_wait: Option<(usize, bool)> = None;
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut fd_peers: Vec<(usize, bool)> = Vec::new();
    for op in ops.iter().filter(|o| !o.finished()) {
        let (r, s) = op.waits_on();
        for (peer, recv) in [(r, true), (s, false)] {
            let Some(peer) = peer else { continue };
            let link = link_of(links, peer);
            if link.is_shm() {
                if link.tcp_hung_up() {
                    return Err(CommError::PeerClosed {
                        peer,
                        op: what.to_string(),
                    });
                }
                shm_wait.get_or_insert((peer, recv));
            } else {
                let ev = if recv { libc::POLLIN } else { libc::POLLOUT };
                fds.push(libc::pollfd {
                    fd: link.tcp.as_raw_fd(),
                    events: ev | libc::POLLRDHUP,
                    revents: 0,
                });
                fd_peers.push((peer, recv));
            }
        }
    }
    if let Some((peer, recv)) = shm_wait {
        // Naps grow from 50 µs to SHM_NAP; TCP fds (mixed hosts) are polled without blocking.
        let nap = Duration::from_micros(50u64 << naps.min(6))
            .min(SHM_NAP)
            .min(left);
        let link = link_of(links, peer);
        if recv {
            link.wait_shm_data(nap);
        } else {
            link.wait_shm_space(nap);
        }
        poll_tcp(&mut fds, &fd_peers, Duration::ZERO, what)
    } else {
        poll_tcp(&mut fds, &fd_peers, TCP_NAP.min(left), what)
    }
}

fn poll_tcp(
    fds: &mut [libc::pollfd],
    peers: &[(usize, bool)],
    timeout: Duration,
    what: &str,
) -> Result<(), CommError> {
    if fds.is_empty() {
        return Ok(());
    }
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a valid array of pollfd of the given length.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r <= 0 {
        return Ok(());
    }
    for (p, &(peer, recv)) in fds.iter().zip(peers) {
        // A sender whose peer hung up would otherwise wait forever for POLLOUT; a receiver
        // finds EOF on its next read.
        let gone = p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        if gone && !recv {
            return Err(CommError::PeerClosed {
                peer,
                op: what.to_string(),
            });
        }
    }
    Ok(())
}
