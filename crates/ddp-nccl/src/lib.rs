//! Collectives on NVIDIA GPU memory through NCCL, for the process groups of `ddp-comm`, and the
//! CUDA toolkit files Burn's CUDA backend needs at run time, found without a toolkit install.
//!
//! - [`cuda_toolkit`]: libdevice and the toolkit roots (pip's wheels, `CUDA_PATH`, …).
//! - [`nvrtc_files`]: NVRTC and the CUDA headers its second compiler (`cpp`, NVRTC) needs.
//!
//! # NCCL
//!
//! [`NcclGroup`] is one NCCL communicator per rank process, on the CUDA device `LOCAL_RANK`
//! (or [`NcclOptions::device`]). It runs all-reduce (sum, mean, max, min), broadcast,
//! all-gather and barrier on device buffers — cudarc's [`CudaSlice`], [`CudaView`] /
//! [`CudaViewMut`], or raw device pointers for memory owned by another library — and offers
//! host-slice helpers that stage through the device.
//!
//! - **Rendezvous**: rank 0 asks NCCL for a unique id and publishes it in the job's
//!   rendezvous store ([`ddp_comm::store`]); the other ranks read it ([`rendezvous`]).
//! - **No hangs**: communicators are created in NCCL's non-blocking mode and every call polls
//!   for completion with the group's timeout while watching NCCL's asynchronous errors
//!   (`ncclCommGetAsyncError`). A dead or stalled peer therefore gives a
//!   [`CommError::Timeout`] (or NCCL's remote error) instead of a hang; the communicator is
//!   then aborted (`ncclCommAbort`) and the group is broken: later calls return
//!   [`CommError::Poisoned`]. Errors map to the same [`CommError`] the TCP transport uses.
//! - **No panics on machines without CUDA**: cudarc loads `libcuda`/`libnccl` at run time
//!   and panics when they are missing, so every constructor first calls [`check_libraries`]
//!   and returns `libcuda not found …` / `libnccl not found …` errors. See [`library`] for
//!   where the libraries are searched (and the `libnccl.so` link that pip's NCCL needs).
//!
//! Every rank must call the collectives in the same order with matching lengths, as with the
//! TCP [`ddp_comm::ProcessGroup`].
//!
//! Layers, as in cudarc (`sys` → `result` → safe): [`result`] is the only module that calls
//! NCCL's C functions, one result-returning function each, with a typed [`NcclError`]; the
//! private `comm` module drives one non-blocking communicator under the watchdog; `group` is
//! the safe [`NcclGroup`]. NCCL errors keep their code: [`CommError::Nccl`].
//!
//! ```no_run
//! use std::time::Duration;
//! use ddp_comm::{LaunchEnv, ProcessGroup, GroupOptions, ReduceOp};
//! use ddp_nccl::{NcclGroup, NcclOptions};
//! # fn main() -> Result<(), ddp_comm::CommError> {
//! let env = LaunchEnv::from_env()?;
//! // The TCP group serves the rendezvous store on rank 0; NCCL shares its id through it.
//! let _pg = ProcessGroup::init(&env, GroupOptions::default())?;
//! let mut nccl = NcclGroup::connect(&env, &NcclOptions::default())?;
//!
//! let stream = nccl.stream().clone();
//! let mut grads = stream.clone_htod(&vec![1.0f32; 1 << 20]).unwrap();
//! nccl.all_reduce(&mut grads, ReduceOp::Mean)?;
//!
//! let mut host = vec![env.rank as f64; 4];
//! nccl.all_reduce_host(&mut host, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod comm;
pub mod cuda_toolkit;
mod device;
mod element;
mod group;
pub mod library;
pub mod nvrtc_files;
mod options;
pub mod rendezvous;
pub mod result;

/// The cudarc this transport is built on, so callers allocate buffers with the same version.
pub use cudarc;
pub use cudarc::driver::{CudaView, CudaViewMut};
pub use device::{check_cuda_device, cuda_device_for_local_rank, visible_cuda_devices};
pub use element::NcclElement;
pub use group::NcclGroup;
pub use group::collectives::{DeviceBuffer, DeviceElement};
pub use library::{Libraries, MIN_NCCL_VERSION, NcclVersion, check_libraries};
pub use options::{NcclOptions, TIMEOUT_VAR};
pub use result::NcclError;

#[cfg(doc)]
use cudarc::driver::CudaSlice;
#[cfg(doc)]
use ddp_comm::CommError;
