//! The rendezvous key-value store (the part c10d's TCPStore plays in PyTorch).
//!
//! Rank 0 serves it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 too) talks to it through a
//! [`StoreClient`]. Keys map to byte values; `get` and `wait` block until the key appears or the
//! timeout passes; `add` is an atomic counter. A connection must present the job token first;
//! connections without it are refused and logged.
//!
//! # Protocol
//!
//! Frames over TCP (`TCP_NODELAY`): a little-endian `u32` length, then that many bytes. The
//! first byte of a frame is an opcode. The first frame of every connection is a handshake
//! carrying a magic, a protocol version and the job token; the server answers `OK` or a refusal
//! and closes the connection. Waiting requests (`get`, `wait`) carry their timeout and are
//! answered by the server when the keys appear (it waits on a condition variable) or when the
//! timeout passes, so clients never poll.
//!
//! ```
//! use std::time::Duration;
//! use ddp_comm::store::{StoreClient, StoreServer};
//! # fn main() -> Result<(), ddp_comm::CommError> {
//! let server = StoreServer::bind("127.0.0.1:0", Some("secret".into()))?;
//! let endpoint = server.local_addr().to_string();
//! let mut a = StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(5))?;
//! let mut b = StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(5))?;
//! a.set("addr/0", b"10.0.0.1:4000")?;
//! assert_eq!(b.get("addr/0", Duration::from_secs(1))?, b"10.0.0.1:4000");
//! assert_eq!(a.add("arrived", 1)?, 1);
//! assert_eq!(b.add("arrived", 1)?, 2);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

/// Magic at the start of every handshake ("DDPS").
const MAGIC: [u8; 4] = *b"DDPS";
/// Protocol version; bumped on incompatible changes.
const VERSION: u8 = 1;
/// Largest handshake frame the server reads from a connection it does not trust yet.
const MAX_HANDSHAKE_FRAME: usize = 4096;
/// Largest frame either side accepts (keys and values are small: addresses, NCCL ids).
const MAX_FRAME: usize = 64 << 20;
/// How long the server waits for a new connection's handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections that may be in their handshake at once; more are refused at accept.
const MAX_UNAUTHENTICATED: usize = 64;
/// The longest a `get`/`wait` waits on the server, whatever timeout it asked for.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How often the accept loop checks for shutdown (it wakes at once for new connections).
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Default deadline for a reply to a request that does not wait for keys.
const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// First and largest pause between connection attempts.
const CONNECT_BACKOFF_START: Duration = Duration::from_millis(2);
const CONNECT_BACKOFF_CAP: Duration = Duration::from_millis(50);
/// How often a rank still connecting to the store says so.
const CONNECT_PROGRESS_EVERY: Duration = Duration::from_secs(10);

// Requests (client → server).
const OP_HELLO: u8 = 1;
const OP_SET: u8 = 2;
const OP_GET: u8 = 3;
const OP_TRY_GET: u8 = 4;
const OP_ADD: u8 = 5;
const OP_WAIT: u8 = 6;
// Replies (server → client).
const R_OK: u8 = 0x80;
const R_VALUE: u8 = 0x81;
const R_MISSING: u8 = 0x82;
const R_INT: u8 = 0x83;
const R_TIMEOUT: u8 = 0x84;
const R_REFUSED: u8 = 0x85;
const R_ERROR: u8 = 0x86;

// ---------------------------------------------------------------------------------------------
// Framing and encoding
// ---------------------------------------------------------------------------------------------

/// Builds one frame's payload.
#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn op(op: u8) -> Self {
        Enc(vec![op])
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
    fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// Reads fields from a frame's payload; every read checks the length.
struct Dec<'a>(&'a [u8]);

/// A frame that does not parse.
#[derive(Debug)]
struct Malformed;

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> std::result::Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> std::result::Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::result::Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn i64(&mut self) -> std::result::Result<i64, Malformed> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self) -> std::result::Result<&'a [u8], Malformed> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> std::result::Result<String, Malformed> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| Malformed)
    }
    fn end(&self) -> std::result::Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed)
        }
    }
}

fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "message of {} bytes exceeds the store's limit of {MAX_FRAME} bytes",
                payload.len()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    stream.write_all(&buf)
}

/// Reads one frame. `Ok(None)` means the peer closed the connection cleanly between frames.
fn read_frame(stream: &mut TcpStream, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(Some(buf))
}

/// Compares tokens in time independent of where they differ.
fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn duration_from_micros(us: u64) -> Duration {
    Duration::from_micros(us)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// The key-value state shared by all connection threads.
#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    token: Option<String>,
    shutdown: AtomicBool,
    /// Clones of open connections, so that shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Connections that have not finished their handshake (not yet shown the token).
    unauthenticated: AtomicUsize,
    /// Connections refused at accept because [`MAX_UNAUTHENTICATED`] were pending.
    refused: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in a connection thread must not take the store down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
            .field("token", &self.shared.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and serves until dropped.
    /// Only clients presenting `token` (when `Some`) are served.
    ///
    /// Exactly the given address is bound; pass `0.0.0.0:PORT` explicitly to listen on all
    /// interfaces.
    pub fn bind(addr: &str, token: Option<String>) -> Result<Self> {
        let op = || format!("binding the rendezvous store to {addr}");
        let listener = TcpListener::bind(addr).map_err(|e| CommError::io(op(), None, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| CommError::io(op(), None, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io(op(), None, e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            token,
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            unauthenticated: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
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

    /// Connections refused at accept because 64 others were still in their handshake (a port
    /// scan or a flood of clients without the job token).
    pub fn refused_connections(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                workers.retain(|h| !h.is_finished());
                // A port scan or a flood must not exhaust rank 0's threads or memory: at most
                // MAX_UNAUTHENTICATED connections may be in their handshake at once.
                if shared.unauthenticated.load(Ordering::SeqCst) >= MAX_UNAUTHENTICATED {
                    let n = shared.refused.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_power_of_two() {
                        tracing::warn!(
                            %peer,
                            "rendezvous store: refused a connection: {MAX_UNAUTHENTICATED} \
                             connections are already in their handshake ({n} refused so far)"
                        );
                    }
                    let _ = stream.shutdown(Shutdown::Both);
                    continue;
                }
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = stream.set_nonblocking(false) {
                    tracing::warn!(%peer, "rendezvous store: dropping connection: {e}");
                    continue;
                }
                let _ = stream.set_nodelay(true);
                match stream.try_clone() {
                    Ok(clone) => {
                        shared
                            .conns
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(id, clone);
                    }
                    Err(e) => {
                        tracing::warn!(%peer, "rendezvous store: dropping connection: {e}");
                        continue;
                    }
                }
                // Close the race with shutdown: a connection registered after the final sweep
                // below would never be unblocked.
                if shared.shutdown.load(Ordering::SeqCst) {
                    let _ = stream.shutdown(Shutdown::Both);
                    break;
                }
                let sh = Arc::clone(&shared);
                shared.unauthenticated.fetch_add(1, Ordering::SeqCst);
                let spawned = std::thread::Builder::new()
                    .name("ddp-store-conn".into())
                    .spawn(move || {
                        serve_connection(stream, peer, &sh);
                        sh.conns
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&id);
                    });
                match spawned {
                    Ok(h) => workers.push(h),
                    Err(e) => {
                        shared.unauthenticated.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(%peer, "rendezvous store: cannot start a thread: {e}");
                        if let Some(s) = shared
                            .conns
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&id)
                        {
                            let _ = s.shutdown(Shutdown::Both);
                        }
                    }
                }
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
    for (_, s) in shared
        .conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
    {
        let _ = s.shutdown(Shutdown::Both);
    }
    for h in workers {
        let _ = h.join();
    }
}

/// Checks the handshake frame; returns a refusal reason on failure.
fn check_handshake(frame: &[u8], token: Option<&str>) -> std::result::Result<(), &'static str> {
    let mut d = Dec(frame);
    let parsed = (|| {
        let op = d.u8()?;
        let magic = d.take(4)?;
        let version = d.u8()?;
        let has_token = d.u8()?;
        let tok = d.bytes()?;
        d.end()?;
        Ok::<_, Malformed>((op, magic, version, has_token, tok))
    })();
    let Ok((op, magic, version, has_token, tok)) = parsed else {
        return Err("malformed handshake (not a ddp-comm store client?)");
    };
    if op != OP_HELLO || magic != MAGIC {
        return Err("malformed handshake (not a ddp-comm store client?)");
    }
    if version != VERSION {
        return Err("protocol version mismatch (ranks built from different ddp-comm versions?)");
    }
    match token {
        None => Ok(()),
        Some(expected) if has_token == 1 && tokens_equal(expected.as_bytes(), tok) => Ok(()),
        Some(_) if has_token == 1 => Err("wrong job token"),
        Some(_) => Err("missing job token"),
    }
}

fn serve_connection(stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let authenticated = handshake(stream, peer, shared);
    shared.unauthenticated.fetch_sub(1, Ordering::SeqCst);
    if let Some(stream) = authenticated {
        serve_requests(stream, peer, shared);
    }
}

/// Reads and checks the client's handshake; the stream of an accepted client, else `None`.
fn handshake(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) -> Option<TcpStream> {
    // The handshake: bounded size and time, since the peer is not trusted yet.
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let frame = match read_frame(&mut stream, MAX_HANDSHAKE_FRAME) {
        Ok(Some(f)) => f,
        Ok(None) => return None, // connected and closed (a port probe)
        Err(e) => {
            tracing::warn!(%peer, "rendezvous store: refused connection from {peer}: no valid handshake ({e})");
            let msg = format!("no valid handshake: {e}");
            let _ = write_frame(&mut stream, &Enc::op(R_REFUSED).bytes(msg.as_bytes()).0);
            return None;
        }
    };
    if let Err(why) = check_handshake(&frame, shared.token.as_deref()) {
        tracing::warn!(%peer, "rendezvous store: refused connection from {peer}: {why}");
        let _ = write_frame(&mut stream, &Enc::op(R_REFUSED).bytes(why.as_bytes()).0);
        let _ = stream.shutdown(Shutdown::Both);
        return None;
    }
    if write_frame(&mut stream, &Enc::op(R_OK).0).is_err() {
        return None;
    }
    tracing::debug!(%peer, "rendezvous store: client connected");
    Some(stream)
}

/// Serves an accepted client's requests until it closes the connection or the store stops.
fn serve_requests(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    // Accepted clients may stay idle for a whole training run: no read timeout. Shutdown
    // unblocks the read by closing the socket.
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(DEFAULT_IO_TIMEOUT));
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
        let reply = match handle_request(&frame, shared) {
            Ok(r) => r,
            Err(Malformed) => {
                tracing::warn!(%peer, "rendezvous store: malformed request from {peer}; closing");
                let _ = write_frame(&mut stream, &Enc::op(R_ERROR).bytes(b"malformed request").0);
                break;
            }
        };
        if write_frame(&mut stream, &reply).is_err() {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn handle_request(frame: &[u8], shared: &Shared) -> std::result::Result<Vec<u8>, Malformed> {
    let mut d = Dec(frame);
    let op = d.u8()?;
    match op {
        OP_SET => {
            let key = d.string()?;
            let value = d.bytes()?.to_vec();
            d.end()?;
            shared.lock().map.insert(key, value);
            shared.changed.notify_all();
            Ok(Enc::op(R_OK).0)
        }
        OP_TRY_GET => {
            let key = d.string()?;
            d.end()?;
            Ok(match shared.lock().map.get(&key) {
                Some(v) => Enc::op(R_VALUE).bytes(v).0,
                None => Enc::op(R_MISSING).0,
            })
        }
        OP_ADD => {
            let key = d.string()?;
            let delta = d.i64()?;
            d.end()?;
            let mut st = shared.lock();
            let current = match st.map.get(&key) {
                None => 0,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_le_bytes(b),
                    Err(_) => {
                        let msg = format!(
                            "key {key:?} holds a {}-byte value, not a counter made by add",
                            v.len()
                        );
                        return Ok(Enc::op(R_ERROR).bytes(msg.as_bytes()).0);
                    }
                },
            };
            let new = current.wrapping_add(delta);
            st.map.insert(key, new.to_le_bytes().to_vec());
            drop(st);
            shared.changed.notify_all();
            Ok(Enc::op(R_INT).i64(new).0)
        }
        OP_GET | OP_WAIT => {
            let timeout = duration_from_micros(d.u64()?);
            let n = if op == OP_GET { 1 } else { d.u32()? as usize };
            let mut keys = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                keys.push(d.string()?);
            }
            d.end()?;
            // No request waits forever: `Duration::MAX` and the like are clamped.
            let deadline = Instant::now() + timeout.min(MAX_WAIT);
            let mut st = shared.lock();
            loop {
                if st.shutdown {
                    return Ok(Enc::op(R_ERROR)
                        .bytes(b"the store is shutting down (did rank 0 exit?)")
                        .0);
                }
                match keys.iter().find(|k| !st.map.contains_key(k.as_str())) {
                    None => {
                        return Ok(if op == OP_GET {
                            Enc::op(R_VALUE).bytes(&st.map[&keys[0]]).0
                        } else {
                            Enc::op(R_OK).0
                        });
                    }
                    Some(missing) => {
                        let now = Instant::now();
                        if deadline <= now {
                            return Ok(Enc::op(R_TIMEOUT).bytes(missing.as_bytes()).0);
                        }
                        let remaining = deadline - now;
                        st = shared
                            .changed
                            .wait_timeout(st, remaining)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                }
            }
        }
        _ => Err(Malformed),
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// A connection to the store.
///
/// Every request waits for its reply with a deadline: requests that wait for keys use their
/// own timeout plus the client's I/O timeout (30 s by default, see
/// [`StoreClient::set_io_timeout`]); others use the I/O timeout. If the server dies, the next
/// request fails with [`CommError::Store`] naming the store's address. After an I/O error the
/// connection is unusable and every later request returns an error.
pub struct StoreClient {
    stream: TcpStream,
    endpoint: String,
    io_timeout: Duration,
    broken: Option<String>,
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("endpoint", &self.endpoint)
            .field("io_timeout", &self.io_timeout)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Why one connection attempt failed.
enum AttemptError {
    /// Worth retrying until the deadline (refused, reset, …).
    Retry(String),
    /// Final (the server refused the token).
    Fatal(CommError),
}

impl StoreClient {
    /// Connects to `endpoint` (`host:port`), retrying until `timeout` passes (the server may
    /// not be up yet), and presents `token`.
    ///
    /// Retries start after 2 ms and back off to 50 ms, so a client that starts before the
    /// server connects within milliseconds of the server coming up. When `timeout` passes the
    /// error is [`CommError::Timeout`] naming the endpoint; a refused token is
    /// [`CommError::Store`] at once.
    pub fn connect(endpoint: &str, token: Option<&str>, timeout: Duration) -> Result<Self> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = CONNECT_BACKOFF_START;
        let mut last_err;
        let mut attempts = 0u32;
        let mut next_progress = start + CONNECT_PROGRESS_EVERY;
        loop {
            attempts += 1;
            match Self::attempt(endpoint, token, deadline) {
                Ok(client) => {
                    tracing::debug!(endpoint, attempts, elapsed = ?start.elapsed(), "connected to the rendezvous store");
                    return Ok(client);
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retry(msg)) => last_err = msg,
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: format!(
                        "connecting to rendezvous store at {endpoint} ({attempts} attempts, last error: {last_err})"
                    ),
                    peer: Some(0),
                    after: start.elapsed(),
                });
            }
            if now >= next_progress {
                // One line every ~10 s, so a rank waiting for rank 0 is not silent for the
                // whole connect timeout.
                tracing::warn!(
                    "waiting for rank 0's store at {endpoint}: {:.0} s of {:.0} s ({last_err})",
                    start.elapsed().as_secs_f64(),
                    timeout.as_secs_f64()
                );
                next_progress = now + CONNECT_PROGRESS_EVERY;
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(CONNECT_BACKOFF_CAP);
        }
    }

    fn attempt(
        endpoint: &str,
        token: Option<&str>,
        deadline: Instant,
    ) -> std::result::Result<Self, AttemptError> {
        let addrs: Vec<SocketAddr> = endpoint
            .to_socket_addrs()
            .map_err(|e| AttemptError::Retry(format!("cannot resolve {endpoint}: {e}")))?
            .collect();
        if addrs.is_empty() {
            return Err(AttemptError::Retry(format!(
                "{endpoint} resolves to no address"
            )));
        }
        let mut last = String::new();
        for addr in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let mut stream = match TcpStream::connect_timeout(&addr, remaining) {
                Ok(s) => s,
                Err(e) => {
                    last = format!("{addr}: {e}");
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let hello = Enc::op(OP_HELLO)
                .raw(&MAGIC)
                .u8(VERSION)
                .u8(token.is_some() as u8)
                .bytes(token.unwrap_or("").as_bytes());
            // The handshake reply must come before the overall deadline (at least 1 s, so a
            // loaded server on a short deadline is not mistaken for a dead one).
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            let _ = stream.set_read_timeout(Some(wait));
            let _ = stream.set_write_timeout(Some(wait));
            if let Err(e) = write_frame(&mut stream, &hello.0) {
                last = format!("{addr}: sending the handshake: {e}");
                continue;
            }
            match read_frame(&mut stream, MAX_FRAME) {
                Ok(Some(reply)) => {
                    let mut d = Dec(&reply);
                    match d.u8() {
                        Ok(R_OK) => {
                            return Ok(StoreClient {
                                stream,
                                endpoint: endpoint.to_string(),
                                io_timeout: DEFAULT_IO_TIMEOUT,
                                broken: None,
                            });
                        }
                        Ok(R_REFUSED) => {
                            let why = d.string().unwrap_or_else(|_| "no reason given".to_string());
                            return Err(AttemptError::Fatal(CommError::Store {
                                addr: endpoint.to_string(),
                                msg: format!(
                                    "the store refused this connection: {why} (is {} the same on every rank?)",
                                    crate::env::TOKEN_VAR
                                ),
                            }));
                        }
                        _ => {
                            return Err(AttemptError::Fatal(CommError::Store {
                                addr: endpoint.to_string(),
                                msg: "unexpected handshake reply (is this a ddp-comm store?)"
                                    .to_string(),
                            }));
                        }
                    }
                }
                Ok(None) => last = format!("{addr}: closed during the handshake"),
                Err(e) => last = format!("{addr}: during the handshake: {e}"),
            }
        }
        Err(AttemptError::Retry(last))
    }

    /// The endpoint this client connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sets the deadline for replies to requests (added to the timeout of `get`/`wait`).
    pub fn set_io_timeout(&mut self, timeout: Duration) {
        self.io_timeout = timeout;
    }

    /// Sends one request and reads its reply within `reply_within`.
    fn request(&mut self, payload: &[u8], what: &str, reply_within: Duration) -> Result<Vec<u8>> {
        if let Some(why) = &self.broken {
            return Err(CommError::Store {
                addr: self.endpoint.clone(),
                msg: format!("connection unusable after an earlier error: {why}"),
            });
        }
        let result = self.request_inner(payload, what, reply_within);
        if let Err(e) = &result {
            self.broken = Some(e.to_string());
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        result
    }

    fn request_inner(
        &mut self,
        payload: &[u8],
        what: &str,
        reply_within: Duration,
    ) -> Result<Vec<u8>> {
        let start = Instant::now();
        let op = || format!("{what} at rendezvous store {}", self.endpoint);
        let _ = self.stream.set_write_timeout(Some(self.io_timeout));
        // A zero read timeout means "block forever" to the OS: keep it positive.
        let _ = self
            .stream
            .set_read_timeout(Some(reply_within.max(Duration::from_millis(1))));
        let map_io = |e: io::Error, op: String| -> CommError {
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::Timeout {
                    op: format!("{op} (waiting for the store's reply)"),
                    peer: Some(0),
                    after: start.elapsed(),
                },
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => CommError::Store {
                    addr: self.endpoint.clone(),
                    msg: format!(
                        "the store closed the connection during {what} (did rank 0 exit?)"
                    ),
                },
                _ => CommError::io(op, Some(0), e),
            }
        };
        if let Err(e) = write_frame(&mut self.stream, payload) {
            return Err(map_io(e, op()));
        }
        match read_frame(&mut self.stream, MAX_FRAME) {
            Ok(Some(reply)) if !reply.is_empty() => Ok(reply),
            Ok(Some(_)) => Err(CommError::Store {
                addr: self.endpoint.clone(),
                msg: format!("empty reply during {what}"),
            }),
            Ok(None) => Err(map_io(io::ErrorKind::UnexpectedEof.into(), op())),
            Err(e) => Err(map_io(e, op())),
        }
    }

    fn unexpected(&self, what: &str, reply: &[u8]) -> CommError {
        let mut d = Dec(reply);
        let msg = match d.u8() {
            Ok(R_ERROR) => d
                .string()
                .map(|m| format!("{what}: {m}"))
                .unwrap_or_else(|_| format!("{what}: error")),
            Ok(code) => format!("{what}: unexpected reply code {code:#x}"),
            Err(_) => format!("{what}: empty reply"),
        };
        CommError::Store {
            addr: self.endpoint.clone(),
            msg,
        }
    }

    fn malformed(&self, what: &str) -> CommError {
        CommError::Store {
            addr: self.endpoint.clone(),
            msg: format!("{what}: malformed reply"),
        }
    }

    /// Sets `key` to `value` (overwrites).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let what = format!("setting key {key:?}");
        let req = Enc::op(OP_SET).bytes(key.as_bytes()).bytes(value);
        let reply = self.request(&req.0, &what, self.io_timeout)?;
        match reply[0] {
            R_OK => Ok(()),
            _ => Err(self.unexpected(&what, &reply)),
        }
    }

    /// Waits up to `timeout` for `key` to exist and returns its value.
    ///
    /// The wait happens on the server; on timeout the error is [`CommError::Timeout`] naming
    /// the key.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let what = format!("waiting for key {key:?}");
        let req = Enc::op(OP_GET).u64(micros(timeout)).bytes(key.as_bytes());
        let reply = self.request(&req.0, &what, timeout.saturating_add(self.io_timeout))?;
        let mut d = Dec(&reply[1..]);
        match reply[0] {
            R_VALUE => d
                .bytes()
                .map(<[u8]>::to_vec)
                .map_err(|_| self.malformed(&what)),
            R_TIMEOUT => Err(CommError::Timeout {
                op: format!("{what} at rendezvous store {}", self.endpoint),
                peer: None,
                after: timeout,
            }),
            _ => Err(self.unexpected(&what, &reply)),
        }
    }

    /// Returns the value of `key` if it exists now, without waiting.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let what = format!("reading key {key:?}");
        let req = Enc::op(OP_TRY_GET).bytes(key.as_bytes());
        let reply = self.request(&req.0, &what, self.io_timeout)?;
        let mut d = Dec(&reply[1..]);
        match reply[0] {
            R_VALUE => d
                .bytes()
                .map(|v| Some(v.to_vec()))
                .map_err(|_| self.malformed(&what)),
            R_MISSING => Ok(None),
            _ => Err(self.unexpected(&what, &reply)),
        }
    }

    /// Atomically adds `delta` to the integer counter at `key` (missing = 0); returns the new value.
    ///
    /// The counter is stored as 8 little-endian bytes, so `get` on it returns those bytes.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let what = format!("adding to key {key:?}");
        let req = Enc::op(OP_ADD).bytes(key.as_bytes()).i64(delta);
        let reply = self.request(&req.0, &what, self.io_timeout)?;
        let mut d = Dec(&reply[1..]);
        match reply[0] {
            R_INT => d.i64().map_err(|_| self.malformed(&what)),
            _ => Err(self.unexpected(&what, &reply)),
        }
    }

    /// Waits up to `timeout` until all `keys` exist.
    ///
    /// On timeout the error is [`CommError::Timeout`] naming a key that is still missing.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let what = format!("waiting for {} key(s)", keys.len());
        let mut req = Enc::op(OP_WAIT)
            .u64(micros(timeout))
            .raw(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            req = req.bytes(k.as_bytes());
        }
        let reply = self.request(&req.0, &what, timeout.saturating_add(self.io_timeout))?;
        let mut d = Dec(&reply[1..]);
        match reply[0] {
            R_OK => Ok(()),
            R_TIMEOUT => {
                let missing = d.string().map_err(|_| self.malformed(&what))?;
                Err(CommError::Timeout {
                    op: format!(
                        "waiting for key {missing:?} at rendezvous store {}",
                        self.endpoint
                    ),
                    peer: None,
                    after: timeout,
                })
            }
            _ => Err(self.unexpected(&what, &reply)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    const T: Duration = Duration::from_secs(10);

    fn server(token: Option<&str>) -> (StoreServer, String) {
        let s = StoreServer::bind("127.0.0.1:0", token.map(str::to_string)).unwrap();
        let ep = s.local_addr().to_string();
        (s, ep)
    }

    #[test]
    fn set_then_get_and_try_get() {
        let (_s, ep) = server(Some("tok"));
        let mut a = StoreClient::connect(&ep, Some("tok"), T).unwrap();
        let mut b = StoreClient::connect(&ep, Some("tok"), T).unwrap();
        assert_eq!(b.try_get("k").unwrap(), None);
        a.set("k", b"hello").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"hello");
        assert_eq!(b.try_get("k").unwrap().as_deref(), Some(&b"hello"[..]));
        a.set("k", b"").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"");
        let big = (0..1_000_000u32).map(|i| i as u8).collect::<Vec<_>>();
        a.set("big", &big).unwrap();
        assert_eq!(b.get("big", T).unwrap(), big);
    }

    #[test]
    fn get_blocks_until_another_client_sets() {
        let (_s, ep) = server(None);
        let mut waiter = StoreClient::connect(&ep, None, T).unwrap();
        let ep2 = ep.clone();
        let setter = std::thread::spawn(move || {
            let mut c = StoreClient::connect(&ep2, None, T).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            c.set("late", b"v").unwrap();
            c.set("late2", b"w").unwrap();
        });
        assert_eq!(waiter.get("late", T).unwrap(), b"v");
        waiter.wait(&["late", "late2"], T).unwrap();
        setter.join().unwrap();
    }

    #[test]
    fn get_and_wait_time_out_with_the_key_named() {
        let (_s, ep) = server(None);
        let mut c = StoreClient::connect(&ep, None, T).unwrap();
        let err = c.get("never", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, CommError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("\"never\""), "{err}");
        c.set("present", b"1").unwrap();
        let err = c
            .wait(&["present", "absent"], Duration::from_millis(50))
            .unwrap_err();
        assert!(err.to_string().contains("\"absent\""), "{err}");
        // The connection stays usable after a server-side timeout.
        assert_eq!(c.get("present", T).unwrap(), b"1");
    }

    #[test]
    fn add_is_atomic_across_threads() {
        let (_s, ep) = server(Some("t"));
        let threads = 8;
        let per = 200;
        let barrier = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let ep = ep.clone();
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    let mut c = StoreClient::connect(&ep, Some("t"), T).unwrap();
                    barrier.wait();
                    let mut seen = Vec::new();
                    for _ in 0..per {
                        seen.push(c.add("counter", 1).unwrap());
                    }
                    seen
                })
            })
            .collect();
        let mut all: Vec<i64> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        all.sort_unstable();
        // Every intermediate value was returned exactly once.
        assert_eq!(all, (1..=(threads * per) as i64).collect::<Vec<_>>());
        let mut c = StoreClient::connect(&ep, Some("t"), T).unwrap();
        assert_eq!(c.add("counter", -5).unwrap(), (threads * per) as i64 - 5);
        c.set("text", b"abc").unwrap();
        let err = c.add("text", 1).unwrap_err();
        assert!(matches!(err, CommError::Store { .. }), "{err}");
    }

    #[test]
    fn wrong_or_missing_token_is_refused_and_right_one_accepted() {
        let (_s, ep) = server(Some("right"));
        for bad in [Some("wrong"), None, Some("")] {
            let err = StoreClient::connect(&ep, bad, T).unwrap_err();
            match &err {
                CommError::Store { msg, .. } => assert!(msg.contains("refused"), "{err}"),
                other => panic!("expected a refusal, got {other}"),
            }
        }
        let mut c = StoreClient::connect(&ep, Some("right"), T).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k", T).unwrap(), b"v");
    }

    #[test]
    fn raw_garbage_connection_is_refused_and_server_keeps_serving() {
        let (_s, ep) = server(Some("x"));
        let mut raw = TcpStream::connect(&ep).unwrap();
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        let mut buf = Vec::new();
        // The server answers and closes; reading to the end must not hang.
        let _ = raw.read_to_end(&mut buf);
        let mut c = StoreClient::connect(&ep, Some("x"), T).unwrap();
        c.set("still", b"ok").unwrap();
    }

    #[test]
    fn connect_to_a_closed_port_times_out_with_the_endpoint_named() {
        // Bind and drop to get a port that nothing listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ep = format!("127.0.0.1:{port}");
        let start = Instant::now();
        let err = StoreClient::connect(&ep, None, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, CommError::Timeout { .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("connecting to rendezvous store at {ep}")),
            "{err}"
        );
        // Deadline honoured (generous bound: it is a correctness check, not a benchmark).
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn client_started_before_server_connects_once_it_is_up() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ep = format!("127.0.0.1:{port}");
        let ep2 = ep.clone();
        let client = std::thread::spawn(move || {
            let mut c = StoreClient::connect(&ep2, Some("t"), T)?;
            c.get("hello", T)
        });
        std::thread::sleep(Duration::from_millis(100));
        let s = StoreServer::bind(&ep, Some("t".into())).unwrap();
        let mut c = StoreClient::connect(&ep, Some("t"), T).unwrap();
        c.set("hello", b"world").unwrap();
        assert_eq!(client.join().unwrap().unwrap(), b"world");
        drop(s);
    }

    #[test]
    fn server_shutdown_wakes_waiters_with_a_clear_error() {
        let (s, ep) = server(None);
        let mut c = StoreClient::connect(&ep, None, T).unwrap();
        let mut idle = StoreClient::connect(&ep, None, T).unwrap();
        let waiter = std::thread::spawn(move || c.get("never", Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        drop(s);
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, CommError::Store { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10));
        let err = idle.set("k", b"v").unwrap_err();
        assert!(
            matches!(err, CommError::Store { .. } | CommError::Io { .. }),
            "{err}"
        );
        // A broken client keeps reporting an error instead of desynchronising.
        assert!(idle.try_get("k").is_err());
    }

    #[test]
    fn bind_uses_the_given_address_only() {
        let s = StoreServer::bind("127.0.0.1:0", None).unwrap();
        assert_eq!(s.local_addr().ip(), std::net::Ipv4Addr::LOCALHOST);
        let err = StoreServer::bind("not-an-address", None).unwrap_err();
        assert!(err.to_string().contains("not-an-address"), "{err}");
    }
}
