//! **TEST ONLY — a CUDA driver stand-in for machines without a GPU. It proves compilation only:
//! no kernel runs under it, and every number a program computes under it is meaningless.**
//!
//! Built as `libcuda_standin.so` and loaded *as* `libcuda.so` (a folder on `LD_LIBRARY_PATH`
//! with a link of that name; `cargo xtask ptx-check` makes one), it implements the driver API
//! calls that cudarc and cubecl-cuda make, so that Burn's CUDA backend goes through a whole
//! training step on a CPU machine:
//!
//! - the device is an **H200** as the driver reports one (sm 9.0, 132 SMs, 227 KiB of shared
//!   memory per block opt-in, 64 Ki registers per block, driver version of CUDA 13.0: see
//!   [`device`]);
//! - "device" memory is host memory (anonymous mappings), so copies are `memcpy`s;
//! - **`cuModuleLoadData` hands every PTX module to `ptxas`** for `sm_90a` (see [`ptxas`]) and
//!   fails the load with `CUDA_ERROR_INVALID_PTX` when ptxas refuses it, as the driver's JIT
//!   would;
//! - **`cuLaunchKernel` checks the launch** against the device's limits — block and grid
//!   dimensions, static plus dynamic shared memory against the function's opt-in, registers
//!   (from `ptxas -v`) times threads — and refuses it as the driver would (see [`launch`]),
//!   then **runs nothing**: outputs keep whatever the memory held (zeros when fresh).
//!
//! Every module and every refused launch is recorded, one line each, in the file named by
//! `CUDA_STANDIN_LOG` (see [`record`]); `cargo xtask ptx-check` reads it and prints how many
//! kernels LLVM compiled and ptxas assembled. The first `cuInit` of a process prints one line on
//! stderr saying that this is a stand-in, so no output produced under it can pass for a GPU's.
//!
//! | variable | meaning |
//! | --- | --- |
//! | `CUDA_STANDIN_PTXAS` | the `ptxas` to run (default: `ptxas` on `PATH`) |
//! | `CUDA_STANDIN_LOG` | the record file (appended to; unset: no record) |
//! | `CUDA_STANDIN_DEVICES` | how many H200s to report (default 1) |

pub mod device;
pub mod driver;
pub mod launch;
pub mod ptxas;
pub mod record;
