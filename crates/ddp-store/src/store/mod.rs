//! The rendezvous key-value store (the part c10d's TCPStore plays in PyTorch).
//!
//! Rank 0 serves it at `MASTER_ADDR:MASTER_PORT` ([`StoreServer`]); every rank (rank 0 too)
//! talks to it through a [`StoreClient`]. Keys map to byte values; `get` and `wait` block until
//! the key appears or the timeout passes; `add` is an atomic counter; `compare_set` replaces a
//! value only if it is still the one the caller read (how the launchers' rendezvous changes its
//! one state key); and a connection can ask for a counter to be added to when it ends,
//! however it ends ([`StoreClient::add_on_close`]: how a killed launcher is seen at once);
//! `set_once` publishes a value no one can replace. A connection must prove it holds the
//! job's key first (a password-authenticated key exchange: the token never crosses the wire);
//! with per-rank keys ([`StoreServer::bind_per_rank`]) it proves the rank it is, and may change
//! only that rank's entries ([`keys::owner`]), within its share of the store and of its
//! connections ([`MAX_CONNECTIONS_PER_RANK`]); others are
//! refused, and counted in a rate-limited summary. Sizes, keys, waits and connections are
//! bounded (see the server's limits), so that even a client holding the key cannot exhaust
//! the host. The process group's generation only moves forward, by one
//! ([`keys::forward_only`]); and a source whose key exchanges fail waits its turn for the
//! next, so that guessing the token on line gets a few tries a second.
//!
//! Code that uses the store goes through the [`Store`] trait, and names its keys inside a
//! [`PrefixStore`], so that every user has a namespace of its own: the process group's
//! rendezvous under `ddp/pg`, NCCL's under `NcclOptions::store_prefix` (`nccl` by default).
//! The keys themselves are built in one place, the [`keys`] module.
//!
//! # Protocol
//!
//! Frames over TCP (`TCP_NODELAY`) in the crate's one codec (a little-endian `u32` length, then
//! that many bytes): each carries one request or one reply, a tag byte and its fields. The
//! first frame of every connection is a handshake carrying a magic, a protocol version, the
//! rank the client claims (with per-rank keys) and its SPAKE2 message; the server answers with
//! its own message and its confirmation of the session key, the client with its confirmation,
//! and the server with `Ok` or a refusal (that says only "refused"). Waiting requests
//! (`get`, `wait`) carry their timeout and are answered by the server when the keys appear (it
//! waits on a condition variable) or when the timeout passes, so clients never poll.
//!
//! ```
//! use std::time::Duration;
//! use ddp_store::store::{PrefixStore, Store, StoreClient, StoreServer};
//! # fn main() -> Result<(), ddp_store::CommError> {
//! let server = StoreServer::bind("127.0.0.1:0", Some("secret".into()))?;
//! let endpoint = server.local_addr().to_string();
//! let mut a = StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(5))?;
//! let mut b = StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(5))?;
//! a.set("addr/0", b"10.0.0.1:4000")?;
//! assert_eq!(b.get("addr/0", Duration::from_secs(1))?, b"10.0.0.1:4000");
//! assert_eq!(a.add("arrived", 1)?, 1);
//! assert_eq!(b.add("arrived", 1)?, 2);
//! // A namespace: its keys are `job/…` in the store.
//! PrefixStore::new(&mut a, "job").set("step", b"7")?;
//! assert_eq!(b.get("job/step", Duration::from_secs(1))?, b"7");
//! # Ok(()) }
//! ```

mod client;
pub mod keys;
mod message;
mod server;
mod table;
mod throttle;

use std::time::Duration;

pub use client::{Credential, StoreClient};
pub use server::{MAX_CONNECTIONS_PER_RANK, StoreServer};

use crate::error::Result;

/// Largest frame either side accepts: a value at its limit (1 MiB) with its key, or a wait
/// for one key per rank of a very large job.
const MAX_FRAME: usize = 2 << 20;
/// Default deadline for a reply to a request that does not wait for keys.
const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The operations of a rendezvous store: what the process group and NCCL's rendezvous need.
///
/// [`StoreClient`] is the store; [`PrefixStore`] is a namespace inside another store.
pub trait Store {
    /// Sets `key` to `value` (overwrites; an error for a key set by [`Store::set_once`]).
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()>;
    /// Sets `key` to `value` if it does not exist, and makes it unchangeable: later `set`,
    /// `add` and `compare_set` of it fail. When it exists already, leaves it and returns
    /// what it holds ([`CompareSet::Current`]). How a rank publishes what no other process
    /// may replace (its address and identity, NCCL's unique id).
    fn set_once(&mut self, key: &str, value: &[u8]) -> Result<CompareSet>;
    /// Waits up to `timeout` for `key` to exist and returns its value.
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Returns the value of `key` if it exists now, without waiting.
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Atomically adds `delta` to the counter at `key` (missing = 0); returns the new value.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64>;
    /// Waits up to `timeout` until all `keys` exist.
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Atomically sets `key` to `desired` if its value is `expected` now (`None`: if `key`
    /// does not exist); otherwise leaves it and returns what it holds.
    fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CompareSet>;
}

/// The answer to [`Store::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareSet {
    /// The key held the expected value (or was absent, as expected) and now holds the new one.
    Swapped,
    /// The key held something else, left as it is: this (`None`: it does not exist).
    Current(Option<Vec<u8>>),
}

impl<S: Store + ?Sized> Store for &mut S {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn set_once(&mut self, key: &str, value: &[u8]) -> Result<CompareSet> {
        (**self).set_once(key, value)
    }
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        (**self).try_get(key)
    }
    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait(keys, timeout)
    }
    fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CompareSet> {
        (**self).compare_set(key, expected, desired)
    }
}

/// A namespace inside another store: key `k` is `{prefix}/k` there.
///
/// Errors name the full key, as the store sees it.
#[derive(Debug)]
pub struct PrefixStore<'a, S: Store + ?Sized> {
    store: &'a mut S,
    prefix: String,
}

impl<'a, S: Store + ?Sized> PrefixStore<'a, S> {
    /// The namespace `prefix` inside `store` (an empty prefix adds nothing).
    pub fn new(store: &'a mut S, prefix: impl Into<String>) -> Self {
        PrefixStore {
            store,
            prefix: prefix.into(),
        }
    }

    /// The prefix of this namespace.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The full key of `key` in the underlying store.
    pub fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }

    /// A namespace `sub` inside this one (`{prefix}/{sub}/…`).
    pub fn scope(&mut self, sub: &str) -> PrefixStore<'_, S> {
        let prefix = self.key(sub);
        PrefixStore {
            store: &mut *self.store,
            prefix,
        }
    }
}

impl<S: Store + ?Sized> Store for PrefixStore<'_, S> {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        self.store.set(&key, value)
    }
    fn set_once(&mut self, key: &str, value: &[u8]) -> Result<CompareSet> {
        let key = self.key(key);
        self.store.set_once(&key, value)
    }
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let key = self.key(key);
        self.store.get(&key, timeout)
    }
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(key);
        self.store.try_get(&key)
    }
    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let key = self.key(key);
        self.store.add(&key, delta)
    }
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.store.wait(&refs, timeout)
    }
    fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CompareSet> {
        let key = self.key(key);
        self.store.compare_set(&key, expected, desired)
    }
}

#[cfg(test)]
mod tests;
