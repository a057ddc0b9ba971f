//! The CUDA glue of burn-ddp, in one module: NCCL on device memory ([`nccl`]), the choice of
//! each rank's device with the CUDA toolkit files its kernels need, and [`DeviceComm`], the
//! communicator through which gradient sync and SyncBatchNorm reach device memory.
//!
//! The module is compiled in every build. Without the `cuda` feature, [`DeviceComm`] is a type
//! with no values, so `Option<DeviceComm>` is always `None`. The code that uses it (the
//! gradient synchroniser's device path, SyncBatchNorm's NCCL exchange) compiles and is
//! type-checked in every build, and needs no `cfg(feature = "cuda")` of its own: the
//! feature's switches are here and on the public items that exist only with it.

#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(all(test, feature = "cuda"))]
mod smoke;

#[cfg(feature = "cuda")]
mod enabled;
#[cfg(feature = "cuda")]
pub(crate) use enabled::{DeviceChoice, DeviceComm, ENABLED, NcclSetting};

#[cfg(not(feature = "cuda"))]
mod disabled;
#[cfg(not(feature = "cuda"))]
pub(crate) use disabled::{DeviceChoice, DeviceComm, ENABLED, NcclSetting};
