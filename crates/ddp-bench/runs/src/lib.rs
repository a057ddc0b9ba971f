//! The orchestration of the benchmarks behind `cargo xtask bench …`: each builds its rank
//! program of `ddp-bench` in release, launches it (alone, or through `ddprun` on N ranks,
//! transports and emulated nodes) and prints its tables. No Burn dependency: the rank programs
//! hold the Burn code.
//!
//! - [`allreduce`]: `bench allreduce`;
//! - [`ddp`]: `bench ddp`;
//! - [`zero`]: `bench zero`, the sharded optimizer against the unsharded one;
//! - [`resnet`]: `bench resnet`, ResNet-18 steps beside PyTorch's ([`torch`] finds or installs
//!   PyTorch);
//! - [`recovery`]: `bench recovery`, a lost rank's cost under live recovery against a restart;
//! - [`program`]: the one-process benchmarks (`bench syncbn`, `bench data`, `bench handshake`).

pub mod allreduce;
pub mod ddp;
pub mod program;
pub mod recovery;
pub mod resnet;
pub mod torch;
pub mod zero;

use std::path::PathBuf;

use cargo_tasks::{cargo, run, target_dir, workspace_root};

/// Builds `ddprun` and ddp-bench's `bin` in release (`no_burn`: without ddp-bench's Burn
/// feature) and returns the folder that holds both.
///
/// # Errors
/// A failed build.
pub(crate) fn build_with_ddprun(bin: &str, no_burn: bool) -> Result<PathBuf, String> {
    let root = workspace_root();
    let mut cmd = cargo();
    cmd.current_dir(&root)
        .args(["build", "--release", "-p", "ddp-bench", "--bin", bin]);
    if no_burn {
        cmd.arg("--no-default-features");
    }
    run(cmd.args(["-p", "ddprun", "--bin", "ddprun"]))?;
    Ok(target_dir(&root).join("release"))
}

/// Checks every name of `--transport` (`shm` or `tcp`).
///
/// # Errors
/// The first unknown name.
pub(crate) fn check_transports(transports: &[String]) -> Result<(), String> {
    match transports.iter().find(|t| *t != "shm" && *t != "tcp") {
        Some(t) => Err(format!("unknown transport {t:?} (shm or tcp)")),
        None => Ok(()),
    }
}
