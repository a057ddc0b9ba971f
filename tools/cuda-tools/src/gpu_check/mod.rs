//! `cargo xtask gpu-check build|run`: one GPU check for burn-ddp, in two halves.
//!
//! ```text
//! cargo xtask gpu-check build [--out DIR] [--dry] [--add FILE]…   # a build machine (cargo, no GPU)
//! .gpu-bin/xtask gpu-check run [--bundle DIR] [--budget-secs S] [--only TEXT]…  # the GPU machine
//! ```
//!
//! `build` builds the CUDA binaries CI links plus the programs the checks run, strips them and
//! packs them into `.gpu-bin/bins.tar.xz` (xz, 512 MiB dictionary: the binaries share most of
//! their bytes), with this xtask binary (release, stripped) beside the archive. `run` needs no
//! cargo, Python or `xz`: it unpacks the archive with the same Rust decoder, finds libcuda and
//! libnccl (ddp-comm's checks, see [`machine`]), runs every check under a deadline and prints
//! one table.
//!
//! The GPU machine it is made for: an NVIDIA GPU with its driver (Python and PyTorch's wheels
//! for NCCL and libdevice), no network and no cargo; `.gpu-bin/` and `.gl/` are copied to it
//! (at most 64 MiB in all, see [`build::COPY_LIMIT_BYTES`]), and the run has minutes: the
//! default budget is 450 s of a 540 s command. On it, from the repository root:
//!
//! ```text
//! .gpu-bin/xtask gpu-check run          # OUT=DIR to keep the table and the logs there
//! ```
//!
//! Each row is printed as it ends and, with `OUT`, the table is rewritten after every row, so a
//! run stopped by its machine's time limit still leaves what it reached.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use thiserror::Error;

pub mod build;
pub mod bundle;
pub mod machine;
pub mod process;
pub mod report;
pub mod rows;

/// Options of `cargo xtask gpu-check`.
#[derive(Debug, Args)]
pub struct GpuCheckArgs {
    /// `build` or `run`.
    #[command(subcommand)]
    pub cmd: GpuCheckCmd,
}

/// The halves of the GPU check.
#[derive(Debug, Subcommand)]
pub enum GpuCheckCmd {
    /// Here (cargo, no GPU needed): build CI's CUDA binaries and the check's programs and pack
    /// them into the bundle folder, with this xtask binary beside the archive.
    Build(build::BuildArgs),
    /// There (an NVIDIA GPU; no network, no cargo): unpack the bundle, find libcuda and
    /// libnccl, run every check and print one table. Exits non-zero when a row fails.
    Run(RunArgs),
    /// Print ddp-comm's library and device checks as JSON (`run` starts this with the rows'
    /// environment).
    #[command(hide = true)]
    Probe,
}

/// Options of `gpu-check run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The bundle folder [default: this binary's folder when it holds bins.tar.xz, else
    /// ./.gpu-bin].
    #[arg(long, value_name = "DIR")]
    pub bundle: Option<PathBuf>,
    /// Where the binaries are unpacked (unpacked, they are far over what may be copied to the GPU machine).
    #[arg(
        long,
        value_name = "DIR",
        env = "GPU_CHECK_BIN_DIR",
        default_value = "/tmp/gpu-check-bin"
    )]
    pub bin_dir: PathBuf,
    /// One log per row.
    #[arg(long, value_name = "DIR", default_value = "/tmp/gpu-check-logs")]
    pub log_dir: PathBuf,
    /// Seconds for the whole run, unpacking included; rows that no longer fit are skipped. The
    /// default is for a GPU machine whose commands may run 540 s: it leaves time to start and to
    /// return the files.
    #[arg(long, env = "GPU_CHECK_BUDGET", default_value_t = DEFAULT_BUDGET_SECS)]
    pub budget_secs: u64,
    /// Also write the table to DIR/gpu-check-summary.md and every row's log to
    /// DIR/gpu-check-logs.txt.
    #[arg(long, value_name = "DIR", env = "OUT")]
    pub report_dir: Option<PathBuf>,
    /// Debian packages (the Vulkan loader) unpacked into / before the checks [default: .gl
    /// beside the bundle folder].
    #[arg(long, value_name = "DIR")]
    pub gl: Option<PathBuf>,
    /// Run only the checks whose label contains TEXT (case-insensitive; repeatable).
    #[arg(long, value_name = "TEXT")]
    pub only: Vec<String>,
    /// The NVRTC bundle (`gpu-check build --nvrtc`) to fall back to when this machine's driver
    /// refuses LLVM's PTX in the smoke row: its CUDA rows then replace this bundle's [default:
    /// .gpu-bin-nvrtc beside the bundle folder, when it holds bins.tar.xz].
    #[arg(long, value_name = "DIR")]
    pub fallback_bundle: Option<PathBuf>,
}

/// `gpu-check run`'s default budget in seconds, unpacking included: with the report written
/// and a cut row's children killed (up to 15 s), the run ends within 8 minutes.
pub const DEFAULT_BUDGET_SECS: u64 = 450;

/// An error that stops `gpu-check` before or instead of its table.
#[derive(Debug, Error)]
pub enum GpuCheckError {
    /// Packing or unpacking the archive failed.
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A cargo command of `build` failed.
    #[error("{what}: cargo failed ({status})")]
    Cargo {
        /// The build step.
        what: &'static str,
        /// Its exit status.
        status: String,
    },
    /// A cargo command did not produce an executable the bundle needs.
    #[error("no {kind} executable named {target} in cargo's output")]
    NoArtifact {
        /// The cargo target.
        target: &'static str,
        /// Its kind.
        kind: &'static str,
    },
    /// The workspace's `.cargo/config.toml` (its per-package profile settings) could not be
    /// read as TOML.
    #[error("{path}: not a readable TOML file of cargo's: {source}")]
    Manifest {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: toml::de::Error,
    },
    /// The bundle folder has no archive.
    #[error(
        "{0} missing: run `cargo xtask gpu-check build` on the build machine and copy its folder here"
    )]
    NoBundle(PathBuf),
    /// The bundle is larger than what may be copied to the GPU machine.
    #[error(
        "the bundle and .gl are {:.1} MiB, over the {} MiB that may be copied to the GPU machine \
         (64 MiB in all with the working tree): the machine could not receive it. Drop a \
         program from the build (gpu_check/build.rs) or split the bundle",
        *bytes as f64 / 1048576.0,
        limit >> 20
    )]
    TooBig {
        /// Bundle folder plus `.gl`.
        bytes: u64,
        /// [`build::COPY_LIMIT_BYTES`].
        limit: u64,
    },
    /// The checks ran and some failed (the table says which).
    #[error("{0} of the GPU check's rows failed")]
    RowsFailed(usize),
}

impl GpuCheckError {
    fn io(what: &'static str, path: &Path, source: std::io::Error) -> Self {
        GpuCheckError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Runs `cargo xtask gpu-check …`.
pub fn main(root: &Path, a: &GpuCheckArgs) -> Result<(), GpuCheckError> {
    match &a.cmd {
        GpuCheckCmd::Build(b) => build::build(root, b),
        GpuCheckCmd::Run(r) => run(r),
        GpuCheckCmd::Probe => {
            let p = machine::probe_here();
            println!(
                "{}",
                serde_json::to_string(&p).expect("the probe serialises")
            );
            Ok(())
        }
    }
}

/// The bundle folder `run` uses when none is given.
fn default_bundle() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
        .filter(|dir| dir.join(bundle::ARCHIVE).is_file())
        .unwrap_or_else(|| PathBuf::from(build::BUNDLE_DIR))
}

/// The checks `--only` selects (all without it).
pub fn select(checks: &[rows::Check], only: &[String]) -> Vec<rows::Check> {
    checks
        .iter()
        .filter(|c| {
            only.is_empty()
                || only
                    .iter()
                    .any(|o| c.label.to_lowercase().contains(&o.to_lowercase()))
        })
        .copied()
        .collect()
}

/// `gpu-check run`.
fn run(a: &RunArgs) -> Result<(), GpuCheckError> {
    let start = Instant::now();
    let bundle_dir = a.bundle.clone().unwrap_or_else(default_bundle);
    let archive = bundle_dir.join(bundle::ARCHIVE);
    if !archive.is_file() {
        return Err(GpuCheckError::NoBundle(archive));
    }
    let self_exe = std::env::current_exe()
        .map_err(|e| GpuCheckError::io("cannot find", Path::new("the xtask binary"), e))?;
    if a.bin_dir.exists() {
        std::fs::remove_dir_all(&a.bin_dir)
            .map_err(|e| GpuCheckError::io("cannot remove", &a.bin_dir, e))?;
    }
    let names = bundle::unpack(&archive, &a.bin_dir)?;
    eprintln!(
        "gpu-check: {} files unpacked into {} in {:.1} s",
        names.len(),
        a.bin_dir.display(),
        start.elapsed().as_secs_f64()
    );
    if a.log_dir.exists() {
        std::fs::remove_dir_all(&a.log_dir)
            .map_err(|e| GpuCheckError::io("cannot remove", &a.log_dir, e))?;
    }
    std::fs::create_dir_all(&a.log_dir)
        .map_err(|e| GpuCheckError::io("cannot create", &a.log_dir, e))?;

    let gl = a.gl.clone().unwrap_or_else(|| {
        bundle_dir
            .canonicalize()
            .unwrap_or_else(|_| bundle_dir.clone())
            .parent()
            .map_or_else(|| PathBuf::from(".gl"), |p| p.join(".gl"))
    });
    let m = machine::prepare(&self_exe, &a.bin_dir, &a.log_dir, Some(&gl));
    let ctx = rows::Ctx {
        bin_dir: a.bin_dir.clone(),
        log_dir: a.log_dir.clone(),
        xtask: self_exe,
        env: m.env.clone(),
        gpus: m.gpus,
        cuda_error: m.cuda_error.clone(),
        start,
        budget: Duration::from_secs(a.budget_secs),
    };
    let compiler = std::fs::read_to_string(a.bin_dir.join(build::COMPILER_FILE))
        .unwrap_or_else(|_| "not recorded (an older bundle: LLVM)".into());
    let mut header = vec![format!("CUDA kernels compiled by: {}", compiler.trim())];
    header.extend(m.header.iter().cloned());
    let mut report = report::Report {
        header,
        notes: m.notes.clone(),
        ..report::Report::default()
    };
    if let Some(e) = &m.cuda_error {
        report.notes.push(format!("--- CUDA rows not run: {e}"));
    }
    let checks = select(rows::CHECKS, &a.only);
    for h in &report.header {
        eprintln!("gpu-check: {h}");
    }
    // `partial`: the rows so far, while the run goes on.
    let title = |partial: Option<usize>| {
        format!(
            "burn-ddp GPU check ({}, {:.0} s of a {} s budget{})",
            report::utc_now(),
            start.elapsed().as_secs_f64(),
            a.budget_secs,
            match partial {
                None => String::new(),
                Some(n) =>
                    format!("; PARTIAL: {n} rows so far — still running, or stopped after this row"),
            }
        )
    };
    // Each row printed as it ends and the table rewritten after it: a run that its machine's
    // time limit kills still leaves every row it finished.
    let mut on_row = |so_far: &report::Report, row: &report::Row| {
        eprintln!("{}", report::progress_line(so_far.rows.len(), row));
        if let Some(dir) = &a.report_dir {
            let text = so_far.render(
                &title(Some(so_far.rows.len())),
                &format!("logs in {}", a.log_dir.display()),
            );
            write_report_dir(dir, &text, &a.log_dir);
        }
    };
    let fallback_dir = compiler
        .trim_start()
        .starts_with("LLVM")
        .then(|| fallback_bundle(a, &bundle_dir))
        .flatten();
    let prepare_fallback = |dir: &Path| fallback_ctx(a, dir, &ctx, &ctx.xtask);
    let fallback = fallback_dir
        .as_deref()
        .map(|d| (d, &prepare_fallback as &PrepareFallback<'_>));
    run_checks(&ctx, &checks, fallback, &mut report, &mut on_row);

    let text = report.render(&title(None), &format!("logs in {}", a.log_dir.display()));
    print!("{text}");
    if let Some(dir) = &a.report_dir {
        write_report_dir(dir, &text, &a.log_dir);
    }
    let failed = report.rows.iter().filter(|r| r.status.is_failure()).count();
    if failed > 0 {
        Err(GpuCheckError::RowsFailed(failed))
    } else {
        Ok(())
    }
}

/// Prepares the rows' context for the fallback bundle in a folder (see [`fallback_ctx`]).
type PrepareFallback<'a> = dyn Fn(&Path) -> Result<(rows::Ctx, Vec<String>), GpuCheckError> + 'a;

/// Runs `checks` into `report`: the smoke row first, and when it fails because the driver
/// refused LLVM's PTX, the CUDA rows from the fallback (NVRTC) bundle — `fallback`, its folder
/// and how to prepare it — instead of `ctx`'s, which would all fail the same way; without one,
/// a note names the commands that make and run it.
fn run_checks(
    ctx: &rows::Ctx,
    checks: &[rows::Check],
    fallback: Option<(&Path, &PrepareFallback<'_>)>,
    report: &mut report::Report,
    on_row: rows::OnRow<'_>,
) {
    let smoke_first = checks
        .first()
        .is_some_and(|c| matches!(c.kind, rows::Kind::Test(_, t, _) if t == rows::SMOKE_TEST));
    let (smoke, rest) = checks.split_at(usize::from(smoke_first));
    let before = report.rows.len();
    rows::run_all(ctx, smoke, report, on_row);
    let refusal = report
        .rows
        .get(before)
        .filter(|r| smoke_first && r.status.is_failure())
        .and_then(|_| {
            let log = std::fs::read_to_string(rows::smoke_log(ctx)).unwrap_or_default();
            report::ptx_refusal(&log).map(str::to_string)
        });
    let Some(why) = refusal else {
        rows::run_all(ctx, rest, report, on_row);
        return;
    };
    let why = report::cut(&why, 160);
    let Some((dir, prepare)) = fallback else {
        report.notes.push(format!(
            "--- this driver refused LLVM's PTX in the smoke row ({why}): the fallback is the \
             NVRTC bundle — on the build machine `cargo xtask gpu-check build --nvrtc`, here \
             `{NVRTC}/xtask gpu-check run` (docs/gpu.md, \"A second compiler\")",
            NVRTC = build::NVRTC_BUNDLE_DIR
        ));
        rows::run_all(ctx, rest, report, on_row);
        return;
    };
    report.notes.push(format!(
        "--- this driver refused LLVM's PTX in the smoke row ({why}): the CUDA rows after it \
         ran from the NVRTC bundle {} (labels `{FALLBACK_PREFIX}…`)",
        dir.display()
    ));
    let (cuda, cpu): (Vec<rows::Check>, Vec<rows::Check>) = checks
        .iter()
        .copied()
        .partition(|c| c.needs == rows::Needs::Cuda);
    match prepare(dir) {
        Ok((fb_ctx, fb_header)) => {
            report.notes.extend(
                fb_header
                    .into_iter()
                    .map(|h| format!("    NVRTC bundle: {h}")),
            );
            report.label_prefix = FALLBACK_PREFIX.into();
            rows::run_all(&fb_ctx, &cuda, report, on_row);
            report.label_prefix.clear();
        }
        Err(e) => {
            report
                .notes
                .push(format!("    the NVRTC bundle could not be used: {e}"));
            rows::run_all(ctx, cuda.get(1..).unwrap_or_default(), report, on_row);
        }
    }
    rows::run_all(ctx, &cpu, report, on_row);
}

/// Put before the labels of the rows that ran from the fallback bundle.
pub const FALLBACK_PREFIX: &str = "NVRTC · ";

/// The NVRTC bundle to fall back to: `--fallback-bundle`, else `.gpu-bin-nvrtc` beside the
/// bundle folder, when it holds an archive.
fn fallback_bundle(a: &RunArgs, bundle_dir: &Path) -> Option<PathBuf> {
    let dir = a.fallback_bundle.clone().or_else(|| {
        let abs = bundle_dir
            .canonicalize()
            .unwrap_or_else(|_| bundle_dir.to_path_buf());
        abs.parent().map(|p| p.join(build::NVRTC_BUNDLE_DIR))
    })?;
    dir.join(bundle::ARCHIVE).is_file().then_some(dir)
}

/// The rows' context for the fallback bundle `dir`: unpacked beside the first bundle's binaries,
/// its logs in a `nvrtc` folder of the first's, the machine prepared again for its binaries
/// (NVRTC's links); with the lines its preparation reports.
fn fallback_ctx(
    a: &RunArgs,
    dir: &Path,
    ctx: &rows::Ctx,
    self_exe: &Path,
) -> Result<(rows::Ctx, Vec<String>), GpuCheckError> {
    let mut name = a.bin_dir.as_os_str().to_os_string();
    name.push("-nvrtc");
    let bin_dir = PathBuf::from(name);
    if bin_dir.exists() {
        std::fs::remove_dir_all(&bin_dir)
            .map_err(|e| GpuCheckError::io("cannot remove", &bin_dir, e))?;
    }
    bundle::unpack(&dir.join(bundle::ARCHIVE), &bin_dir)?;
    let log_dir = a.log_dir.join(NVRTC_LOGS);
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| GpuCheckError::io("cannot create", &log_dir, e))?;
    let m = machine::prepare(self_exe, &bin_dir, &log_dir, None);
    let fb = rows::Ctx {
        bin_dir,
        log_dir,
        env: m.env,
        gpus: m.gpus,
        cuda_error: m.cuda_error,
        ..ctx.clone()
    };
    let mut header = m.header;
    header.extend(m.notes);
    Ok((fb, header))
}

/// The folder of the fallback bundle's logs, inside the log folder.
const NVRTC_LOGS: &str = "nvrtc";

/// The summary and one file with every row's log (two files: what comes back from the GPU
/// machine is a few files under `$OUT`).
fn write_report_dir(dir: &Path, summary: &str, log_dir: &Path) {
    use std::fmt::Write as _;
    if let Err(e) = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(dir.join("gpu-check-summary.md"), summary))
    {
        eprintln!("gpu-check: cannot write {}: {e}", dir.display());
        return;
    }
    let logs_in = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "log"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut logs = logs_in(log_dir);
    logs.extend(logs_in(&log_dir.join(NVRTC_LOGS)));
    logs.sort();
    let mut all = String::new();
    for l in logs {
        let _ = writeln!(
            all,
            "\n===== {} =====",
            l.strip_prefix(log_dir).unwrap_or(&l).display()
        );
        all.push_str(&String::from_utf8_lossy(
            &std::fs::read(&l).unwrap_or_default(),
        ));
    }
    if let Err(e) = std::fs::write(dir.join("gpu-check-logs.txt"), all) {
        eprintln!(
            "gpu-check: cannot write the logs into {}: {e}",
            dir.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for `burn-ddp-tests`: lists the smoke test and one more, records what it
    /// runs, and answers the smoke test with `smoke` (shell lines).
    fn fake_tests(bin_dir: &Path, smoke: &str) {
        std::fs::create_dir_all(bin_dir).unwrap();
        let p = bin_dir.join(rows::SMOKE_BINARY);
        let body = format!(
            "#!/bin/sh\n\
             if [ \"$1\" = --list ]; then printf '{}: test\\ndevice_buffers: test\\n'; exit 0; fi\n\
             echo \"$2\" >> \"$(dirname \"$0\")/ran\"\n\
             case \"$2\" in cuda::smoke::*) {smoke} ;; esac\n\
             echo 'OUTCOME fine'; exit 0\n",
            rows::SMOKE_TEST
        );
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    const REFUSED: &str = "echo 'Unable to load the PTX: DriverError(CUDA_ERROR_INVALID_PTX, \"a PTX JIT compilation failed\")'; exit 101";

    fn fake_ctx(dir: &Path, name: &str, smoke: &str) -> rows::Ctx {
        let bin_dir = dir.join(name);
        let log_dir = dir.join(format!("{name}-logs"));
        std::fs::create_dir_all(&log_dir).unwrap();
        fake_tests(&bin_dir, smoke);
        rows::Ctx {
            bin_dir,
            log_dir,
            xtask: PathBuf::from("/nonexistent/xtask"),
            env: Vec::new(),
            gpus: 1,
            cuda_error: None,
            start: Instant::now(),
            budget: Duration::from_secs(300),
        }
    }

    /// The smoke check, the burn-ddp libtest check, and a CPU check whose binary is absent.
    fn checks() -> Vec<rows::Check> {
        let find = |f: &dyn Fn(&rows::Check) -> bool| *rows::CHECKS.iter().find(|c| f(c)).unwrap();
        let cpu = find(&|c| c.needs == rows::Needs::Cpu);
        let burn_ddp = find(&|c| c.kind == rows::Kind::Libtest(rows::SMOKE_BINARY));
        vec![rows::CHECKS[0], burn_ddp, cpu]
    }

    fn ran(ctx: &rows::Ctx) -> String {
        std::fs::read_to_string(ctx.bin_dir.join("ran")).unwrap_or_default()
    }

    #[test]
    fn a_refused_ptx_runs_the_cuda_rows_from_the_nvrtc_bundle() {
        let dir = tempfile::tempdir().unwrap();
        let llvm = fake_ctx(dir.path(), "llvm", REFUSED);
        let nvrtc = fake_ctx(dir.path(), "nvrtc", "echo 'OUTCOME smoke ok'; exit 0");
        let prepare = |_: &Path| -> Result<(rows::Ctx, Vec<String>), GpuCheckError> {
            Ok((nvrtc.clone(), vec!["NVRTC: x".into()]))
        };
        let mut r = report::Report::default();
        let mut labels = Vec::new();
        run_checks(
            &llvm,
            &checks(),
            Some((Path::new("/b/.gpu-bin-nvrtc"), &prepare)),
            &mut r,
            &mut |_, row| labels.push(row.label.clone()),
        );
        let got: Vec<(String, report::Status)> =
            r.rows.iter().map(|r| (r.label.clone(), r.status)).collect();
        let c = checks();
        assert_eq!(
            got,
            [
                (c[0].label.to_string(), report::Status::Fail),
                (
                    format!("{FALLBACK_PREFIX}{}", c[0].label),
                    report::Status::Pass
                ),
                (
                    format!("{FALLBACK_PREFIX}{}::device_buffers", c[1].label),
                    report::Status::Pass
                ),
                (c[2].label.to_string(), report::Status::Missing),
            ]
        );
        assert_eq!(labels.len(), 4, "every row announced");
        assert_eq!(ran(&llvm), format!("{}\n", rows::SMOKE_TEST));
        assert_eq!(
            ran(&nvrtc),
            format!("{}\ndevice_buffers\n", rows::SMOKE_TEST)
        );
        assert!(
            r.notes.iter().any(|n| n.contains("refused LLVM's PTX")
                && n.contains("CUDA_ERROR_INVALID_PTX")
                && n.contains(".gpu-bin-nvrtc")),
            "{:?}",
            r.notes
        );
        assert!(r.notes.contains(&"    NVRTC bundle: NVRTC: x".to_string()));
    }

    #[test]
    fn without_the_nvrtc_bundle_a_refused_ptx_names_the_commands_and_the_rows_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let llvm = fake_ctx(dir.path(), "llvm", REFUSED);
        let mut r = report::Report::default();
        run_checks(&llvm, &checks(), None, &mut r, &mut |_, _| {});
        assert_eq!(r.rows.len(), 3);
        assert_eq!(r.rows[1].status, report::Status::Pass);
        assert!(!r.rows[1].label.starts_with(FALLBACK_PREFIX));
        assert!(
            r.notes
                .iter()
                .any(|n| n.contains("cargo xtask gpu-check build --nvrtc")),
            "{:?}",
            r.notes
        );
    }

    #[test]
    fn a_smoke_failure_that_is_no_ptx_refusal_keeps_the_bundle() {
        let dir = tempfile::tempdir().unwrap();
        let llvm = fake_ctx(dir.path(), "llvm", "echo 'wrong sum'; exit 101");
        let used = std::cell::Cell::new(false);
        let prepare = |_: &Path| -> Result<(rows::Ctx, Vec<String>), GpuCheckError> {
            used.set(true);
            Err(GpuCheckError::RowsFailed(0))
        };
        let mut r = report::Report::default();
        run_checks(
            &llvm,
            &checks(),
            Some((Path::new("/b/.gpu-bin-nvrtc"), &prepare)),
            &mut r,
            &mut |_, _| {},
        );
        assert!(!used.get());
        assert_eq!(r.rows.len(), 3);
        assert_eq!(r.rows[0].status, report::Status::Fail);
        assert!(!r.notes.iter().any(|n| n.contains("refused LLVM's PTX")));
    }

    #[test]
    fn only_selects_by_label() {
        assert_eq!(select(rows::CHECKS, &[]).len(), rows::CHECKS.len());
        let cpu = select(rows::CHECKS, &["cpu all-reduce".into()]);
        assert_eq!(cpu.len(), 1);
        assert_eq!(cpu[0].needs, rows::Needs::Cpu);
        assert!(select(rows::CHECKS, &["no such check".into()]).is_empty());
    }
}
