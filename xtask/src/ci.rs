//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.
//!
//! One feature set is used for every step (`ddp-tests/wgpu`, `ddp-comm/nccl`) so Cargo builds
//! the Burn stack once for checking and once for testing. The NCCL transport is checked and
//! tested through `ddp-comm/nccl`. Burn's CUDA backend cannot be built without downloading
//! LLVM, so burn-ddp's CUDA path (NCCL on device memory, CubeCL kernels on CUDA) is
//! type-checked and linted with `DOCS_RS=1`, which skips that download.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// The features every CI step uses.
pub const FEATURES: &str = "ddp-tests/wgpu,ddp-comm/nccl";

/// One CI step: a description and the cargo arguments.
struct Step {
    what: &'static str,
    args: Vec<&'static str>,
    env: Vec<(&'static str, &'static str)>,
}

fn steps() -> Vec<Step> {
    let step = |what, args: &[&'static str]| Step {
        what,
        args: args.to_vec(),
        env: Vec::new(),
    };
    vec![
        step("formatting", &["fmt", "--all", "--", "--check"]),
        step(
            "clippy (all targets, warnings denied)",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--features",
                FEATURES,
                "--",
                "-D",
                "warnings",
            ],
        ),
        Step {
            what: "burn-ddp CUDA path and CUDA tests type-check and clippy (DOCS_RS=1)",
            args: vec![
                "clippy",
                "-p",
                "burn-ddp",
                "-p",
                "ddp-tests",
                "--features",
                "burn-ddp/cuda,ddp-tests/cuda",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
            env: vec![("DOCS_RS", "1")],
        },
        step(
            "tests (unit, multi-process integration, doc)",
            &["test", "--workspace", "--features", FEATURES],
        ),
    ]
}

/// Runs every step; stops at the first failure.
pub fn run(root: &Path) -> Result<(), String> {
    let all = Instant::now();
    for (i, s) in steps().iter().enumerate() {
        let t = Instant::now();
        eprintln!(
            "==> [{}/{}] {}: cargo {}",
            i + 1,
            steps().len(),
            s.what,
            s.args.join(" ")
        );
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(&s.args)
            .envs(s.env.iter().copied())
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
