//! The CUDA tools behind `cargo xtask`, in a crate of their own with their dependencies (the
//! bundle's compression, the toolkit lookup):
//!
//! - [`cuda_build`]: `setup-cuda-build`, Burn's CUDA backend built against a system LLVM when
//!   the bundle cubecl-llvm downloads cannot be fetched.
//! - [`ptx_check`]: `ptx-check`, CI's CUDA binaries run under the CUDA driver stand-in
//!   (`tools/cuda-standin`), so every kernel's PTX is assembled by ptxas. It proves
//!   compilation only.
//! - [`gpu_check`]: `gpu-check build` (here: the bundle) and `gpu-check run` (on a machine with
//!   an NVIDIA GPU: the CUDA rows and a report).

pub mod cuda_build;
pub mod gpu_check;
pub mod ptx_check;
