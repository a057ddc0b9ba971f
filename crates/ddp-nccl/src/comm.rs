//! One NCCL communicator, driven in non-blocking mode so that no call can hang the process.
//!
//! cudarc's safe `Comm` creates communicators with the blocking `ncclCommInitRank` (a missing
//! peer blocks it forever) and panics when `ncclCommAbort` fails on drop. This module uses
//! cudarc's raw bindings instead:
//!
//! - creation with `ncclCommInitRankConfig` and `blocking = 0`, then polling
//!   `ncclCommGetAsyncError` until the state leaves `ncclInProgress` or the deadline passes;
//! - every collective is enqueued, an event is recorded after it, and the host polls the
//!   event and `ncclCommGetAsyncError` (which reports errors from NCCL's proxy threads and from
//!   remote ranks) until the event completes or the deadline passes;
//! - on an error or a timeout the communicator is aborted (`ncclCommAbort`), which also makes
//!   NCCL's kernels still waiting on a dead peer return, so the stream drains.
//!
//! This is the watchdog PyTorch's ProcessGroupNCCL runs on a separate thread; here it runs on
//! the caller's thread, since every call waits for its result anyway.

use std::ffi::c_int;
use std::io;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, DriverError};
use cudarc::nccl::sys::ncclConfig_t;

use super::library::NcclVersion;
use super::rendezvous::ID_BYTES;
use super::result::{self, CommPtr, NcclError, Progress, ncclResult_t};
use ddp_comm::error::{CommError, Result};

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose" for an int field of `ncclConfig_t`.
const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`, the marker `NCCL_CONFIG_INITIALIZER` puts in `ncclConfig_t::magic`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// The header version of the `ncclConfig_t` layout in cudarc's bindings (feature `nccl-02030`).
/// NCCL copies `min(size, its own size)` bytes and uses the version only to ignore fields
/// that older headers did not have, so a newer or older runtime NCCL reads it correctly.
const CONFIG_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 30,
    patch: 0,
};
/// Longest a healthy communicator's teardown may take before it is aborted instead.
const FINALIZE_LIMIT: Duration = Duration::from_secs(30);

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
pub(crate) fn nonblocking_config() -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION.code(),
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// Maps a CUDA driver error to the crate's error type.
pub(crate) fn cuda_error(what: &str, e: DriverError) -> CommError {
    CommError::io(
        format!("CUDA {what}"),
        None,
        io::Error::other(e.to_string()),
    )
}

/// Polls with a growing pause: yield for the first polls (a small collective finishes in
/// microseconds), then sleep from 20 µs up to 1 ms.
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff { polls: 0 }
    }

    pub(crate) fn snooze(&mut self) {
        const YIELDS: u32 = 200;
        if self.polls < YIELDS {
            std::thread::yield_now();
        } else {
            let step = (self.polls - YIELDS).min(6);
            std::thread::sleep(Duration::from_micros(20u64 << step).min(Duration::from_millis(1)));
        }
        self.polls = self.polls.saturating_add(1);
    }
}

/// One look at something the watchdog waits for.
pub(crate) enum Poll {
    /// Finished successfully.
    Ready,
    /// Not finished yet.
    Pending,
    /// Failed; waiting stops with this error.
    Failed(CommError),
}

/// How a [`watch`] ended.
#[derive(Debug)]
pub(crate) enum Waited {
    Ready,
    TimedOut,
    Failed(CommError),
}

/// The watchdog loop: calls `poll` (with [`Backoff`] pauses) until it is ready or fails, or
/// until `deadline` passes. A poll that reports completion wins over an expired deadline.
pub(crate) fn watch(deadline: Instant, mut poll: impl FnMut() -> Poll) -> Waited {
    let mut backoff = Backoff::new();
    loop {
        match poll() {
            Poll::Ready => return Waited::Ready,
            Poll::Failed(e) => return Waited::Failed(e),
            Poll::Pending => {}
        }
        if Instant::now() >= deadline {
            return Waited::TimedOut;
        }
        backoff.snooze();
    }
}

/// Reads a communicator state as a [`Poll`]: `ncclInProgress` is pending, success is ready.
fn state_poll(state: std::result::Result<Progress, NcclError>, what: &str, start: Instant) -> Poll {
    match state {
        Ok(Progress::Done) => Poll::Ready,
        Ok(Progress::InProgress) => Poll::Pending,
        Err(e) => Poll::Failed(e.into_comm(what, start.elapsed())),
    }
}

/// An NCCL communicator handle that is destroyed (or aborted) exactly once.
#[derive(Debug)]
pub(crate) struct RawComm {
    ptr: CommPtr,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls are not
// concurrent; `RawComm` is only reached through `&mut` (it is not `Sync`).
unsafe impl Send for RawComm {}

/// Why communicator creation failed: a timeout (the caller names the missing ranks) or
/// another error.
pub(crate) enum InitFailure {
    TimedOut(Duration),
    Error(CommError),
}

impl RawComm {
    /// Creates this rank's communicator on the CUDA device current on this thread and waits
    /// (polling) until every rank has joined or `deadline` passes; then it aborts.
    pub(crate) fn init(
        id: &[u8; ID_BYTES],
        rank: usize,
        world_size: usize,
        deadline: Instant,
    ) -> std::result::Result<Self, InitFailure> {
        let start = Instant::now();
        let nranks = c_int::try_from(world_size).map_err(|_| {
            InitFailure::Error(CommError::InvalidArgument(format!(
                "world size {world_size} is too large for NCCL"
            )))
        })?;
        let rank = c_int::try_from(rank).map_err(|_| {
            InitFailure::Error(CommError::InvalidArgument(format!(
                "rank {rank} is too large for NCCL"
            )))
        })?;
        let mut config = nonblocking_config();
        // SAFETY: the caller made the communicator's device current; rank < nranks is checked
        // by the caller (NCCL checks it again).
        let (ptr, res) = unsafe { result::comm_init_rank_config(id, nranks, rank, &mut config) };
        let res = match res {
            Ok(_) if ptr.is_null() => Err(NcclError {
                call: "ncclCommInitRankConfig",
                code: ncclResult_t::ncclInternalError,
            }),
            other => other,
        };
        if let Err(e) = res {
            if !ptr.is_null() {
                // SAFETY: a handle NCCL returned; aborted once, never used again.
                let _ = unsafe { result::comm_abort(ptr) };
            }
            return Err(InitFailure::Error(e.into_comm(
                "communicator creation (ncclCommInitRankConfig)",
                start.elapsed(),
            )));
        }
        let mut comm = RawComm {
            ptr,
            aborted: false,
        };
        let waited = watch(deadline, || {
            state_poll(comm.async_state(), "communicator creation", start)
        });
        match waited {
            Waited::Ready => Ok(comm),
            Waited::TimedOut => {
                comm.abort();
                Err(InitFailure::TimedOut(start.elapsed()))
            }
            Waited::Failed(e) => {
                comm.abort();
                Err(InitFailure::Error(e))
            }
        }
    }

    /// The communicator's asynchronous state: `ncclSuccess`, `ncclInProgress` (an operation
    /// is still being set up) or an error raised by NCCL's threads or a remote rank.
    pub(crate) fn async_state(&self) -> std::result::Result<Progress, NcclError> {
        if self.aborted {
            return Err(NcclError {
                call: "ncclCommGetAsyncError",
                code: ncclResult_t::ncclInvalidUsage,
            });
        }
        // SAFETY: a live communicator handle.
        unsafe { result::comm_get_async_error(self.ptr) }
    }

    /// Enqueues one NCCL call on this communicator. When NCCL answers `ncclInProgress`
    /// (non-blocking mode: it is still connecting to peers), polls until the call is enqueued.
    pub(crate) fn enqueue(
        &mut self,
        what: &str,
        deadline: Instant,
        start: Instant,
        call: impl FnOnce(CommPtr) -> std::result::Result<Progress, NcclError>,
    ) -> Result<()> {
        if self.aborted {
            return Err(CommError::Poisoned(format!(
                "NCCL {what}: the communicator was aborted"
            )));
        }
        match call(self.ptr) {
            Ok(Progress::Done) => Ok(()),
            Ok(Progress::InProgress) => {
                match watch(deadline, || state_poll(self.async_state(), what, start)) {
                    Waited::Ready => Ok(()),
                    Waited::Failed(e) => Err(e),
                    Waited::TimedOut => Err(CommError::Timeout {
                        op: format!("NCCL {what} (still connecting to peers)"),
                        peer: None,
                        after: start.elapsed(),
                    }),
                }
            }
            Err(e) => Err(e.into_comm(what, start.elapsed())),
        }
    }

    /// Waits until `event` (recorded after the collective) completes, watching the
    /// communicator's asynchronous errors, until `deadline`.
    pub(crate) fn wait_event(
        &mut self,
        event: &CudaEvent,
        what: &str,
        deadline: Instant,
        start: Instant,
    ) -> Result<()> {
        let waited = watch(deadline, || match event.try_is_complete() {
            Ok(true) => Poll::Ready,
            Err(e) => Poll::Failed(cuda_error(&format!("waiting for {what}"), e)),
            Ok(false) => match state_poll(self.async_state(), what, start) {
                // The communicator is healthy (or still connecting): the event decides.
                Poll::Ready | Poll::Pending => Poll::Pending,
                failed => failed,
            },
        });
        match waited {
            Waited::Ready => Ok(()),
            Waited::Failed(e) => Err(e),
            Waited::TimedOut => Err(CommError::Timeout {
                op: format!(
                    "NCCL {what} (a peer is dead, stalled or called a different collective)"
                ),
                peer: None,
                after: start.elapsed(),
            }),
        }
    }

    /// Aborts the communicator: NCCL stops its kernels and threads and frees it. Idempotent.
    pub(crate) fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        // SAFETY: a live handle, aborted exactly once and never used again.
        if let Err(e) = unsafe { result::comm_abort(self.ptr) } {
            tracing::warn!("{e}");
        }
    }
}

impl Drop for RawComm {
    /// Finalizes and destroys a healthy communicator (`ncclCommFinalize`, poll, then
    /// `ncclCommDestroy`, as NCCL documents for non-blocking communicators); a communicator
    /// whose finalization fails or takes longer than 30 s is aborted instead.
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // SAFETY: a live handle.
        let res = unsafe { result::comm_finalize(self.ptr) };
        let finalized = match res {
            Ok(_) => {
                let start = Instant::now();
                match watch(start + FINALIZE_LIMIT, || {
                    state_poll(self.async_state(), "communicator finalize", start)
                }) {
                    Waited::Ready => true,
                    Waited::TimedOut => {
                        tracing::warn!("NCCL communicator finalize took over {FINALIZE_LIMIT:?}");
                        false
                    }
                    Waited::Failed(e) => {
                        tracing::warn!("NCCL communicator finalize failed: {e}");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!("{e}");
                false
            }
        };
        if finalized {
            self.aborted = true;
            // SAFETY: a finalized handle, destroyed exactly once.
            // ncclCommDestroy of a finalized communicator answers success (never in-progress).
            match unsafe { result::comm_destroy(self.ptr) } {
                Ok(Progress::Done) => {}
                Ok(Progress::InProgress) => {
                    tracing::warn!(
                        "ncclCommDestroy returned {:?}",
                        ncclResult_t::ncclInProgress
                    )
                }
                Err(e) => tracing::warn!("{e}"),
            }
        } else {
            self.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> CommError {
        CommError::InvalidArgument("remote rank gone".into())
    }

    #[test]
    fn watch_returns_ready_once_the_poll_is_ready() {
        let mut polls = 0;
        let w = watch(Instant::now() + Duration::from_secs(60), || {
            polls += 1;
            if polls < 5 {
                Poll::Pending
            } else {
                Poll::Ready
            }
        });
        assert!(matches!(w, Waited::Ready), "{w:?}");
        assert_eq!(polls, 5);
    }

    #[test]
    fn watch_stops_at_the_first_failure() {
        let mut polls = 0;
        let w = watch(Instant::now() + Duration::from_secs(60), || {
            polls += 1;
            if polls < 3 {
                Poll::Pending
            } else {
                Poll::Failed(failure())
            }
        });
        match w {
            Waited::Failed(e) => assert!(e.to_string().contains("remote rank gone")),
            other => panic!("expected the failure, got {other:?}"),
        }
        assert_eq!(polls, 3);
    }

    #[test]
    fn watch_times_out_on_a_poll_that_never_finishes() {
        let deadline = Instant::now() + Duration::from_millis(30);
        let mut polls = 0u32;
        let w = watch(deadline, || {
            polls += 1;
            Poll::Pending
        });
        assert!(matches!(w, Waited::TimedOut), "{w:?}");
        assert!(Instant::now() >= deadline);
        assert!(polls >= 1);
    }

    #[test]
    fn completion_wins_over_an_expired_deadline() {
        let past = Instant::now();
        assert!(matches!(watch(past, || Poll::Ready), Waited::Ready));
        assert!(matches!(watch(past, || Poll::Pending), Waited::TimedOut));
    }

    #[test]
    fn config_is_the_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.version, 23000);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.cgaClusterSize, i32::MIN);
        assert_eq!(c.maxP2pPeers, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }
}
