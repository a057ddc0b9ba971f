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
//! (at most 64 MiB in all, see [`build::CARRY_LIMIT_BYTES`]), and the run has minutes: the
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
    /// Where the binaries are unpacked (they don't fit the carry limit unpacked).
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
    /// default leaves a 540 s device command time to start and to return the files.
    #[arg(long, env = "GPU_CHECK_BUDGET", default_value_t = 450)]
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
}

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
    /// The workspace manifest could not be read as TOML.
    #[error("{path}: not a readable Cargo manifest: {source}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The parse error.
        source: toml::de::Error,
    },
    /// The bundle folder has no archive.
    #[error(
        "{0} missing: run `cargo xtask gpu-check build` on the build machine and carry its folder"
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
        /// [`build::CARRY_LIMIT_BYTES`].
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
        .unwrap_or_else(|| PathBuf::from(".gpu-bin"))
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
    rows::run_all(&ctx, &checks, &mut report, &mut on_row);

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
    let mut logs: Vec<PathBuf> = std::fs::read_dir(log_dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect()
        })
        .unwrap_or_default();
    logs.sort();
    let mut all = String::new();
    for l in logs {
        let _ = writeln!(
            all,
            "\n===== {} =====",
            l.file_name().unwrap_or_default().to_string_lossy()
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

    #[test]
    fn only_selects_by_label() {
        assert_eq!(select(rows::CHECKS, &[]).len(), rows::CHECKS.len());
        let cpu = select(rows::CHECKS, &["cpu all-reduce".into()]);
        assert_eq!(cpu.len(), 1);
        assert_eq!(cpu[0].needs, rows::Needs::Cpu);
        assert!(select(rows::CHECKS, &["no such check".into()]).is_empty());
    }
}
