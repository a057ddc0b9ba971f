//! The cargo command lines of CI's one build, shared by `cargo xtask ci`, `ptx-check` and
//! `gpu-check build` so that each names the same build (see xtask's `ci` module for why there
//! is one).

/// The one feature set of every build CI makes: the CubeCL kernels on wgpu (lavapipe) and on
/// CUDA, Burn's CUDA backend in burn-ddp, the rank programs and train-cnn, and the NCCL
/// transport (cudarc, loaded at run time). See the module's documentation for why it is one.
pub const FEATURES: &str = "ddp-tests/wgpu,ddp-tests/cuda,ddp-tests/cpu,train-cnn/wgpu,train-cnn/cuda,train-cnn/cpu,ddp-bench/wgpu,ddp-bench/cpu";

/// The targets with CUDA code that `cargo xtask gpu-check` runs on a GPU and `cargo xtask
/// ptx-check` under the stand-in: burn-ddp's unit tests, the CUDA test binaries and, through
/// them, the rank programs and train-cnn; the NCCL transport's tests.
pub const CUDA_TARGETS: [&str; 9] = [
    "--lib",
    "--test",
    "sync_batch_norm",
    "--test",
    "ddp",
    "--test",
    "multi_rank",
    "--test",
    "nccl",
];

/// The cargo command that names the CUDA executables: CI's build ([`FEATURES`], the whole
/// workspace, so that the features resolve as in the test step) limited to [`CUDA_TARGETS`].
/// After `cargo xtask ci` it compiles nothing.
pub const CUDA_BUILD_ARGS: &[&[&str]] = &[
    &["test", "--no-run", "--workspace"],
    &CUDA_TARGETS,
    &["--features", FEATURES],
];

/// [`CUDA_BUILD_ARGS`] with the CUDA kernels compiled by cubecl-cuda's CUDA C++ backend
/// through NVRTC (burn-ddp's `cuda-nvrtc`) instead of LLVM: `cargo xtask gpu-check build
/// --nvrtc`, the fallback bundle. Never CI's: the feature flips every binary the command
/// builds, and only the crates above cubecl-cuda compile again.
pub const CUDA_NVRTC_BUILD_ARGS: &[&[&str]] = &[
    &["test", "--no-run", "--workspace"],
    &CUDA_TARGETS,
    &["--features", FEATURES],
    &["--features", "burn-ddp/cuda-nvrtc"],
];

/// Burn's default device for the tests: `Device::default()` (and what Burn makes on it, such as
/// the optimizer state a record loads) picks CUDA first in a build with the `cuda` feature and
/// panics where there is no driver; `BURN_DEVICE=wgpu` keeps the device of a build without
/// CUDA (lavapipe here), as the tests had it before the CUDA code joined their build. Devices
/// chosen explicitly (`--backend cuda`, `Device::cuda`) are unaffected.
pub const BURN_DEFAULT_DEVICE: (&str, &str) = ("BURN_DEVICE", "wgpu");
