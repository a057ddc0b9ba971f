//! The benchmarks that run as one process (`syncbn_bench`, `data_bench`, `handshake_bench`).

use std::process::Command;

use cargo_tasks::{cargo, run, target_dir, workspace_root};

/// Builds `build_args` in release and runs `binary` (relative to `target/release`) with
/// `extra`.
///
/// # Errors
/// A failed build or run.
pub fn run_program(build_args: &[&str], binary: &str, extra: &[String]) -> Result<(), String> {
    let root = workspace_root();
    run(cargo()
        .current_dir(&root)
        .args(["build", "--release"])
        .args(build_args))?;
    run(Command::new(target_dir(&root).join("release").join(binary))
        .current_dir(&root)
        .args(extra))
}
