//! The result layer over NCCL's C API (cudarc's `sys` → `result` → safe layering): one
//! function per NCCL function this crate calls, each returning a [`Result`] with a typed
//! [`NcclError`] instead of a raw `ncclResult_t`. Nothing above this module calls
//! `cudarc::nccl::sys` functions.
//!
//! Communicators here are non-blocking, so `ncclInProgress` is not an error: calls that may
//! answer it return `Progress`.

use std::ffi::{c_int, c_void};
use std::time::Duration;

use cudarc::nccl::sys::{self, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

pub use cudarc::nccl::sys::ncclResult_t;
pub(crate) use cudarc::nccl::sys::{cudaStream_t as StreamPtr, ncclComm_t as CommPtr};

use super::rendezvous::ID_BYTES;
use ddp_comm::error::CommError;

/// A call to NCCL that returned an error code.
///
/// It converts into [`CommError`] (`?` works in functions returning the crate's `Result`):
/// see [`CommError::Nccl`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error("{call} returned {code:?}")]
pub struct NcclError {
    /// The NCCL function (`ncclAllReduce`, …).
    pub call: &'static str,
    /// Its result code.
    pub code: ncclResult_t,
}

impl NcclError {
    /// NCCL's description of the code and its last error text (`ncclGetLastError`).
    pub fn detail(&self) -> String {
        let (desc, last) = (error_string(self.code), last_error());
        if last.is_empty() {
            desc
        } else {
            format!("{desc}; {last}")
        }
    }

    /// The crate's error for this failure during `what`, `after` that long.
    ///
    /// Invalid arguments/usage → [`CommError::InvalidArgument`]; NCCL's own timeout →
    /// [`CommError::Timeout`]; everything else (a remote rank's failure, system, internal and
    /// CUDA errors) → [`CommError::Nccl`] with the code. The message carries NCCL's
    /// description and its last error text.
    pub(crate) fn into_comm(self, what: &str, after: Duration) -> CommError {
        let detail = self.detail();
        let code = self.code;
        match code {
            ncclResult_t::ncclInvalidArgument | ncclResult_t::ncclInvalidUsage => {
                CommError::InvalidArgument(format!("NCCL {what}: {code:?} ({detail})"))
            }
            ncclResult_t::ncclTimeout => CommError::Timeout {
                op: format!("NCCL {what} ({detail})"),
                peer: None,
                after,
            },
            _ => CommError::Nccl {
                op: what.to_string(),
                code: code as u32,
                name: format!("{code:?}"),
                detail: if code == ncclResult_t::ncclRemoteError {
                    format!("a remote rank failed or exited ({detail})")
                } else {
                    detail
                },
            },
        }
    }
}

impl From<NcclError> for CommError {
    fn from(e: NcclError) -> Self {
        e.into_comm(e.call, Duration::ZERO)
    }
}

/// A call that did not fail: done, or still running in the background (non-blocking mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Done,
    InProgress,
}

/// NCCL's result code as a [`Result`].
pub(crate) fn check(call: &'static str, code: ncclResult_t) -> Result<Progress, NcclError> {
    match code {
        ncclResult_t::ncclSuccess => Ok(Progress::Done),
        ncclResult_t::ncclInProgress => Ok(Progress::InProgress),
        code => Err(NcclError { call, code }),
    }
}

/// `ncclGetErrorString`.
pub(crate) fn error_string(code: ncclResult_t) -> String {
    // SAFETY: returns a pointer to a static string; the library is loaded (we hold a code).
    unsafe { c_string(sys::ncclGetErrorString(code)) }
}

/// `ncclGetLastError` (the communicator argument is unused by NCCL; NULL is accepted).
pub(crate) fn last_error() -> String {
    // SAFETY: returns a pointer to a thread-local string.
    unsafe { c_string(sys::ncclGetLastError(std::ptr::null_mut())) }
}

/// `ncclGetVersion`.
///
/// # Safety
/// libnccl must be loadable (cudarc's loader panics otherwise): check
/// [`super::library::nccl_present`] first.
pub(crate) unsafe fn get_version() -> Result<c_int, NcclError> {
    let mut code: c_int = 0;
    // SAFETY: per the contract the library is present; writes one int.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut code) })?;
    Ok(code)
}

/// `ncclGetUniqueId` (also starts NCCL's bootstrap listener on this rank).
pub(crate) fn get_unique_id() -> Result<[u8; ID_BYTES], NcclError> {
    let mut id = ncclUniqueId {
        internal: [0; ID_BYTES],
    };
    // SAFETY: a valid out-pointer.
    check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
    Ok(id.internal.map(|c| c as u8))
}

/// `ncclCommInitRankConfig`: the handle NCCL returned (possibly NULL) and the call's result.
///
/// # Safety
/// The CUDA device of the new communicator must be current on this thread.
pub(crate) unsafe fn comm_init_rank_config(
    id: &[u8; ID_BYTES],
    nranks: c_int,
    rank: c_int,
    config: &mut ncclConfig_t,
) -> (CommPtr, Result<Progress, NcclError>) {
    let uid = ncclUniqueId {
        internal: id.map(|b| b as std::ffi::c_char),
    };
    let mut ptr: CommPtr = std::ptr::null_mut();
    // SAFETY: `ptr` and `config` are valid for the call; NCCL copies the config before
    // returning.
    let res = unsafe { sys::ncclCommInitRankConfig(&mut ptr, nranks, uid, rank, config) };
    (ptr, check("ncclCommInitRankConfig", res))
}

/// `ncclCommGetAsyncError`: the communicator's state (`Done`, `InProgress`, or the error
/// raised by NCCL's threads or a remote rank).
///
/// # Safety
/// `comm` must be a live communicator.
pub(crate) unsafe fn comm_get_async_error(comm: CommPtr) -> Result<Progress, NcclError> {
    let mut state = ncclResult_t::ncclSuccess;
    // SAFETY: a live handle and a valid out-pointer.
    check("ncclCommGetAsyncError", unsafe {
        sys::ncclCommGetAsyncError(comm, &mut state)
    })?;
    check("ncclCommGetAsyncError", state)
}

/// `ncclCommAbort`.
///
/// # Safety
/// `comm` must be a live communicator; it must not be used afterwards.
pub(crate) unsafe fn comm_abort(comm: CommPtr) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclCommAbort", unsafe { sys::ncclCommAbort(comm) })
}

/// `ncclCommFinalize`.
///
/// # Safety
/// `comm` must be a live communicator.
pub(crate) unsafe fn comm_finalize(comm: CommPtr) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclCommFinalize", unsafe { sys::ncclCommFinalize(comm) })
}

/// `ncclCommDestroy`.
///
/// # Safety
/// `comm` must be a finalized communicator; it must not be used afterwards.
pub(crate) unsafe fn comm_destroy(comm: CommPtr) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclCommDestroy", unsafe { sys::ncclCommDestroy(comm) })
}

/// `ncclAllReduce` (in place when `send == recv`).
///
/// # Safety
/// `send` and `recv` must address `count` elements of `dtype` in device memory of `comm`'s
/// device, valid until the reduction has run on `stream`.
pub(crate) unsafe fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: CommPtr,
    stream: StreamPtr,
) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclAllReduce", unsafe {
        sys::ncclAllReduce(send, recv, count, dtype, op, comm, stream)
    })
}

/// `ncclReduce` to `root` (in place when `send == recv`; `recv` is used on `root` only).
///
/// # Safety
/// As for [`all_reduce`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: CommPtr,
    stream: StreamPtr,
) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclReduce", unsafe {
        sys::ncclReduce(send, recv, count, dtype, op, root, comm, stream)
    })
}

/// `ncclBroadcast` (in place when `send == recv`).
///
/// # Safety
/// As for [`all_reduce`].
pub(crate) unsafe fn broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: ncclDataType_t,
    root: c_int,
    comm: CommPtr,
    stream: StreamPtr,
) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclBroadcast", unsafe {
        sys::ncclBroadcast(send, recv, count, dtype, root, comm, stream)
    })
}

/// `ncclAllGather`: `send` holds `count` elements, `recv` `count * nranks`.
///
/// # Safety
/// As for [`all_reduce`], with those lengths.
pub(crate) unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: ncclDataType_t,
    comm: CommPtr,
    stream: StreamPtr,
) -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclAllGather", unsafe {
        sys::ncclAllGather(send, recv, count, dtype, comm, stream)
    })
}

/// `ncclGroupStart`.
pub(crate) fn group_start() -> Result<Progress, NcclError> {
    // SAFETY: no arguments; only changes this thread's grouping state.
    check("ncclGroupStart", unsafe { sys::ncclGroupStart() })
}

/// `ncclGroupEnd`.
///
/// # Safety
/// The calls enqueued since [`group_start`] must still satisfy their own contracts.
pub(crate) unsafe fn group_end() -> Result<Progress, NcclError> {
    // SAFETY: per the contract.
    check("ncclGroupEnd", unsafe { sys::ncclGroupEnd() })
}

/// Converts a C string returned by NCCL into an owned string (empty for NULL).
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string that stays valid during the call.
pub(crate) unsafe fn c_string(ptr: *const std::ffi::c_char) -> String {
    if ptr.is_null() {
        String::new()
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ffi::CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_progress_or_a_typed_error() {
        assert_eq!(check("x", ncclResult_t::ncclSuccess), Ok(Progress::Done));
        assert_eq!(
            check("x", ncclResult_t::ncclInProgress),
            Ok(Progress::InProgress)
        );
        let e = check("ncclAllReduce", ncclResult_t::ncclRemoteError).unwrap_err();
        assert_eq!(e.code, ncclResult_t::ncclRemoteError);
        assert_eq!(e.call, "ncclAllReduce");
    }
}
