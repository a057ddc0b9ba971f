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
//!
//! Longer than 600 lines because the engine is one state machine (link states, message
//! progress, the escalating wait) whose parts read each other's fields on every turn; the wire
//! header it sends already lives in `header.rs`.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

pub(crate) use super::link::pad8;
use super::link::{Link, LinkError, ZEROS, link_err, link_of, skip};
use super::ordered::OrderedReduce;
use crate::error::CommError;

pub(crate) use super::header::{HDR, Header, Kind, NODE_AWARE_OP, op_code, op_name};

/// Busy-spin this long before yielding (only when ranks are not oversubscribed).
const SPIN: Duration = Duration::from_micros(3);
/// Yield this long before sleeping.
const YIELD: Duration = Duration::from_micros(300);
/// Longest single sleep on a shared-memory futex before re-checking liveness.
const SHM_NAP: Duration = Duration::from_millis(2);
/// Longest single `poll` on TCP before re-checking the deadline.
const TCP_NAP: Duration = Duration::from_millis(100);

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
    Recv {
        peer: usize,
        dst: &'a mut [u8],
        done: usize,
    },
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
    /// A whole ring algorithm as one pipeline (see [`RingPipe`]).
    Ring(RingPipe<'a>),
    /// One piece received from several peers and reduced in a fixed order as it streams in
    /// (see [`OrderedReduce`]).
    Ordered(OrderedReduce<'a>),
}

/// One chunk a ring pipeline receives: a byte range of the buffer.
#[derive(Debug, Clone)]
pub(crate) struct RingItem {
    pub range: std::ops::Range<usize>,
}

/// A ring all-gather as one stream per direction: the rank sends `first` to `next`, then
/// forwards each received item except the last, each byte as soon as it has been received.
/// Receiving never waits for sending, so the ring cannot deadlock, and every step overlaps
/// with the next: NCCL's ring pipeline.
pub(crate) struct RingPipe<'a> {
    pub prev: usize,
    pub next: usize,
    pub buf: &'a mut [u8],
    pub first: std::ops::Range<usize>,
    pub items: Vec<RingItem>,
    /// Receive cursor: item and wire offset inside it.
    pub ri: usize,
    pub ro: usize,
    /// Send cursor: item (0 = `first`, k = `items[k-1]`) and wire offset.
    pub si: usize,
    pub so: usize,
}

impl<'a> RingPipe<'a> {
    /// A pipeline over `buf`, cursors at the start.
    pub(crate) fn new(
        prev: usize,
        next: usize,
        buf: &'a mut [u8],
        first: std::ops::Range<usize>,
        items: Vec<RingItem>,
    ) -> Self {
        RingPipe {
            prev,
            next,
            buf,
            first,
            items,
            ri: 0,
            ro: 0,
            si: 0,
            so: 0,
        }
    }

    fn sends(&self) -> usize {
        self.items.len()
    }

    fn send_range(&self, k: usize) -> std::ops::Range<usize> {
        if k == 0 {
            self.first.clone()
        } else {
            self.items[k - 1].range.clone()
        }
    }

    /// Skips finished (and empty) items on both cursors.
    fn settle(&mut self) {
        while self.ri < self.items.len() {
            let l = self.items[self.ri].range.len();
            if self.ro == l + pad8(l) {
                self.ri += 1;
                self.ro = 0;
            } else {
                break;
            }
        }
        while self.si < self.sends() {
            let l = self.send_range(self.si).len();
            if self.so == l + pad8(l) {
                self.si += 1;
                self.so = 0;
            } else {
                break;
            }
        }
    }

    fn finished(&self) -> bool {
        self.ri == self.items.len() && self.si == self.sends()
    }

    /// Bytes of send item `k` that are ready to go.
    fn ready(&self, k: usize) -> usize {
        let len = self.send_range(k).len();
        if k == 0 || k - 1 < self.ri {
            len
        } else if k - 1 == self.ri {
            self.ro.min(len)
        } else {
            0
        }
    }

    fn progress(&mut self, links: &mut [Option<Link>], what: &str) -> Result<usize, CommError> {
        self.settle();
        let mut moved = 0;
        if self.ri < self.items.len() {
            let item = self.items[self.ri].clone();
            let len = item.range.len();
            let link = link_of(links, self.prev);
            let n = if self.ro < len {
                let at = item.range.start + self.ro;
                link.recv_into(&mut self.buf[at..item.range.end])
            } else {
                skip(link, len + pad8(len) - self.ro)
            }
            .map_err(|e| link_err(e, self.prev, what))?;
            self.ro += n;
            moved += n;
            self.settle();
        }
        if self.si < self.sends() {
            let range = self.send_range(self.si);
            let len = range.len();
            let ready = self.ready(self.si);
            let link = link_of(links, self.next);
            let n = if self.so < len {
                if ready > self.so {
                    link.send_some(&self.buf[range.start + self.so..range.start + ready])
                } else {
                    Ok(0)
                }
            } else {
                link.send_some(&ZEROS[..len + pad8(len) - self.so])
            }
            .map_err(|e| link_err(e, self.next, what))?;
            self.so += n;
            moved += n;
            self.settle();
        }
        Ok(moved)
    }
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
            // Cursors are settled at the end of every `progress` call.
            Op::Ring(p) => p.finished(),
            Op::Ordered(o) => o.finished(),
        }
    }

    /// The peer this op waits on to receive (preferred in timeout messages), and the peer it
    /// has bytes ready for but cannot send yet (sends waiting for input do not count, or a
    /// TCP wait would spin on an always-writable socket).
    fn waits_on(&self) -> (Option<usize>, Option<usize>) {
        match self {
            Op::Send { peer, .. } => (None, Some(*peer)),
            Op::Recv { peer, .. } | Op::Msg { peer, .. } => (Some(*peer), None),
            Op::Ring(p) => {
                let send_blocked =
                    p.si < p.sends() && (p.so >= p.send_range(p.si).len() || p.ready(p.si) > p.so);
                (
                    (p.ri < p.items.len()).then_some(p.prev),
                    send_blocked.then_some(p.next),
                )
            }
            Op::Relay {
                from,
                to,
                buf,
                got,
                sent,
            } => {
                let w = buf.len() + pad8(buf.len());
                ((*got < w).then_some(*from), (*sent < *got).then_some(*to))
            }
            Op::Ordered(o) => o.waits_on(),
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
                link.recv_into(&mut dst[*done..])
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
        Op::Ring(pipe) => pipe.progress(links, what),
        Op::Ordered(o) => o.progress(links, what),
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
    drive_inner(links, ops, wait, what).map_err(|e| attribute(e, links))
}

/// A peer that closed its link because another rank failed says so: name that rank.
fn attribute(e: CommError, links: &[Option<Link>]) -> CommError {
    match e {
        CommError::PeerClosed { peer, op } => {
            match links[peer].as_ref().and_then(Link::blamed) {
                // (The culprit is another peer, not this rank itself.)
                Some(culprit)
                    if culprit != peer && links.get(culprit).is_some_and(Option::is_some) =>
                {
                    CommError::PeerClosed {
                        peer: culprit,
                        op: format!("{op}, as reported by rank {peer}"),
                    }
                }
                _ => CommError::PeerClosed { peer, op },
            }
        }
        e => e,
    }
}

fn drive_inner(
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
        // Yielding only pays for shared memory; a TCP wait sleeps in poll(), which the
        // kernel ends as soon as data arrives.
        if waited < YIELD && waits_on_shm(links, ops) {
            std::thread::yield_now();
            continue;
        }
        naps += 1;
        sleep_until_progress(links, ops, wait.timeout - waited, naps, what)?;
    }
}

fn waits_on_shm(links: &[Option<Link>], ops: &[Op<'_>]) -> bool {
    ops.iter().filter(|o| !o.finished()).any(|o| {
        let (r, s) = o.waits_on();
        [r, s]
            .into_iter()
            .flatten()
            .any(|p| links[p].as_ref().is_some_and(Link::is_shm))
    })
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
                // A peer that finished its part and left (its socket hung up) may have left
                // bytes in the ring this rank still has to read: gone only once they are read.
                if link.stream_hung_up() && !(recv && link.shm_has_data()) {
                    return Err(CommError::PeerClosed {
                        peer,
                        op: what.to_string(),
                    });
                }
                shm_wait.get_or_insert((peer, recv));
            } else {
                let ev = if recv { libc::POLLIN } else { libc::POLLOUT };
                fds.push(libc::pollfd {
                    fd: link.stream.as_raw_fd(),
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
