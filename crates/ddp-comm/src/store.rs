//! The rendezvous key-value store (the part c10d's TCPStore plays in PyTorch).
//!
//! Rank 0 serves it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 too) talks to it through a
//! [`StoreClient`]. Keys map to byte values; `get` and `wait` block until the key appears or the
//! timeout passes; `add` is an atomic counter. A connection must present the job token first;
//! connections without it are refused and logged.
//!
//! API CONTRACT (implementation pending — owner: store/launcher helper).

use std::time::Duration;

use crate::error::Result;

/// Serves the store on a background thread until dropped.
pub struct StoreServer {
    _private: (),
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and serves until dropped.
    /// Only clients presenting `token` (when `Some`) are served.
    pub fn bind(addr: &str, token: Option<String>) -> Result<Self> {
        let _ = (addr, token);
        unimplemented!("store server")
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::net::SocketAddr {
        unimplemented!("store server")
    }
}

/// A connection to the store.
pub struct StoreClient {
    _private: (),
}

impl StoreClient {
    /// Connects to `endpoint` (`host:port`), retrying until `timeout` passes (the server may
    /// not be up yet), and presents `token`.
    pub fn connect(endpoint: &str, token: Option<&str>, timeout: Duration) -> Result<Self> {
        let _ = (endpoint, token, timeout);
        unimplemented!("store client")
    }

    /// Sets `key` to `value` (overwrites).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let _ = (key, value);
        unimplemented!("store client")
    }

    /// Waits up to `timeout` for `key` to exist and returns its value.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let _ = (key, timeout);
        unimplemented!("store client")
    }

    /// Returns the value of `key` if it exists now, without waiting.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let _ = key;
        unimplemented!("store client")
    }

    /// Atomically adds `delta` to the integer counter at `key` (missing = 0); returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let _ = (key, delta);
        unimplemented!("store client")
    }

    /// Waits up to `timeout` until all `keys` exist.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let _ = (keys, timeout);
        unimplemented!("store client")
    }
}
