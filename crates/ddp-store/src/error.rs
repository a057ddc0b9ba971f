//! The one error type every communication call returns.

use std::time::Duration;

use crate::env::EnvError;

/// Result alias for communication calls.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// An error from the launch environment, the rendezvous store or a collective.
///
/// Every variant that involves another process names its rank, so the message printed on a
/// surviving rank says which peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The launch environment is missing or malformed.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// A blocking wait ran past its deadline.
    #[error("timed out after {after:.1?} during {op}{}", peer_suffix(*peer))]
    Timeout {
        /// What was being waited for (an operation or a store key).
        op: String,
        /// The rank waited on, when one is known.
        peer: Option<usize>,
        /// How long the wait lasted.
        after: Duration,
    },
    /// A peer closed its connection (it exited, crashed or was killed).
    #[error("rank {peer} closed its connection during {op} (did it exit or crash?)")]
    PeerClosed {
        /// The rank whose connection closed.
        peer: usize,
        /// The operation in progress.
        op: String,
    },
    /// An I/O error on a connection or shared-memory segment.
    #[error("I/O error during {op}{}: {source}", peer_suffix(*peer))]
    Io {
        /// The operation in progress.
        op: String,
        /// The peer on the other side, when one is known.
        peer: Option<usize>,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The rendezvous store refused a request or answered something unexpected.
    #[error("rendezvous store at {addr}: {msg}")]
    Store {
        /// The store's address.
        addr: String,
        /// What went wrong.
        msg: String,
    },
    /// The job cannot be authenticated as configured: ranks on several hosts without
    /// `DDP_JOB_TOKEN` (and without the explicit opt-out), or no private place for the
    /// secret of a single-host job. The message says what to set.
    #[error("{0}")]
    Unauthenticated(String),
    /// Ranks called collectives that do not match (different operation, length or type).
    #[error("ranks disagree: {0}")]
    Mismatch(String),
    /// The caller passed an argument that cannot work (a root rank out of range, …).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An NCCL call failed (the `ddp-nccl` crate) with a code other than the ones that map to
    /// [`CommError::InvalidArgument`] (`ncclInvalidArgument`, `ncclInvalidUsage`) or
    /// [`CommError::Timeout`] (`ncclTimeout`): a remote rank's failure (`ncclRemoteError`), a
    /// system, internal or CUDA error.
    #[error("NCCL {op}: {name} (code {code}): {detail}")]
    Nccl {
        /// The operation in progress.
        op: String,
        /// NCCL's result code (`ncclResult_t` as an integer).
        code: u32,
        /// The code's name (`ncclRemoteError`, …).
        name: String,
        /// NCCL's description of the code and its last error text.
        detail: String,
    },
    /// An earlier error broke this process group; it cannot be used any more.
    #[error("the process group is broken by an earlier error: {0}")]
    Poisoned(String),
}

fn peer_suffix(peer: Option<usize>) -> String {
    match peer {
        Some(p) => format!(" waiting for rank {p}"),
        None => String::new(),
    }
}

impl CommError {
    /// Builds an [`CommError::Io`] for `op` with an optional peer.
    pub fn io(op: impl Into<String>, peer: Option<usize>, source: std::io::Error) -> Self {
        CommError::Io {
            op: op.into(),
            peer,
            source,
        }
    }

    /// The rank this error blames, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            CommError::Timeout { peer, .. } | CommError::Io { peer, .. } => *peer,
            CommError::PeerClosed { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}
