//! Cargo and other commands run from the tools: a clean `cargo`, and failures as errors.

use std::process::Command;

/// Set for an `xtask` subcommand that CI runs: its cargo builds lint with clippy too (see
/// [`lint_with_clippy`]), so that they reuse what the lint-building steps compiled.
pub const LINT_MARKER: &str = "DDP_CI_LINT";

/// The variables `cargo run` sets for xtask itself. A nested cargo must not see them: build
/// scripts that watch them (ring's watches `CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, …) would rerun
/// and rebuild everything above them (the whole CUDA stack) whenever cargo is run both from here
/// and directly.
const XTASK_ONLY_VARS: [&str; 8] = [
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
];

/// A `cargo` command (the one that runs xtask) with none of xtask's own package variables.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    for var in XTASK_ONLY_VARS {
        cmd.env_remove(var);
    }
    for (var, _) in std::env::vars_os() {
        if var.to_str().is_some_and(|v| v.starts_with("CARGO_PKG_")) {
            cmd.env_remove(var);
        }
    }
    // Under `cargo xtask ci`, build as its steps do (with clippy), to reuse what they built.
    if std::env::var_os(LINT_MARKER).is_some()
        && let Err(e) = lint_with_clippy(&mut cmd)
    {
        eprintln!("xtask: {e}; building without the lints");
    }
    cmd
}

/// Runs `cmd` to its end: an error naming it unless it succeeded.
pub fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

/// What `cargo clippy -- -D warnings` sets for its `cargo check`, set for a build: the
/// workspace's crates compile through `clippy-driver` (rustc with clippy's lints, which also
/// generates code), warnings denied. Dependencies compile with rustc as always.
pub fn lint_with_clippy(cmd: &mut Command) -> Result<(), String> {
    let found = Command::new("clippy-driver")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        return Err(
            "clippy-driver is not on PATH: install clippy (`rustup component add clippy`)".into(),
        );
    }
    cmd.env("RUSTC_WORKSPACE_WRAPPER", "clippy-driver").env(
        "CLIPPY_ARGS",
        "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
    );
    Ok(())
}
