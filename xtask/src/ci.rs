//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.
//!
//! Every build step uses one profile (`dev`: optimised dependencies without debug info) and
//! one target directory. The tests use one feature set ([`FEATURES`]); the CUDA steps use a
//! superset of it ([`CUDA_FEATURES`]), so Cargo rebuilds only the crates whose features change
//! (Burn's umbrella crates, cubecl-cuda and its LLVM) and links the CUDA binaries — train-cnn,
//! the CUDA test binaries and the rank programs they launch — that `cargo xtask gpu-check
//! build` packs for a GPU machine. A link error fails CI. Burn's CUDA backend builds against
//! the LLVM bundle its build script downloads, or, without internet, against the system LLVM
//! that `cargo xtask setup-cuda-build` points it at. The last step, `cargo xtask ptx-check`,
//! runs those CUDA binaries under the CUDA driver stand-in, so every kernel's PTX is assembled
//! by ptxas; it builds only the stand-in (seconds) and needs ptxas and libdevice from pip
//! (`.ci/run` installs them).
//!
//! **Clippy in the build.** The test and CUDA steps compile the workspace's crates through
//! `clippy-driver` ([`lint_with_clippy`]: what `cargo clippy -- -D warnings` does, as Cargo's
//! workspace wrapper), so every target they build — libraries, their unit tests, binaries,
//! examples, integration tests, the CUDA variants — is linted with warnings denied while it is
//! compiled. A separate `cargo clippy` step would check every dependency (Burn, CubeCL, wgpu)
//! a second time, in check mode: 17 minutes of a cold run here (measured 2026-12-01: 64 min in all
//! with the lints in the build; with the two clippy steps, 50 min had gone before the CUDA build).
//!
//! Disk: a cold run peaks at about 6.6 GB of target directory. The bins have no test-harness
//! builds (`test = false`), the CUDA step links only the test binaries with CUDA tests, and on
//! a nearly full disk what the earlier steps left (the test executables that have run) is
//! deleted before the CUDA step (a CI run once died of a full disk in the CUDA link).

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

/// Set for an `xtask` subcommand that CI runs: its cargo builds lint with clippy too (see
/// [`lint_with_clippy`]), so that they reuse what the lint-building steps compiled.
pub const LINT_MARKER: &str = "DDP_CI_LINT";

/// How a step lints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lint {
    /// Nothing to lint (formatting).
    No,
    /// A cargo build: its workspace crates compile through clippy-driver.
    Build,
    /// An `xtask` subcommand: its own cargo builds do ([`LINT_MARKER`]).
    Subcommand,
}

/// One CI step: a description and the cargo arguments.
struct Step {
    what: &'static str,
    args: Vec<&'static str>,
    /// Make room first if the disk is nearly full (see [`make_room`]).
    needs_room: bool,
    lint: Lint,
}

fn steps() -> Vec<Step> {
    let step = |what, parts: &[&[&'static str]]| Step {
        what,
        args: parts.concat(),
        needs_room: false,
        lint: Lint::Build,
    };
    vec![
        Step {
            lint: Lint::No,
            ..step("formatting", &[&["fmt", "--all", "--", "--check"]])
        },
        step(
            "clippy (every target built, warnings denied) and the tests (unit, multi-process integration, doc)",
            &[&["test", "--workspace", "--features", FEATURES]],
        ),
        Step {
            needs_room: true,
            ..step(
                "CUDA binaries linted (warnings denied), built and linked; their no-GPU tests",
                &[
                    &["test"],
                    &CUDA_PACKAGES,
                    &CUDA_TARGETS,
                    &["--features", CUDA_FEATURES, "--"],
                    &CUDA_NO_GPU_TESTS,
                ],
            )
        },
        // The CUDA binaries just linked, under the driver stand-in: every kernel's PTX
        // assembled by ptxas for sm_90a (the stand-in itself builds in seconds).
        Step {
            lint: Lint::Subcommand,
            ..step(
                "the CUDA path down to the PTX (cargo xtask ptx-check)",
                &[&["xtask", "ptx-check"]],
            )
        },
    ]
}

/// What `cargo clippy -- -D warnings` sets for its `cargo check`, set for a build: the
/// workspace's crates compile through `clippy-driver` (rustc with clippy's lints, which also
/// generates code), warnings denied. Dependencies compile with rustc as always.
pub fn lint_with_clippy(cmd: &mut std::process::Command) -> Result<(), String> {
    let found = std::process::Command::new("clippy-driver")
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

/// Free space below which [`make_room`] deletes what earlier steps left. A cold `cargo xtask
/// ci` peaked at 6.6 GB of disk (measured): about 2.4 GB after the clippy steps, 4.9 GB after
/// the tests, the CUDA step adding 1.7 GB.
const LOW_DISK_BYTES: u64 = 4 << 30;

/// Before the test and CUDA steps, on a nearly full disk: deletes what the earlier steps left
/// in `target/debug/deps` and the next step does not need, so that a link does not die of a
/// full disk (a CI run once did). That is clippy's metadata (a `.rmeta` without its `.rlib`)
/// and the test executables (`NAME-HASH`, the bulk: they have run and passed). A later run
/// redoes them.
fn make_room(root: &Path) {
    let deps = crate::target_dir(root).join("debug").join("deps");
    let Some(free) = free_bytes(&deps) else {
        return;
    };
    if free >= LOW_DISK_BYTES {
        return;
    }
    let (files, bytes) = remove_used_artifacts(&deps);
    eprintln!(
        "==> low on disk ({:.1} GiB free): removed {files} test executables and check-only \
         metadata files of the earlier steps ({:.1} GiB)",
        free as f64 / (1u64 << 30) as f64,
        bytes as f64 / (1u64 << 30) as f64
    );
}

/// Deletes from `deps` the executables without an extension (test harnesses, binaries) and
/// the `.rmeta` files without an `.rlib` of the same name (from `cargo check`/`clippy`); keeps
/// libraries, proc macros and everything else. Returns how many files and their bytes.
fn remove_used_artifacts(deps: &Path) -> (usize, u64) {
    use std::os::unix::fs::PermissionsExt;
    let (mut files, mut bytes) = (0, 0u64);
    for entry in std::fs::read_dir(deps).into_iter().flatten().flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        let executable = meta.is_file() && meta.permissions().mode() & 0o111 != 0;
        let used = match path.extension().and_then(|e| e.to_str()) {
            None => executable,
            Some("rmeta") => !path.with_extension("rlib").exists(),
            Some(_) => false,
        };
        if used && std::fs::remove_file(&path).is_ok() {
            files += 1;
            bytes += meta.len();
        }
    }
    (files, bytes)
}

/// Bytes free for an unprivileged user on the file system of `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path; statvfs fills the zeroed struct we pass.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
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
        if s.needs_room {
            make_room(root);
        }
        let t = Instant::now();
        eprintln!(
            "==> [{}/{}] {}: cargo {}",
            i + 1,
            steps().len(),
            s.what,
            s.args.join(" ")
        );
        let mut cmd = crate::cargo();
        cmd.args(&s.args).current_dir(root);
        match s.lint {
            Lint::No => {}
            Lint::Build => lint_with_clippy(&mut cmd)?,
            Lint::Subcommand => {
                cmd.env(LINT_MARKER, "1");
            }
        }
        let status = cmd
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_test_executables_and_check_only_metadata_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, b"12345").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        let removed = [
            file("sync_batch_norm-0123abcd", 0o755),
            file("libburn_nn-4567cdef.rmeta", 0o644),
        ];
        let kept = [
            file("libburn-0123abcd.rlib", 0o644),
            file("libburn-0123abcd.rmeta", 0o644),
            file("libserde_derive-0123abcd.so", 0o755),
            file("train_cnn-0123abcd.d", 0o644),
            file("not_executable-0123abcd", 0o644),
        ];
        assert_eq!(remove_used_artifacts(dir.path()), (2, 10));
        assert!(removed.iter().all(|p| !p.exists()));
        assert!(kept.iter().all(|p| p.exists()));
        assert!(free_bytes(dir.path()).is_some_and(|b| b > 0));
    }
}
