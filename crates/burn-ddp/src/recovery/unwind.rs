//! A lost peer inside Burn's forward or backward, where an error can only panic: SyncBatchNorm's
//! exchange. Inside [`catching`] (what `Ddp::catch_lost_peer` runs) such an error unwinds to it
//! as a payload of its own (with `std::panic::resume_unwind`, which runs no panic hook: nothing
//! is printed) and comes back as the error it was; outside it, or for any other error, the layer
//! panics as before. Imports nothing of the crate: SyncBatchNorm's error module uses it.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use ddp_comm::CommError;

thread_local! {
    /// How many [`catching`] calls this thread is inside.
    static CATCHING: Cell<usize> = const { Cell::new(0) };
}

/// The unwind payload of a lost peer.
struct LostPeer(CommError);

/// Whether a collective's error is a lost peer's doing (a connection closed, an I/O error or a
/// timeout on a link, or a group an earlier such error broke; on NCCL, a remote rank's failure
/// or a failed connection: `ncclRemoteError`, `ncclSystemError`).
pub(crate) fn comm_lost_a_peer(e: &CommError) -> bool {
    match e {
        CommError::PeerClosed { .. }
        | CommError::Io { .. }
        | CommError::Timeout { .. }
        | CommError::Poisoned(_) => true,
        CommError::Nccl { name, .. } => name == "ncclRemoteError" || name == "ncclSystemError",
        _ => false,
    }
}

/// Where a collective's error can only panic: unwinds to the enclosing [`catching`] when there
/// is one and `error` is a lost peer's; otherwise returns it, for the caller to panic with.
pub(crate) fn unwind_if_caught(error: CommError) -> CommError {
    if CATCHING.get() > 0 && comm_lost_a_peer(&error) {
        resume_unwind(Box::new(LostPeer(error)));
    }
    error
}

/// Runs `f`; a lost peer that [`unwind_if_caught`] unwound inside it is returned as `Err`. Any
/// other panic goes on unwinding.
pub(crate) fn catching<T>(f: impl FnOnce() -> T) -> Result<T, CommError> {
    struct Inside;
    impl Drop for Inside {
        fn drop(&mut self) {
            CATCHING.set(CATCHING.get() - 1);
        }
    }
    CATCHING.set(CATCHING.get() + 1);
    let inside = Inside;
    let result = catch_unwind(AssertUnwindSafe(f));
    drop(inside);
    result.map_err(|payload| match payload.downcast::<LostPeer>() {
        Ok(lost) => lost.0,
        Err(other) => resume_unwind(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_peer_is_a_broken_link_a_timeout_or_nccl_s_remote_failure() {
        let nccl = |name: &str| CommError::Nccl {
            op: "all_reduce".into(),
            code: 6,
            name: name.into(),
            detail: String::new(),
        };
        for lost in [
            CommError::PeerClosed {
                peer: 2,
                op: "all_reduce".into(),
            },
            CommError::Timeout {
                op: "all_reduce".into(),
                peer: Some(2),
                after: std::time::Duration::from_secs(1),
            },
            CommError::Poisoned("earlier".into()),
            nccl("ncclRemoteError"),
            nccl("ncclSystemError"),
        ] {
            assert!(comm_lost_a_peer(&lost), "{lost}");
        }
        for other in [
            CommError::Mismatch("lengths".into()),
            CommError::InvalidArgument("root".into()),
            nccl("ncclUnhandledCudaError"),
            nccl("ncclInternalError"),
        ] {
            assert!(!comm_lost_a_peer(&other), "{other}");
        }
    }
}
