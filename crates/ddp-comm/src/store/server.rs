//! The store's server: an accept thread and one thread per connection, a map of keys behind a
//! mutex, and a condition variable that answers waiting requests when keys appear.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::message::{Reply, Request, VERSION};
use super::{DEFAULT_IO_TIMEOUT, MAX_FRAME};
use crate::auth::{self, Key};
use crate::error::{CommError, Result};
use crate::wire::{ReadBy, read_frame, write_frame};

/// Largest handshake frame the server reads from a connection it does not trust yet.
const MAX_HANDSHAKE_FRAME: usize = 4096;
/// How long the server waits for a new connection's whole handshake (2 s in unit tests, so
/// that the trickling-peer test is short).
pub(super) const HANDSHAKE_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_secs(2)
} else {
    Duration::from_secs(10)
};
/// Most connections that may be in their handshake at once; more are refused at accept.
const MAX_UNAUTHENTICATED: usize = 64;
/// The longest a `get`/`wait` waits on the server, whatever timeout it asked for.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// The roles in the handshake's proofs.
pub(super) const SERVER_ROLE: &str = "ddp-store server";
pub(super) const CLIENT_ROLE: &str = "ddp-store client";
/// Most keys one connection may ask to be counted when it ends.
const MAX_ON_CLOSE: usize = 4;
/// How often the accept loop checks for shutdown (it wakes at once for new connections).
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// The key-value state shared by all connection threads.
#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// The key clients must prove they hold (derived from the job token), if any.
    key: Option<Key>,
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
            .field("key", &self.shared.key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and serves until dropped.
    /// Only clients that prove they hold `token`'s key (when `Some`) are served; the proof is
    /// a challenge-response ([`crate::auth`]): the token never crosses the wire, and the
    /// server proves it holds the key too.
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
            key: token.as_deref().map(Key::from_token),
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

fn serve_connection(stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let authenticated = handshake(stream, peer, shared);
    shared.unauthenticated.fetch_sub(1, Ordering::SeqCst);
    if let Some(stream) = authenticated {
        serve_requests(stream, peer, shared);
    }
}

fn send(stream: &mut TcpStream, reply: &Reply) -> io::Result<()> {
    write_frame(stream, &reply.encode(), MAX_FRAME)
}

/// Reads and checks the client's handshake; the stream of an accepted client, else `None`.
fn handshake(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) -> Option<TcpStream> {
    // The handshake: bounded size and time — one deadline for the whole frame, however the
    // bytes trickle in — since the peer is not trusted yet.
    let _ = stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let frame = match read_frame(&mut ReadBy::new(&stream, deadline), MAX_HANDSHAKE_FRAME) {
        Ok(Some(f)) => f,
        Ok(None) => return None, // connected and closed (a port probe)
        Err(e) => {
            tracing::warn!(%peer, "rendezvous store: refused connection from {peer}: no valid handshake ({e})");
            let _ = send(&mut stream, &Reply::Refused("refused".into()));
            return None;
        }
    };
    let refuse = |stream: &mut TcpStream, why: &str| {
        tracing::warn!(%peer, "rendezvous store: refused connection from {peer}: {why}");
        // The peer is not trusted: it learns nothing but the refusal.
        let _ = send(stream, &Reply::Refused("refused".into()));
        let _ = stream.shutdown(Shutdown::Both);
    };
    let client_nonce = match Request::decode(&frame) {
        Ok(Request::Hello { version, nonce }) if version == VERSION => nonce,
        Ok(Request::Hello { .. }) => {
            refuse(
                &mut stream,
                "protocol version mismatch (another ddp-comm version?)",
            );
            return None;
        }
        _ => {
            refuse(
                &mut stream,
                "malformed handshake (not a ddp-comm store client?)",
            );
            return None;
        }
    };
    if let Some(key) = &shared.key {
        if client_nonce.len() != auth::LEN {
            refuse(&mut stream, "no proof of the job token offered");
            return None;
        }
        let server_nonce = auth::nonce();
        let challenge = Reply::Challenge {
            nonce: server_nonce.to_vec(),
            mac: key
                .prove(SERVER_ROLE, &client_nonce, &server_nonce, b"")
                .to_vec(),
        };
        if send(&mut stream, &challenge).is_err() {
            return None;
        }
        let proven = read_frame(&mut ReadBy::new(&stream, deadline), MAX_HANDSHAKE_FRAME)
            .ok()
            .flatten()
            .and_then(|f| match Request::decode(&f) {
                Ok(Request::Proof { mac }) => Some(mac),
                _ => None,
            })
            .is_some_and(|mac| key.verify(&mac, CLIENT_ROLE, &client_nonce, &server_nonce, b""));
        if !proven {
            refuse(&mut stream, "no valid proof of the job token");
            return None;
        }
    }
    if send(&mut stream, &Reply::Ok).is_err() {
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
    // Counters to add 1 to when this connection ends, however it ends.
    let mut on_close: Vec<String> = Vec::new();
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
        let reply = match Request::decode(&frame) {
            Ok(Request::Hello { .. } | Request::Proof { .. }) | Err(_) => {
                tracing::warn!(%peer, "rendezvous store: malformed request from {peer}; closing");
                let _ = send(&mut stream, &Reply::Error("malformed request".into()));
                break;
            }
            Ok(Request::OnClose { key }) if on_close.len() < MAX_ON_CLOSE => {
                on_close.push(key);
                Reply::Ok
            }
            Ok(Request::OnClose { .. }) => Reply::Error(format!(
                "at most {MAX_ON_CLOSE} keys per connection may be counted at its end"
            )),
            Ok(request) => handle_request(request, shared),
        };
        if send(&mut stream, &reply).is_err() {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
    for key in on_close {
        let _ = handle_request(Request::Add { key, delta: 1 }, shared);
    }
}

fn handle_request(request: Request, shared: &Shared) -> Reply {
    match request {
        Request::Set { key, value } => {
            shared.lock().map.insert(key, value);
            shared.changed.notify_all();
            Reply::Ok
        }
        Request::TryGet { key } => match shared.lock().map.get(&key) {
            Some(v) => Reply::Value(v.clone()),
            None => Reply::Missing,
        },
        Request::Add { key, delta } => {
            let mut st = shared.lock();
            let current = match st.map.get(&key) {
                None => 0,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_le_bytes(b),
                    Err(_) => {
                        return Reply::Error(format!(
                            "key {key:?} holds a {}-byte value, not a counter made by add",
                            v.len()
                        ));
                    }
                },
            };
            let new = current.wrapping_add(delta);
            st.map.insert(key, new.to_le_bytes().to_vec());
            drop(st);
            shared.changed.notify_all();
            Reply::Int(new)
        }
        Request::Get { key, timeout } => {
            match wait_for(shared, std::slice::from_ref(&key), timeout) {
                Ok(st) => Reply::Value(st.map[&key].clone()),
                Err(reply) => reply,
            }
        }
        Request::Wait { keys, timeout } => match wait_for(shared, &keys, timeout) {
            Ok(_) => Reply::Ok,
            Err(reply) => reply,
        },
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let mut st = shared.lock();
            let current = st.map.get(&key);
            if current.map(Vec::as_slice) != expected.as_deref() {
                return match current {
                    Some(v) => Reply::Value(v.clone()),
                    None => Reply::Missing,
                };
            }
            st.map.insert(key, desired);
            drop(st);
            shared.changed.notify_all();
            Reply::Ok
        }
        Request::Hello { .. } | Request::Proof { .. } | Request::OnClose { .. } => {
            Reply::Error("malformed request".into())
        }
    }
}

/// Waits up to `timeout` (at most [`MAX_WAIT`]) until every key in `keys` exists: the state,
/// still locked, once they all do; else the reply to send (a timeout naming a missing key, or
/// the store's shutdown).
fn wait_for<'a>(
    shared: &'a Shared,
    keys: &[String],
    timeout: Duration,
) -> std::result::Result<MutexGuard<'a, State>, Reply> {
    // No request waits forever: `Duration::MAX` and the like are clamped.
    let deadline = Instant::now() + timeout.min(MAX_WAIT);
    let mut st = shared.lock();
    loop {
        if st.shutdown {
            return Err(Reply::Error(
                "the store is shutting down (did rank 0 exit?)".into(),
            ));
        }
        let Some(missing) = keys.iter().find(|k| !st.map.contains_key(k.as_str())) else {
            return Ok(st);
        };
        let now = Instant::now();
        if deadline <= now {
            return Err(Reply::Timeout(missing.clone()));
        }
        st = shared
            .changed
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}
