//! `cargo xtask ptx-check`: Burn's CUDA path, compiled down to PTX by LLVM and assembled by
//! NVIDIA's ptxas, on a machine without a GPU.
//!
//! It runs CI's CUDA binaries under the CUDA driver stand-in (`tools/cuda-standin`, loaded as
//! `libcuda.so`): `train-cnn --backend cuda --sync-bn` for a few steps (forward, backward, SGD,
//! SyncBatchNorm's CubeCL kernels, evaluation, a checkpoint) and the CUDA SyncBatchNorm tests
//! (f32, f16, bf16; two ranks host-staged — the NCCL ones are left to the GPU check: NCCL needs
//! the CUDA runtime, which the stand-in does not serve). Every PTX module the programs load is
//! handed to ptxas for `sm_90a` and every launch is checked against an H200's limits; nothing
//! runs, so **whatever the programs compute here is meaningless and is not asserted** — the
//! tests' own assertions fail or pass by chance and are ignored. What is checked:
//!
//! - every module assembles (a refused one fails the check; its PTX is kept under
//!   `target/ptx-check/` with ptxas's message, to fix or to report upstream);
//! - no launch exceeds the device's limits;
//! - at least one module links libdevice (cross-entropy's exp/log), found by the same lookup
//!   as on a GPU machine (`ddp_nccl::cuda_toolkit`), with `CUDA_PATH` unset for train-cnn;
//! - train-cnn exits 0, and no program met a driver call the stand-in lacks.
//!
//! It builds nothing heavy: the CUDA binaries are those of `cargo xtask ci`'s build step (its
//! features and packages, limited to the CUDA targets: after CI the command only lists them),
//! plus the stand-in itself (seconds).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;

use crate::gpu_check::build::{self, Pick};
use crate::gpu_check::process::{self, Exit};

/// Options of `cargo xtask ptx-check`.
#[derive(Debug, Args)]
pub struct PtxCheckArgs {
    /// train-cnn's training images (batches of 64: the default is 4 optimizer steps).
    #[arg(long, default_value_t = 256)]
    pub train_size: usize,
    /// Seconds each program may run.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// Skip the CUDA SyncBatchNorm tests (train-cnn only).
    #[arg(long)]
    pub no_tests: bool,
    /// The fallback build (`gpu-check build --nvrtc`): the kernels compiled by cubecl-cuda's
    /// CUDA C++ backend through NVRTC (burn-ddp's `cuda-nvrtc`), found as burn-ddp finds it
    /// (`ddp_nccl::nvrtc_files`). Builds the crates above cubecl-cuda once more: not CI's.
    #[arg(long)]
    pub nvrtc: bool,
}

/// The CUDA binaries the check runs, from CI's CUDA build.
const PICKS: [Pick; 4] = [
    Pick {
        target: "burn_ddp",
        kind: "lib",
        file: "burn-ddp-tests",
    },
    Pick {
        target: "train-cnn",
        kind: "bin",
        file: "train-cnn",
    },
    Pick {
        target: "sync_batch_norm",
        kind: "test",
        file: "sync_batch_norm-tests",
    },
    Pick {
        target: "syncbn_worker",
        kind: "bin",
        file: "syncbn_worker",
    },
];

/// One line of the stand-in's record (see `cuda_standin::record`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A module: hash, assembled, PTX version, target, links libdevice, entries (or ptxas's
    /// message when refused).
    Module {
        /// The PTX's hash.
        hash: String,
        /// Whether ptxas assembled it.
        ok: bool,
        /// `.version`.
        version: String,
        /// `.target`.
        target: String,
        /// Whether it carries libdevice functions.
        libdevice: bool,
        /// The program that loaded it.
        program: String,
        /// Entry names, or ptxas's message.
        detail: String,
    },
    /// A launch: kernel, accepted, reason when refused.
    Launch {
        /// The entry function.
        kernel: String,
        /// Whether the limits allowed it.
        ok: bool,
        /// Why not.
        reason: String,
    },
}

/// Parses the record's lines (unknown lines are skipped).
pub fn parse_record(text: &str) -> Vec<Record> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            match f.as_slice() {
                [
                    "module",
                    hash,
                    status,
                    version,
                    target,
                    libdevice,
                    program,
                    detail,
                ] => Some(Record::Module {
                    hash: (*hash).into(),
                    ok: *status == "ok",
                    version: (*version).into(),
                    target: (*target).into(),
                    libdevice: *libdevice == "libdevice",
                    program: (*program).into(),
                    detail: (*detail).into(),
                }),
                ["launch", kernel, status, reason] => Some(Record::Launch {
                    kernel: (*kernel).into(),
                    ok: *status == "ok",
                    reason: (*reason).into(),
                }),
                _ => None,
            }
        })
        .collect()
}

/// The record summed up over every process.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Distinct modules assembled.
    pub assembled: usize,
    /// Distinct modules refused, with ptxas's message.
    pub refused_modules: BTreeMap<String, String>,
    /// Distinct modules carrying libdevice functions.
    pub libdevice_modules: usize,
    /// Distinct entry functions in assembled modules.
    pub entries: usize,
    /// Distinct kernels launched at least once within the limits.
    pub launched: usize,
    /// Refused launches: kernel and reason.
    pub refused_launches: Vec<(String, String)>,
    /// PTX versions and targets seen.
    pub versions: BTreeSet<String>,
    /// Distinct modules per program that loaded them.
    pub per_program: BTreeMap<String, usize>,
}

impl Tally {
    /// Sums `records` up; a module loaded by several processes counts once.
    pub fn of(records: &[Record]) -> Tally {
        let mut t = Tally::default();
        let mut seen = BTreeSet::new();
        let mut per_program: BTreeSet<(String, String)> = BTreeSet::new();
        let mut entries = BTreeSet::new();
        let mut launched = BTreeSet::new();
        for r in records {
            match r {
                Record::Module {
                    hash,
                    ok,
                    version,
                    target,
                    libdevice,
                    program,
                    detail,
                } => {
                    per_program.insert((program.clone(), hash.clone()));
                    if !seen.insert(hash.clone()) {
                        continue;
                    }
                    t.versions.insert(format!("PTX {version} for {target}"));
                    if *libdevice {
                        t.libdevice_modules += 1;
                    }
                    if *ok {
                        t.assembled += 1;
                        entries.extend(detail.split(',').map(str::to_string));
                    } else {
                        t.refused_modules.insert(hash.clone(), detail.clone());
                    }
                }
                Record::Launch { kernel, ok, reason } => {
                    if *ok {
                        launched.insert(kernel.clone());
                    } else {
                        t.refused_launches.push((kernel.clone(), reason.clone()));
                    }
                }
            }
        }
        for (program, _) in per_program {
            *t.per_program.entry(program).or_default() += 1;
        }
        t.entries = entries.len();
        t.launched = launched.len();
        t
    }

    /// The modules compiled (assembled or refused).
    pub fn compiled(&self) -> usize {
        self.assembled + self.refused_modules.len()
    }
}

/// Runs `cargo xtask ptx-check`.
pub fn run(root: &Path, a: &PtxCheckArgs) -> Result<(), String> {
    let ptxas = ddp_nccl::cuda_toolkit::find_ptxas().map_err(|e| e.to_string())?;
    let ptxas_version = ptxas_version(&ptxas);
    let libdevice = ddp_nccl::cuda_toolkit::find_libdevice().map_err(|e| e.to_string())?;
    let llvm = crate::cuda_build::llvm_version(root).unwrap_or_else(|| "?".into());
    let compiler = if a.nvrtc {
        let nvrtc = ddp_nccl::nvrtc_files::find_nvrtc().map_err(|e| e.to_string())?;
        let version = ddp_nccl::nvrtc_files::builtins_beside(&nvrtc)
            .as_deref()
            .and_then(ddp_nccl::nvrtc_files::version_of_builtins)
            .map_or_else(|| "?".into(), |(a, b)| format!("{a}.{b}"));
        println!("ptx-check: NVRTC {version} ({})", nvrtc.display());
        format!("NVRTC {version}")
    } else {
        format!("LLVM {llvm}")
    };
    println!(
        "ptx-check: under the CUDA driver STAND-IN (no GPU: kernels are assembled and never run; \
         results are meaningless and not asserted)\nptx-check: ptxas {ptxas_version} ({}), \
         libdevice {}, LLVM {llvm}",
        ptxas.display(),
        libdevice.display()
    );

    let standin = build_standin(root)?;
    let bins = cuda_binaries(root, a.nvrtc)?;
    let work = cargo_tasks::target_dir(root).join("ptx-check");
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .map_err(|e| format!("cannot remove {}: {e}", work.display()))?;
    }
    let lib = work.join("lib");
    std::fs::create_dir_all(&lib).map_err(|e| format!("cannot create {}: {e}", lib.display()))?;
    std::os::unix::fs::symlink(&standin, lib.join("libcuda.so"))
        .map_err(|e| format!("cannot link libcuda.so in {}: {e}", lib.display()))?;
    if a.nvrtc {
        // The links burn-ddp asks for (its own check fails without them, naming them).
        let nvrtc = ddp_nccl::nvrtc_files::find_nvrtc().map_err(|e| e.to_string())?;
        ddp_nccl::nvrtc_files::link_nvrtc(&nvrtc, &lib).map_err(|e| e.to_string())?;
    }
    let record = work.join("standin.log");
    let ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let env: Vec<(String, String)> = vec![
        (
            "LD_LIBRARY_PATH".into(),
            crate::gpu_check::machine::prepend_path(&lib.display().to_string(), &ld_path),
        ),
        ("CUDA_STANDIN_PTXAS".into(), ptxas.display().to_string()),
        ("CUDA_STANDIN_LOG".into(), record.display().to_string()),
        ("RUST_BACKTRACE".into(), "0".into()),
        ("NO_COLOR".into(), "1".into()),
    ];
    let limit = Duration::from_secs(a.timeout_secs);
    let mut problems: Vec<String> = Vec::new();

    // train-cnn, a world of one: CUDA_PATH unset, so burn-ddp's own lookup must find libdevice.
    let out = work.join("train-cnn");
    let mut cmd = Command::new(&bins["train-cnn"]);
    cmd.args([
        "--backend",
        "cuda",
        "--sync-bn",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--eval-size",
        "64",
        "--no-progress",
        "--checkpoint-every-steps",
        "2",
    ])
    .args(["--train-size", &a.train_size.to_string()])
    .arg("--out")
    .arg(&out)
    .envs(env.iter().map(|(k, v)| (k, v)))
    .env_remove("CUDA_PATH");
    let log = work.join("train-cnn.log");
    let t0 = Instant::now();
    let f =
        process::run_until(&mut cmd, Instant::now() + limit, &log).map_err(|e| e.to_string())?;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    println!(
        "ptx-check: train-cnn --backend cuda --sync-bn ({} images, 1 epoch, checkpoints): {} in {:.1} s",
        a.train_size,
        f.exit,
        t0.elapsed().as_secs_f64()
    );
    if !f.exit.success() {
        problems.push(format!(
            "train-cnn: {}; last lines:\n{}",
            f.exit,
            tail(&text, 15)
        ));
    }
    if !out.join("checkpoint.bin").is_file() {
        problems.push(format!(
            "train-cnn wrote no {}",
            out.join("checkpoint.bin").display()
        ));
    }
    problems.extend(missing_symbols(&text, "train-cnn"));

    if !a.no_tests {
        run_tests(&bins, &env, &libdevice, &work, limit, &mut problems)?;
    }

    let records = parse_record(&std::fs::read_to_string(&record).unwrap_or_default());
    let tally = Tally::of(&records);
    let versions: Vec<&str> = tally.versions.iter().map(String::as_str).collect();
    println!(
        "ptx-check: {} kernels compiled by {compiler}, {} assembled by ptxas {ptxas_version} for \
         sm_90a, {} failed ({} entry functions; {}; {} link libdevice; {} kernels launched within \
         an H200's limits, {} launches refused)",
        tally.compiled(),
        tally.assembled,
        tally.refused_modules.len(),
        tally.entries,
        versions.join(", "),
        tally.libdevice_modules,
        tally.launched,
        tally.refused_launches.len()
    );
    let programs: Vec<String> = tally
        .per_program
        .iter()
        .map(|(p, n)| format!("{p} {n}"))
        .collect();
    println!("ptx-check: modules per program: {}", programs.join(", "));
    for (hash, why) in &tally.refused_modules {
        problems.push(format!(
            "module {hash} refused by ptxas (PTX kept as {}): {why}",
            work.join(format!("{hash}.ptx")).display()
        ));
    }
    for (kernel, why) in &tally.refused_launches {
        problems.push(format!("launch of {kernel} refused: {why}"));
    }
    if tally.compiled() == 0 {
        problems.push("no PTX module reached the stand-in".into());
    }
    // NVRTC inlines libdevice's functions: its modules carry none to count.
    if tally.libdevice_modules == 0 && !a.nvrtc {
        problems.push("no module linked libdevice (cross-entropy's exp/log should)".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "ptx-check failed ({} problems; logs in {}):\n{}",
            problems.len(),
            work.display(),
            problems.join("\n")
        ))
    }
}

/// The CUDA SyncBatchNorm tests (one GPU): run for their kernels, outcomes not asserted.
fn run_tests(
    bins: &BTreeMap<&'static str, PathBuf>,
    env: &[(String, String)],
    libdevice: &Path,
    work: &Path,
    limit: Duration,
    problems: &mut Vec<String>,
) -> Result<(), String> {
    // The in-process tests compile kernels on Device::cuda(0) without Ddp::init: give them
    // the CUDA_PATH the same lookup finds.
    let cuda_path = ddp_nccl::cuda_toolkit::cuda_path_for(libdevice, &work.join("cuda"))
        .map_err(|e| e.to_string())?;
    let worker_dir = bins["syncbn_worker"]
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    // The GPU check's smoke row, then the CUDA SyncBatchNorm tests.
    let smoke = crate::gpu_check::rows::SMOKE_TEST.to_string();
    let sbn = &bins["sync_batch_norm-tests"];
    let mut list = Command::new(sbn);
    list.args(["--list", "--ignored", "--format=terse"]);
    let listing =
        process::output_within(&mut list, Duration::from_secs(60), &work.join("list.tmp"))
            .ok_or_else(|| format!("{} --list failed or took over 60 s", sbn.display()))?;
    let mut runs: Vec<(&PathBuf, String)> = vec![(&bins["burn-ddp-tests"], smoke)];
    runs.extend(
        crate::gpu_check::rows::listed_tests(&listing)
            .into_iter()
            // The NCCL tests need libnccl, whose CUDA runtime the stand-in does not serve (it
            // calls cuGetProcAddress): they are for the GPU check.
            .filter(|n| n.contains("cuda") && !n.contains("two_gpus") && !n.contains("nccl"))
            .map(|n| (sbn, n)),
    );
    if runs.len() < 2 {
        problems.push(format!("{} lists no CUDA test", sbn.display()));
    }
    for (tests, name) in &runs {
        let log = work.join(format!("{}.log", name.replace("::", "__")));
        let mut cmd = Command::new(tests.as_path());
        cmd.args(crate::gpu_check::rows::one_ignored_test_args(name))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("CUDA_PATH", &cuda_path)
            .env(crate::gpu_check::machine::TESTS_BIN_DIR_VAR, &worker_dir);
        let f = process::run_until(&mut cmd, Instant::now() + limit, &log)
            .map_err(|e| e.to_string())?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let outcome = match f.exit {
            Exit::Code(0) => "exit 0".to_string(),
            Exit::TimedOut => {
                problems.push(format!("{name}: past its {} s deadline", limit.as_secs()));
                "timed out".into()
            }
            other => format!("{other} (results are meaningless here: not asserted)"),
        };
        println!(
            "ptx-check: {name}: {outcome} in {:.1} s",
            f.elapsed.as_secs_f64()
        );
        problems.extend(missing_symbols(&text, name));
    }
    Ok(())
}

/// Driver calls the stand-in lacks (cudarc panics `Missing symbol cuX`).
fn missing_symbols(log: &str, program: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("Missing symbol"))
        .map(|l| format!("{program}: the stand-in lacks a driver call: {}", l.trim()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `ptxas --version`'s release, e.g. `13.5`.
fn ptxas_version(ptxas: &Path) -> String {
    Command::new(ptxas)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.split("release ")
                .nth(1)
                .and_then(|r| r.split(',').next())
                .map(str::to_string)
        })
        .unwrap_or_else(|| "?".into())
}

/// Builds the stand-in (`cargo build -p cuda-standin`) and returns its `.so`.
fn build_standin(root: &Path) -> Result<PathBuf, String> {
    let out = cargo_tasks::cargo()
        .current_dir(root)
        .args(["build", "-p", "cuda-standin", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build -p cuda-standin failed: {}",
            out.status
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "cuda_standin")
        .flat_map(|m| {
            m["filenames"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|f| f.as_str().map(PathBuf::from))
        })
        .find(|f| f.extension().is_some_and(|x| x == "so"))
        .ok_or_else(|| "cargo built no libcuda_standin.so".to_string())
}

/// The CUDA binaries of CI's build (its features and packages: after `cargo xtask ci` it builds
/// nothing and only names them), or with `nvrtc` of the fallback build.
fn cuda_binaries(root: &Path, nvrtc: bool) -> Result<BTreeMap<&'static str, PathBuf>, String> {
    let args = if nvrtc {
        cargo_tasks::CUDA_NVRTC_BUILD_ARGS.concat()
    } else {
        build::CUDA_BUILD_ARGS.concat()
    };
    eprintln!(
        "==> ptx-check: the CUDA binaries of {}: cargo {}",
        if nvrtc {
            "the NVRTC build"
        } else {
            "CI's build"
        },
        args.join(" ")
    );
    let out = cargo_tasks::cargo()
        .current_dir(root)
        .args(&args)
        .arg("--message-format=json")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "CI's build of the CUDA binaries failed: {}",
            out.status
        ));
    }
    let json = String::from_utf8_lossy(&out.stdout);
    PICKS
        .iter()
        .map(|p| {
            build::find_executable(&json, p)
                .map(|exe| (p.file, exe))
                .ok_or_else(|| format!("no {} executable {} in cargo's output", p.kind, p.target))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_is_tallied_once_per_module() {
        let text = "module\taa\tok\t9.0\tsm_90a\tlibdevice\ttrain-cnn\tk1\n\
                    module\taa\tok\t9.0\tsm_90a\tlibdevice\tsync_batch_norm\tk1\n\
                    module\tbb\tok\t9.0\tsm_90a\t-\ttrain-cnn\tk2,k3\n\
                    module\tcc\tfailed\t9.0\tsm_90a\t-\ttrain-cnn\tptxas exit 255: bad\n\
                    launch\tk1\tok\t\n\
                    launch\tk2\tok\t\n\
                    launch\tk1\tok\t\n\
                    launch\tk3\trefused\t2048 threads per block > 1024\n\
                    garbage\n";
        let t = Tally::of(&parse_record(text));
        assert_eq!(t.assembled, 2);
        assert_eq!(t.compiled(), 3);
        assert_eq!(t.refused_modules.len(), 1);
        assert_eq!(t.libdevice_modules, 1);
        assert_eq!(t.entries, 3);
        assert_eq!(t.launched, 2);
        assert_eq!(t.refused_launches.len(), 1);
        assert_eq!(
            t.versions.iter().collect::<Vec<_>>(),
            ["PTX 9.0 for sm_90a"]
        );
        assert_eq!(t.per_program["train-cnn"], 3);
        assert_eq!(t.per_program["sync_batch_norm"], 1);
    }
}
