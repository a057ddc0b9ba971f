//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.
//!
//! **One build.** Every build step uses one profile (`dev`: optimised dependencies without
//! debug info), one target directory and one feature set, [`FEATURES`]: the CubeCL kernels on
//! wgpu (lavapipe), Burn's CUDA backend and the NCCL transport, all at once. Cargo's features
//! are unified over the packages of a command, and a dependency whose features differ between
//! two commands is a different build — and so is everything above it: with a CPU feature set
//! for the tests and a CUDA one for the CUDA binaries, a cold run compiled Burn's and CubeCL's
//! whole stack twice (measured 2026-12-02: 38 min for the tests' build and run, then 25 min
//! for the CUDA build, 22 of them the stack again). So the test step builds the CUDA binaries
//! too — train-cnn, the CUDA test binaries and the rank programs they launch — and runs their
//! no-GPU tests with the others (the GPU-only tests are `#[ignore]`d); `cargo xtask ptx-check`
//! and `cargo xtask gpu-check build` run the same cargo command ([`cargo_tasks::CUDA_BUILD_ARGS`]), which
//! after CI only names the executables. A link error fails CI. Burn's CUDA backend builds
//! against the LLVM bundle its build script downloads, or, without internet, against the
//! system LLVM that `cargo xtask setup-cuda-build` points it at. The last step, `cargo xtask
//! ptx-check`, runs the CUDA binaries under the CUDA driver stand-in, so every kernel's PTX is
//! assembled by ptxas; it builds only the stand-in (seconds) and needs ptxas and libdevice from
//! pip (`.ci/run` installs them).
//!
//! **Clippy in the build.** The build step compiles the workspace's crates through
//! `clippy-driver` ([`cargo_tasks::lint_with_clippy`]: what `cargo clippy -- -D warnings` does, as Cargo's
//! workspace wrapper), so every target it builds — libraries, their unit tests, binaries,
//! examples, integration tests, the CUDA code — is linted with warnings denied while it is
//! compiled. A separate `cargo clippy` step would check every dependency (Burn, CubeCL, wgpu)
//! a second time, in check mode: 17 minutes of a cold run here.
//!
//! **Beside the tests.** The libraries' no-GPU lint (a check of Burn's stack without GPU
//! features: minutes cold) runs in a target directory of its own, at the lowest CPU priority,
//! while the tests run: they keep about one of the two cores busy (163 CPU seconds in 170 s,
//! measured 2026-12-05), so the lint takes the other one instead of minutes of its own. Its
//! output is printed when the documentation step, which reads its metadata, waits for it.
//!
//! **The launcher installed.** `cargo install --path crates/ddprun`, the README's install line,
//! runs into `ci-install` in the target directory and its `ddprun --version` is checked; it reuses the release
//! dependencies of `cargo xtask`'s own build.
//!
//! Disk: the bins have no test-harness builds (`test = false`), and on a nearly full disk
//! what an earlier run left (test executables, check-only metadata) is deleted before the
//! build (a CI run once died of a full disk in a link).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use cargo_tasks::{BURN_DEFAULT_DEVICE, FEATURES, LINT_MARKER, lint_with_clippy};

/// The publishable crates, as cargo's package arguments.
const PUBLISHED: &[&str] = &[
    "-p",
    "ddp-store",
    "-p",
    "ddp-trace",
    "-p",
    "ddp-doctor",
    "-p",
    "ddp-comm",
    "-p",
    "ddp-nccl",
    "-p",
    "burn-ddp-data",
    "-p",
    "burn-ddp-batchnorm",
    "-p",
    "burn-ddp-checkpoint",
    "-p",
    "burn-ddp",
    "-p",
    "ddprun",
];

/// rustdoc's warnings as errors, for the documentation step.
const RUSTDOC_DENY_WARNINGS: (&str, &str) = ("RUSTDOCFLAGS", "-D warnings");

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

/// When a step runs next to the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timing {
    /// After the step before it has ended.
    InTurn,
    /// Started, and left running beside the steps after it at the lowest CPU priority, its
    /// output kept in a log; a [`Timing::AfterBackground`] step waits for it first.
    Background,
    /// Waits for the background step (and fails if it failed), then runs.
    AfterBackground,
}

/// A check of a step's result, given the workspace root.
type Check = fn(&Path) -> Result<(), String>;

/// One CI step: a description and the cargo arguments.
struct Step {
    what: &'static str,
    args: Vec<&'static str>,
    /// Make room first if the disk is nearly full (see [`make_room`]).
    needs_room: bool,
    lint: Lint,
    /// Variables for the step's command.
    env: &'static [(&'static str, &'static str)],
    timing: Timing,
    /// Builds in the target directory of the libraries' no-GPU build ([`NO_GPU_TARGET`]), not
    /// the test build's: a second cargo can then run beside the tests without waiting for
    /// their build directory's lock.
    no_gpu_target: bool,
    /// A `cargo install`: into [`install_root`], compiled in the build's target directory.
    installs: bool,
    /// A check of what the step made, run after it passed.
    then: Option<Check>,
}

/// The no-GPU build's target directory, under the workspace's.
const NO_GPU_TARGET: &str = "no-gpu";

fn steps() -> Vec<Step> {
    let step = |what, parts: &[&[&'static str]]| Step {
        what,
        args: parts.concat(),
        needs_room: false,
        lint: Lint::Build,
        env: &[],
        timing: Timing::InTurn,
        no_gpu_target: false,
        installs: false,
        then: None,
    };
    vec![
        Step {
            lint: Lint::No,
            ..step("formatting", &[&["fmt", "--all", "--", "--check"]])
        },
        Step {
            needs_room: true,
            env: &[BURN_DEFAULT_DEVICE],
            ..step(
                "the workspace with its CUDA code built (clippy's lints, warnings denied) and linked, every test target",
                &[&[
                    "test",
                    "--workspace",
                    "--no-run",
                    "--timings",
                    "--features",
                    FEATURES,
                ]],
            )
        },
        // The libraries as a user builds them: default features (no GPU) plus burn-train's
        // integration, checked with clippy's lints (check mode: no code generated, so Burn's
        // stack costs its metadata only). The test build above has every GPU feature on, so
        // without this step a build without `cuda` would never be compiled. It runs beside
        // the tests, niced: they use about one of two cores (measured: 163 CPU seconds in
        // 170 s), and a cold check of Burn's stack takes minutes.
        Step {
            lint: Lint::No,
            timing: Timing::Background,
            no_gpu_target: true,
            ..step(
                "the libraries without GPU features, linted (cargo clippy, beside the tests)",
                &[
                    &["clippy"],
                    PUBLISHED,
                    &["--all-targets", "--features", "burn-ddp/learner"],
                    &["--", "-D", "warnings"],
                ],
            )
        },
        Step {
            env: &[BURN_DEFAULT_DEVICE],
            ..step(
                "every test (unit, multi-process integration, doc, CUDA without a GPU)",
                &[&["test", "--workspace", "--features", FEATURES]],
            )
        },
        // Their documentation, warnings denied (broken links, missing docs), from the metadata
        // the no-GPU step left.
        Step {
            lint: Lint::No,
            env: &[RUSTDOC_DENY_WARNINGS],
            timing: Timing::AfterBackground,
            no_gpu_target: true,
            ..step(
                "the libraries' documentation, warnings denied (cargo doc)",
                &[
                    &["doc", "--no-deps"],
                    PUBLISHED,
                    &["--features", "burn-ddp/learner"],
                ],
            )
        },
        // The publishable crates as crates.io would receive them (no upload, no build: the
        // manifests, license files and readme of each package; path dependencies have versions).
        Step {
            lint: Lint::No,
            ..step(
                "the publishable crates package (cargo package, no upload)",
                &[&["package"], PUBLISHED, &["--no-verify", "--allow-dirty"]],
            )
        },
        // The launcher as the README installs it: `cargo install --path crates/ddprun` (release),
        // into a folder under target; its dependencies are those the release build of xtask
        // compiled (`cargo xtask` is a release build), so this compiles ddprun's own crates.
        Step {
            lint: Lint::No,
            installs: true,
            then: Some(installed_ddprun_prints_its_version),
            ..step(
                "the launcher installs (cargo install --path crates/ddprun) and prints its version",
                &[&["install", "--quiet", "--locked", "--path", "crates/ddprun"]],
            )
        },
        // The README's dependency lines as a new user's project resolves them (no build): the
        // learner feature's graph holds no crate known not to build.
        Step {
            lint: Lint::Subcommand,
            ..step(
                "the README's dependency lines resolve for a new project (cargo xtask readme-deps)",
                &[&["xtask", "readme-deps"]],
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
        // The BatchNorm sweep in miniature with the test build's train-cnn: the files are
        // written and their numbers finite (`compare` checks them), nothing asserted of them.
        Step {
            lint: Lint::Subcommand,
            ..step(
                "the BatchNorm sweep, tiny (cargo xtask compare: 2 seeds, 2 per-rank batches, 1 epoch of 64 images)",
                &[&[
                    "xtask",
                    "compare",
                    "--debug-build",
                    "--ranks",
                    "2",
                    "--seeds",
                    "2",
                    "--per-rank-batch",
                    "4,8",
                    "--epochs",
                    "1",
                    "--train-size",
                    "64",
                    "--eval-size",
                    "64",
                    "--out",
                    "target/compare-ci",
                ]],
            )
        },
    ]
}

/// Where the install step puts what it installs (`bin/` below it): `ci-install` in the
/// workspace's target directory.
fn install_root(root: &Path) -> PathBuf {
    cargo_tasks::target_dir(root).join("ci-install")
}

/// `bin/ddprun --version` below [`install_root`] prints `ddprun <the workspace's version>`.
fn installed_ddprun_prints_its_version(root: &Path) -> Result<(), String> {
    let bin = install_root(root).join("bin").join("ddprun");
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!("ddprun {}", env!("CARGO_PKG_VERSION"));
    if !out.status.success() || text.trim() != want {
        return Err(format!(
            "{} --version: {} printed {:?}, expected {want:?}",
            bin.display(),
            out.status,
            text.trim()
        ));
    }
    eprintln!("==> {} --version: {want}", bin.display());
    Ok(())
}

/// Free space below which [`make_room`] deletes what an earlier run left. The two builds of
/// the old layout peaked at 6.6 GB of disk (measured); the one build, tests and CUDA binaries
/// included, left a 5.9 GB target directory (2026-12-02).
const LOW_DISK_BYTES: u64 = 4 << 30;

/// Before the build step, on a nearly full disk: deletes what an earlier run left
/// in `target/debug/deps` and the next step does not need, so that a link does not die of a
/// full disk (a CI run once did). That is clippy's metadata (a `.rmeta` without its `.rlib`)
/// and the test executables (`NAME-HASH`, the bulk: they have run and passed). A later run
/// redoes them.
fn make_room(root: &Path) {
    let deps = cargo_tasks::target_dir(root).join("debug").join("deps");
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

/// A step running in the background: its process (killed and reaped if CI stops before it
/// is joined), its log and when it started.
struct Background {
    what: &'static str,
    child: std::process::Child,
    log: PathBuf,
    started: Instant,
}

impl Background {
    /// Waits for it; its log is printed either way, and its failure is CI's.
    fn join(mut self) -> Result<(), String> {
        let status = self
            .child
            .wait()
            .map_err(|e| format!("{}: waiting: {e}", self.what))?;
        match std::fs::read_to_string(&self.log) {
            Ok(out) => eprint!("{out}"),
            Err(e) => eprintln!("==> {}: its log {}: {e}", self.what, self.log.display()),
        }
        if !status.success() {
            return Err(format!("{} failed ({status})", self.what));
        }
        eprintln!(
            "==> {} passed ({:.0?} beside the steps in between)",
            self.what,
            self.started.elapsed()
        );
        Ok(())
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The cargo command of step `s`.
fn command(root: &Path, s: &Step) -> Result<Command, String> {
    let mut cmd = cargo_tasks::cargo();
    cmd.args(&s.args)
        .current_dir(root)
        .envs(s.env.iter().copied());
    if s.no_gpu_target {
        cmd.env(
            "CARGO_TARGET_DIR",
            cargo_tasks::target_dir(root).join(NO_GPU_TARGET),
        );
    }
    if s.installs {
        // `cargo install` builds in a temporary directory unless told the target's.
        cmd.env("CARGO_TARGET_DIR", cargo_tasks::target_dir(root))
            .arg("--root")
            .arg(install_root(root));
    }
    match s.lint {
        Lint::No => {}
        Lint::Build => lint_with_clippy(&mut cmd)?,
        Lint::Subcommand => {
            cmd.env(LINT_MARKER, "1");
        }
    }
    Ok(cmd)
}

/// Starts `s` in the background at the lowest CPU priority, its output into a log.
fn start_background(root: &Path, s: &Step) -> Result<Background, String> {
    use std::os::unix::process::CommandExt;
    let dir = cargo_tasks::target_dir(root);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let log = dir.join("ci-background.log");
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = command(root, s)?;
    cmd.stdout(out).stderr(err);
    // SAFETY: setpriority is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::setpriority(libc::PRIO_PROCESS, 0, 19);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    Ok(Background {
        what: s.what,
        child,
        log,
        started: Instant::now(),
    })
}

/// Runs every step; stops at the first failure (a background step still running is killed).
pub fn run(root: &Path) -> Result<(), String> {
    let all = Instant::now();
    if let Err(e) = cuda_tools::cuda_build::check(root) {
        eprintln!(
            "==> note: {e}; the CUDA steps will download LLVM (without internet, run \
             `cargo xtask setup-cuda-build` first)"
        );
    }
    let steps = steps();
    let mut background: Option<Background> = None;
    for (i, s) in steps.iter().enumerate() {
        if s.needs_room {
            make_room(root);
        }
        if s.timing == Timing::AfterBackground
            && let Some(b) = background.take()
        {
            b.join()?;
        }
        let t = Instant::now();
        eprintln!(
            "==> [{}/{}] {}: cargo {}",
            i + 1,
            steps.len(),
            s.what,
            s.args.join(" ")
        );
        if s.timing == Timing::Background {
            background = Some(start_background(root, s)?);
            continue;
        }
        let status = command(root, s)?
            .status()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        if !status.success() {
            return Err(format!("{} failed ({status})", s.what));
        }
        if let Some(check) = s.then {
            check(root).map_err(|e| format!("{} failed: {e}", s.what))?;
        }
        eprintln!("==> {} passed in {:.0?}", s.what, t.elapsed());
    }
    if let Some(b) = background {
        b.join()?;
    }
    eprintln!("==> CI passed in {:.0?}", all.elapsed());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The background step and the step that waits for it share the no-GPU target (the
    /// documentation reads the metadata the lint left); every step between them builds in the
    /// test build's target, so neither cargo waits for the other's lock; and each background
    /// step is joined by a later step or at the end (one at a time).
    #[test]
    fn the_background_step_is_alone_in_its_target_and_joined() {
        let steps = steps();
        let mut open: Option<usize> = None;
        for (i, s) in steps.iter().enumerate() {
            match s.timing {
                Timing::Background => {
                    assert!(open.is_none(), "step {i}: a second background step");
                    assert!(s.no_gpu_target, "step {i}");
                    open = Some(i);
                }
                Timing::AfterBackground => {
                    assert!(open.take().is_some(), "step {i} waits for nothing");
                    assert!(s.no_gpu_target, "step {i}");
                }
                Timing::InTurn => {
                    assert!(
                        !(open.is_some() && s.no_gpu_target),
                        "step {i} would wait for the background step's lock"
                    );
                }
            }
        }
        assert!(steps.iter().any(|s| s.timing == Timing::Background));
    }

    /// The install step builds in the workspace's target directory (reusing its release
    /// dependencies, not a temporary one) and installs below it, where its check looks.
    #[test]
    fn the_install_step_builds_and_installs_in_the_target_directory() {
        let root = Path::new("/workspace");
        let s = steps()
            .into_iter()
            .find(|s| s.installs)
            .expect("an install step");
        let cmd = command(root, &s).unwrap();
        let args: Vec<_> = cmd.get_args().collect();
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--root" && Path::new(w[1]) == install_root(root)),
            "{args:?}"
        );
        let target = cargo_tasks::target_dir(root);
        assert!(
            cmd.get_envs()
                .any(|(k, v)| k == "CARGO_TARGET_DIR" && v.map(Path::new) == Some(&target)),
            "{:?}",
            cmd.get_envs().collect::<Vec<_>>()
        );
        assert!(install_root(root).starts_with(&target));
    }

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
