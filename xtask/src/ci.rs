//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.
//!
//! Every build step uses one profile (`dev`: optimised dependencies without debug info) and
//! one target directory. The tests use one feature set ([`FEATURES`]); the CUDA steps use a
//! superset of it ([`CUDA_FEATURES`]), so Cargo rebuilds only the crates whose features change
//! (Burn's umbrella crates, cubecl-cuda and its LLVM) and links the CUDA binaries — train-cnn,
//! the CUDA test binaries and the rank programs they launch — that `cargo xtask gpu-check
//! build` packs for a GPU machine. A link error fails CI. Burn's CUDA backend builds against
//! the LLVM bundle its build script downloads, or, without internet, against the system LLVM
//! that `cargo xtask setup-cuda-build` points it at.

use std::path::Path;
use std::time::Instant;

/// The features of clippy and the tests: the CubeCL kernels on wgpu (lavapipe) and the NCCL
/// transport (cudarc, loaded at run time).
pub const FEATURES: &str = "ddp-tests/wgpu,ddp-bench/wgpu,ddp-comm/nccl";

/// [`FEATURES`] plus Burn's CUDA backend in burn-ddp, the rank programs and train-cnn.
pub const CUDA_FEATURES: &str = "ddp-tests/wgpu,ddp-tests/cuda,train-cnn/wgpu,train-cnn/cuda";

/// The packages built with [`CUDA_FEATURES`].
pub const CUDA_PACKAGES: [&str; 6] = ["-p", "burn-ddp", "-p", "ddp-tests", "-p", "train-cnn"];

/// The targets of the CUDA build: the test binaries with CUDA tests (`gpu-check` runs them) and,
/// through them, the rank programs and train-cnn. The other test binaries run in the CPU step;
/// linking their CUDA twins too would only fill the disk.
pub const CUDA_TARGETS: [&str; 7] = [
    "--lib",
    "--test",
    "sync_batch_norm",
    "--test",
    "ddp",
    "--test",
    "multi_rank",
];

/// The tests of the CUDA build that need no GPU (they check the errors a machine without a
/// usable GPU gives); the others are `#[ignore]`d and run under `cargo xtask gpu-check`.
pub const CUDA_NO_GPU_TESTS: [&str; 2] = ["without_a_usable_gpu", "without_a_cuda_driver"];

/// One CI step: a description and the cargo arguments.
struct Step {
    what: &'static str,
    args: Vec<&'static str>,
}

fn steps() -> Vec<Step> {
    let step = |what, parts: &[&[&'static str]]| Step {
        what,
        args: parts.concat(),
    };
    vec![
        step("formatting", &[&["fmt", "--all", "--", "--check"]]),
        step(
            "clippy (all targets, warnings denied)",
            &[&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--features",
                FEATURES,
                "--",
                "-D",
                "warnings",
            ]],
        ),
        step(
            "clippy of the CUDA build (all targets, warnings denied)",
            &[
                &["clippy"],
                &CUDA_PACKAGES,
                &[
                    "--all-targets",
                    "--features",
                    CUDA_FEATURES,
                    "--",
                    "-D",
                    "warnings",
                ],
            ],
        ),
        step(
            "tests (unit, multi-process integration, doc)",
            &[&["test", "--workspace", "--features", FEATURES]],
        ),
        step(
            "CUDA binaries built and linked; their no-GPU tests",
            &[
                &["test"],
                &CUDA_PACKAGES,
                &CUDA_TARGETS,
                &["--features", CUDA_FEATURES, "--"],
                &CUDA_NO_GPU_TESTS,
            ],
        ),
    ]
}

/// Runs every step; stops at the first failure.
pub fn run(root: &Path) -> Result<(), String> {
    let all = Instant::now();
    if let Err(e) = crate::cuda_build::check(root) {
        eprintln!(
            "==> note: {e}; the CUDA steps will download LLVM (without internet, run \
             `cargo xtask setup-cuda-build` first)"
        );
    }
    for (i, s) in steps().iter().enumerate() {
        let t = Instant::now();
        eprintln!(
            "==> [{}/{}] {}: cargo {}",
            i + 1,
            steps().len(),
            s.what,
            s.args.join(" ")
        );
        let status = crate::cargo()
            .args(&s.args)
            .current_dir(root)
            .status()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        if !status.success() {
            return Err(format!("{} failed ({status})", s.what));
        }
        eprintln!("==> {} passed in {:.0?}", s.what, t.elapsed());
    }
    eprintln!("==> CI passed in {:.0?}", all.elapsed());
    Ok(())
}
