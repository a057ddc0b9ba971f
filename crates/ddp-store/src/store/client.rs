//! The store's client: connects with retries and backoff, presents the job token, and sends
//! one request at a time with a deadline on its reply.

use std::fmt;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::message::{Reply, Request, VERSION};
use super::server::{CLIENT_ROLE, SERVER_ROLE, exchange_context};
use super::{CompareSet, DEFAULT_IO_TIMEOUT, MAX_FRAME, Store};
use crate::auth::{Exchange, Key, Side};
use crate::error::{CommError, Result};
use crate::wire::{read_frame, write_frame};

/// First and largest pause between connection attempts.
const CONNECT_BACKOFF_START: Duration = Duration::from_millis(2);
const CONNECT_BACKOFF_CAP: Duration = Duration::from_millis(50);
/// The least pause after the store refused a client that proved the key (at one of its
/// connection limits): room is made when a connection ends, not within milliseconds.
const REFUSED_BACKOFF: Duration = Duration::from_millis(100);
/// How often a rank still connecting to the store says so.
const CONNECT_PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What a client proves to the store: a key, and the rank it is when ranks hold keys of
/// their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    key: Key,
    rank: Option<u32>,
}

impl Credential {
    /// The key every process of the job holds (`DDP_JOB_TOKEN` under torchrun or srun, a
    /// launcher's token).
    pub fn job(token: &str) -> Credential {
        Credential {
            key: Key::from_token(token),
            rank: None,
        }
    }

    /// Rank `rank`'s own key, for a store served with
    /// [`StoreServer::bind_per_rank`](super::StoreServer::bind_per_rank).
    pub fn rank(key: Key, rank: u32) -> Credential {
        Credential {
            key,
            rank: Some(rank),
        }
    }
}

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

/// What a failed read of the handshake's reply means, in words: a passed deadline says
/// which one.
fn handshake_failure(e: &io::Error, wait: Duration) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "no answer to the handshake within {:.1} s (the connect deadline)",
            wait.as_secs_f64()
        ),
        _ => format!("during the handshake: {e}"),
    }
}

/// Why one connection attempt failed.
enum AttemptError {
    /// Worth retrying until the deadline (refused, reset, …).
    Retry(String),
    /// The store refused a client that proved the key, at one of its limits (its connections
    /// in all, or one rank's): retried until the deadline, a little less often.
    Busy(String),
    /// Final (the server refused the token).
    Fatal(CommError),
}

impl StoreClient {
    /// Connects to `endpoint` (`host:port`), retrying until `timeout` passes (the server may
    /// not be up yet), and presents `token`.
    ///
    /// Retries start after 2 ms and back off to 50 ms, so a client that starts before the
    /// server connects within milliseconds of the server coming up. A store that closes the
    /// connection during the handshake (it cut it for newer ones, or kept it waiting for its
    /// turn too long) or that refuses a client holding the key at one of its connection limits
    /// is tried again too, so a transient refusal never fails a rank. When `timeout` passes
    /// the error is [`CommError::Timeout`] naming the endpoint and the last refusal; a refused
    /// token is [`CommError::Store`] at once.
    pub fn connect(endpoint: &str, token: Option<&str>, timeout: Duration) -> Result<Self> {
        Self::connect_with(endpoint, token.map(Credential::job).as_ref(), timeout)
    }

    /// As [`Self::connect`], proving `credential` (a job's key, or one rank's).
    pub fn connect_with(
        endpoint: &str,
        credential: Option<&Credential>,
        timeout: Duration,
    ) -> Result<Self> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = CONNECT_BACKOFF_START;
        let mut last_err = String::new();
        let mut attempts = 0u32;
        let mut next_progress = start + CONNECT_PROGRESS_EVERY;
        loop {
            attempts += 1;
            match Self::attempt(endpoint, credential, deadline) {
                Ok(client) => {
                    tracing::debug!(endpoint, attempts, elapsed = ?start.elapsed(), "connected to the rendezvous store");
                    return Ok(client);
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Busy(msg)) => {
                    last_err = msg;
                    backoff = backoff.max(REFUSED_BACKOFF);
                }
                // An attempt started at the deadline tries no address; keep the one before.
                Err(AttemptError::Retry(msg)) if msg.is_empty() && !last_err.is_empty() => {}
                Err(AttemptError::Retry(msg)) if msg.is_empty() => {
                    last_err = "no attempt finished before the deadline".into();
                }
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
        credential: Option<&Credential>,
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
            let rank = credential.and_then(|c| c.rank);
            let mut exchange = credential
                .map(|c| Exchange::start(Side::Client, &c.key, &exchange_context(c.rank)));
            let hello = Request::Hello {
                version: VERSION,
                rank,
                exchange: exchange
                    .as_ref()
                    .map(|(_, ours)| ours.clone())
                    .unwrap_or_default(),
            };
            let keyed = exchange.is_some();
            // The handshake's replies must come before the overall deadline (at least 1 s, so
            // a loaded server on a short deadline is not mistaken for a dead one).
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            let _ = stream.set_read_timeout(Some(wait));
            let _ = stream.set_write_timeout(Some(wait));
            if let Err(e) = write_frame(&mut stream, &hello.encode(), MAX_FRAME) {
                last = format!("{addr}: sending the handshake: {e}");
                continue;
            }
            let fatal = |msg: String| {
                AttemptError::Fatal(CommError::Store {
                    addr: endpoint.to_string(),
                    msg,
                })
            };
            let refused = || {
                fatal(format!(
                    "the store refused this connection: is the job token ({}) the same on every rank and launcher?",
                    crate::env::TOKEN_VAR
                ))
            };
            let mut reply = match read_frame(&mut stream, MAX_FRAME) {
                Ok(Some(reply)) => Reply::decode(&reply),
                Ok(None) => {
                    last = format!("{addr}: closed during the handshake");
                    continue;
                }
                Err(e) => {
                    last = format!("{addr}: {}", handshake_failure(&e, wait));
                    continue;
                }
            };
            let challenged = matches!(reply, Ok(Reply::Challenge { .. }));
            if let (
                Ok(Reply::Challenge {
                    exchange: theirs,
                    mac,
                }),
                Some((ours, _)),
            ) = (&reply, exchange.take())
            {
                let session = ours
                    .finish(theirs)
                    .filter(|s| s.verify(mac, SERVER_ROLE, &[]));
                let Some(session) = session else {
                    return Err(fatal(format!(
                        "the server at {addr} could not prove it holds this job's token ({}){}: another job's store, or a port squatter; nothing sent",
                        crate::env::TOKEN_VAR,
                        rank.map(|r| format!(" or rank {r}'s key"))
                            .unwrap_or_default()
                    )));
                };
                let proof = Request::Proof {
                    mac: session.confirm(CLIENT_ROLE, &[]).to_vec(),
                };
                if let Err(e) = write_frame(&mut stream, &proof.encode(), MAX_FRAME) {
                    last = format!("{addr}: sending the handshake's proof: {e}");
                    continue;
                }
                reply = match read_frame(&mut stream, MAX_FRAME) {
                    Ok(Some(reply)) => Reply::decode(&reply),
                    // The server proved the key, so it refuses no proof of ours: closed to
                    // make room for newer handshakes, or stopping. Tried again.
                    Ok(None) => {
                        last = format!("{addr}: closed after the handshake's proof");
                        continue;
                    }
                    Err(e) => {
                        last = format!("{addr}: {}", handshake_failure(&e, wait));
                        continue;
                    }
                };
                if let Ok(Reply::Challenge { .. }) = reply {
                    return Err(fatal(
                        "unexpected handshake reply (is this a ddp-comm store?)".into(),
                    ));
                }
            }
            return match reply {
                Ok(Reply::Ok) if keyed && !challenged => Err(fatal(format!(
                    "the server at {addr} did not prove it holds this job's token ({}): a store started without one, or a port squatter; nothing sent",
                    crate::env::TOKEN_VAR
                ))),
                Ok(Reply::Ok) => Ok(StoreClient {
                    stream,
                    endpoint: endpoint.to_string(),
                    io_timeout: DEFAULT_IO_TIMEOUT,
                    broken: None,
                }),
                Ok(Reply::Challenge { .. }) => Err(fatal(format!(
                    "the store requires the job token: set {}",
                    crate::env::TOKEN_VAR
                ))),
                // A client that proved the key may hear why (one of the store's connection
                // limits): room is made as connections end, so it tries again.
                Ok(Reply::Refused(why)) if why != "refused" => {
                    Err(AttemptError::Busy(format!("{addr}: {why}")))
                }
                Ok(Reply::Refused(_)) => Err(refused()),
                _ => Err(fatal(
                    "unexpected handshake reply (is this a ddp-comm store?)".into(),
                )),
            };
        }
        Err(AttemptError::Retry(last))
    }

    /// The endpoint this client connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// This end's address of the connection: the address this host reaches the store from
    /// (one the store's host can reach back, as a rule).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.stream.local_addr()
    }

    /// Whether the connection still works: `false` after an I/O error (a key that did not
    /// appear in time is not one), when every later request fails at once.
    pub fn is_usable(&self) -> bool {
        self.broken.is_none()
    }

    /// Sets the deadline for replies to requests (added to the timeout of `get`/`wait`).
    pub fn set_io_timeout(&mut self, timeout: Duration) {
        self.io_timeout = timeout;
    }

    /// Sends one request and reads its reply within `reply_within`.
    ///
    /// An I/O error breaks the connection (every later request fails at once); a reply that
    /// does not parse is an error of this request only.
    fn request(&mut self, request: &Request, what: &str, reply_within: Duration) -> Result<Reply> {
        if let Some(why) = &self.broken {
            return Err(CommError::Store {
                addr: self.endpoint.clone(),
                msg: format!("connection unusable after an earlier error: {why}"),
            });
        }
        let result = self.request_inner(&request.encode(), what, reply_within);
        if let Err(e) = &result {
            self.broken = Some(e.to_string());
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        Reply::decode(&result?).map_err(|_| self.store_error(format!("{what}: malformed reply")))
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
        if let Err(e) = write_frame(&mut self.stream, payload, MAX_FRAME) {
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

    fn store_error(&self, msg: String) -> CommError {
        CommError::Store {
            addr: self.endpoint.clone(),
            msg,
        }
    }

    fn unexpected(&self, what: &str, reply: Reply) -> CommError {
        self.store_error(match reply {
            Reply::Error(m) => format!("{what}: {m}"),
            other => format!("{what}: unexpected reply ({})", other.name()),
        })
    }

    /// Sets `key` to `value` (overwrites).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let what = format!("setting key {key:?}");
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Sets `key` to `value` if it does not exist and makes it unchangeable; else leaves it
    /// and returns what it holds (see [`Store::set_once`]).
    pub fn set_once(&mut self, key: &str, value: &[u8]) -> Result<CompareSet> {
        let what = format!("setting key {key:?} once");
        let req = Request::SetOnce {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Ok => Ok(CompareSet::Swapped),
            Reply::Value(v) => Ok(CompareSet::Current(Some(v))),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Waits up to `timeout` for `key` to exist and returns its value.
    ///
    /// The wait happens on the server; on timeout the error is [`CommError::Timeout`] naming
    /// the key.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let what = format!("waiting for key {key:?}");
        let req = Request::Get {
            key: key.to_string(),
            timeout,
        };
        match self.request(&req, &what, timeout.saturating_add(self.io_timeout))? {
            Reply::Value(v) => Ok(v),
            Reply::Timeout(_) => Err(CommError::Timeout {
                op: format!("{what} at rendezvous store {}", self.endpoint),
                peer: None,
                after: timeout,
            }),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Returns the value of `key` if it exists now, without waiting.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let what = format!("reading key {key:?}");
        let req = Request::TryGet {
            key: key.to_string(),
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Value(v) => Ok(Some(v)),
            Reply::Missing => Ok(None),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Atomically adds `delta` to the integer counter at `key` (missing = 0); returns the new value.
    ///
    /// The counter is stored as 8 little-endian bytes, so `get` on it returns those bytes.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let what = format!("adding to key {key:?}");
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Int(v) => Ok(v),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Waits up to `timeout` until all `keys` exist.
    ///
    /// On timeout the error is [`CommError::Timeout`] naming a key that is still missing.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let what = format!("waiting for {} key(s)", keys.len());
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout,
        };
        match self.request(&req, &what, timeout.saturating_add(self.io_timeout))? {
            Reply::Ok => Ok(()),
            Reply::Timeout(missing) => Err(CommError::Timeout {
                op: format!(
                    "waiting for key {missing:?} at rendezvous store {}",
                    self.endpoint
                ),
                peer: None,
                after: timeout,
            }),
            other => Err(self.unexpected(&what, other)),
        }
    }
}

impl StoreClient {
    /// Sets `key` to `desired` if it holds `expected` now (`None`: if it does not exist), in
    /// one step on the server; otherwise returns what it holds.
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CompareSet> {
        let what = format!("compare-and-set of key {key:?}");
        let req = Request::CompareSet {
            key: key.to_string(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Ok => Ok(CompareSet::Swapped),
            Reply::Value(v) => Ok(CompareSet::Current(Some(v))),
            Reply::Missing => Ok(CompareSet::Current(None)),
            other => Err(self.unexpected(&what, other)),
        }
    }

    /// Asks the server to add 1 to the counter at `key` when this connection ends, however
    /// it ends (closed, reset, this process killed): how the other side learns at once that
    /// this one is gone. At most a few keys per connection.
    pub fn add_on_close(&mut self, key: &str) -> Result<()> {
        let what = format!("registering key {key:?} for the connection's end");
        let req = Request::OnClose {
            key: key.to_string(),
        };
        match self.request(&req, &what, self.io_timeout)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&what, other)),
        }
    }
}

impl Store for StoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        StoreClient::set(self, key, value)
    }
    fn set_once(&mut self, key: &str, value: &[u8]) -> Result<CompareSet> {
        StoreClient::set_once(self, key, value)
    }
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        StoreClient::get(self, key, timeout)
    }
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        StoreClient::try_get(self, key)
    }
    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        StoreClient::add(self, key, delta)
    }
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        StoreClient::wait(self, keys, timeout)
    }
    fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CompareSet> {
        StoreClient::compare_set(self, key, expected, desired)
    }
}
