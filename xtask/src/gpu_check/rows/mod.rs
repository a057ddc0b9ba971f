//! The checks `gpu-check run` makes, in order of importance (a spent budget skips the last),
//! and how each becomes rows of the table.
//!
//! A [`Check`] is either every `#[ignore]`d test of a libtest binary (one row per test, tests
//! named `two_gpus_*` skipped with fewer than two GPUs) or a [`Task`] this module performs with
//! the unpacked programs. Every child process runs under a deadline (see [`super::process`]);
//! a failed row never stops the table.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::process::{self, Exit};
use super::report::{self, Report, Row, Status};

/// The limit of one test of a libtest binary.
pub const TEST_LIMIT_SECS: u64 = 150;

/// A row is not started with less than this left of the run's budget.
pub const MIN_LEFT_SECS: u64 = 20;

/// Kept free at the end of the budget for the report.
pub const RESERVE_SECS: u64 = 5;

/// The relative difference allowed between the CUDA and the CPU run's last-epoch losses: f32
/// sums in another order on each device keep them from agreeing bitwise.
pub const CUDA_VS_CPU_TOLERANCE: f64 = 1e-3;

/// Where the train-cnn runs of the checks write.
const TRAIN_ROOT: &str = "/tmp/gpu-check-train";

/// Batch size of the train-cnn runs (for ms/step).
const BATCH: u32 = 32;

/// What a check needs of the machine beyond the bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// A loadable `libcuda` (without one the check fails with the driver error, unrun).
    Cuda,
    /// Only the CPU.
    Cpu,
}

/// A check done by this module rather than by a test binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// train-cnn, one epoch on CUDA and on the CPU with the same seed: losses agree to
    /// [`CUDA_VS_CPU_TOLERANCE`].
    CompareBackends,
    /// train-cnn as a world of one under ddprun with `DDP_NCCL=required`.
    DdprunNccl,
    /// samples/s of train-cnn on cuda, wgpu and cpu; BatchNorm vs SyncBatchNorm on CUDA.
    StepTimes,
    /// `xtask train --gpus 1 --program train-cnn` (this binary).
    XtaskTrain,
    /// ddp-comm's shared-memory all-reduce at 2, 4, 8 ranks, PyTorch gloo beside it.
    CpuScaling,
}

/// How a check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every `#[ignore]`d test of this binary of the bundle, one row each.
    Libtest(&'static str),
    /// A task with a limit for the whole row.
    Task(Task, u64),
}

/// One check of the table.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    /// The row's label (a test's row is `LABEL::name`).
    pub label: &'static str,
    /// How it runs.
    pub kind: Kind,
    /// What it needs.
    pub needs: Needs,
    /// The bundle's programs it runs (a missing one makes the row MISSING).
    pub binaries: &'static [&'static str],
}

/// The checks, in order of importance.
pub const CHECKS: &[Check] = &[
    Check {
        label: "SyncBatchNorm on CUDA (kernels, NCCL, host-staged)",
        kind: Kind::Libtest("sync_batch_norm-tests"),
        needs: Needs::Cuda,
        binaries: &["sync_batch_norm-tests", "syncbn_worker"],
    },
    Check {
        label: "burn-ddp on CUDA (NCCL device buffers, gradient path)",
        kind: Kind::Libtest("burn-ddp-tests"),
        needs: Needs::Cuda,
        binaries: &["burn-ddp-tests"],
    },
    Check {
        label: "train-cnn 1 epoch: cuda vs cpu, same seed",
        kind: Kind::Task(Task::CompareBackends, 240),
        needs: Needs::Cuda,
        binaries: &["train-cnn"],
    },
    Check {
        label: "DDP world of one via ddprun: NCCL gradients + SyncBatchNorm over NCCL",
        kind: Kind::Task(Task::DdprunNccl, 180),
        needs: Needs::Cuda,
        binaries: &["ddprun", "train-cnn"],
    },
    Check {
        label: "DDP equivalence on CUDA (1 GPU over NCCL, 2 ranks)",
        kind: Kind::Libtest("ddp-tests"),
        needs: Needs::Cuda,
        binaries: &["ddp-tests", "ddp_worker"],
    },
    Check {
        label: "step time: cuda / wgpu / cpu; BatchNorm vs SyncBatchNorm",
        kind: Kind::Task(Task::StepTimes, 300),
        needs: Needs::Cuda,
        binaries: &["train-cnn"],
    },
    Check {
        label: "ddp-comm NCCL transport",
        kind: Kind::Libtest("ddp-comm-nccl-tests"),
        needs: Needs::Cuda,
        binaries: &["ddp-comm-nccl-tests"],
    },
    Check {
        label: "cargo xtask train --gpus 1 (the xtask binary, --program)",
        kind: Kind::Task(Task::XtaskTrain, 150),
        needs: Needs::Cuda,
        binaries: &["train-cnn"],
    },
    Check {
        label: "CPU all-reduce scaling: 2, 4, 8 ranks (shm), gloo beside it",
        kind: Kind::Task(Task::CpuScaling, 200),
        needs: Needs::Cpu,
        binaries: &["ddprun", "allreduce_bench"],
    },
];

/// What the rows need to know about the machine and the run.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The unpacked binaries.
    pub bin_dir: PathBuf,
    /// One log per row.
    pub log_dir: PathBuf,
    /// This xtask binary (the [`Task::XtaskTrain`] row runs it).
    pub xtask: PathBuf,
    /// Variables every child gets (libraries, NCCL, CubeCL, DDP settings).
    pub env: Vec<(String, String)>,
    /// CUDA devices visible.
    pub gpus: usize,
    /// Why `libcuda` cannot be used here (`None`: it loads).
    pub cuda_error: Option<String>,
    /// When the run started.
    pub start: Instant,
    /// The run's whole budget.
    pub budget: Duration,
}

impl Ctx {
    fn left(&self) -> Duration {
        self.budget.saturating_sub(self.start.elapsed())
    }

    fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }
}

/// The limit a row gets: `limit`, or what is left of the budget minus [`RESERVE_SECS`];
/// `None` (skip the row) when less than [`MIN_LEFT_SECS`] are left.
pub fn row_limit(limit: u64, left: Duration) -> Option<u64> {
    let left = left.as_secs();
    if left < MIN_LEFT_SECS {
        None
    } else {
        Some(limit.min(left - RESERVE_SECS))
    }
}

/// Why the test `name` is not run on a machine with `gpus` CUDA devices, if it is not.
pub fn gpu_skip(name: &str, gpus: usize) -> Option<String> {
    (name.contains("two_gpus") && gpus < 2)
        .then(|| format!("needs 2 CUDA devices ({gpus} visible)"))
}

/// The `#[ignore]`d tests of `NAME: test` lines (libtest's `--list --ignored --format=terse`),
/// without the rank programs' entry points (`child_entry`), which are not checks.
pub fn listed_tests(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_suffix(": test"))
        .filter(|n| !n.contains("child_entry"))
        .map(str::to_string)
        .collect()
}

/// Runs every check into `report` (rows and notes).
pub fn run_all(ctx: &Ctx, checks: &[Check], report: &mut Report) {
    for check in checks {
        let missing: Vec<&str> = check
            .binaries
            .iter()
            .copied()
            .filter(|b| !ctx.bin_dir.join(b).is_file())
            .collect();
        match check.kind {
            Kind::Libtest(binary) => {
                if !missing.is_empty() {
                    // Without libcuda that is the news, not the missing binary.
                    report.rows.extend(gate(ctx, check, &missing));
                } else {
                    run_libtest(ctx, check, binary, report);
                }
            }
            Kind::Task(task, limit) => {
                let gate = gate(ctx, check, &missing);
                if let Some(row) = gate {
                    report.rows.push(row);
                    continue;
                }
                let Some(limit) = row_limit(limit, ctx.left()) else {
                    report.rows.push(skipped(check.label, "time budget spent"));
                    continue;
                };
                let log = log_path(ctx, check.label);
                let row = run_task(ctx, task, check.label, limit, &log);
                collect(report, &row, &log);
                report.rows.push(row);
            }
        }
    }
}

/// The row of a check that cannot run: MISSING binaries, or FAIL without libcuda.
fn gate(ctx: &Ctx, check: &Check, missing: &[&str]) -> Option<Row> {
    if let (Needs::Cuda, Some(e)) = (check.needs, &ctx.cuda_error) {
        return Some(Row {
            label: check.label.into(),
            status: Status::Fail,
            secs: None,
            limit: None,
            // The driver error without ddp-comm's "I/O error during …" prefix.
            note: report::cut(e.find("libcuda not found").map_or(e, |i| &e[i..]), 120),
        });
    }
    (!missing.is_empty()).then(|| missing_row(check.label, missing))
}

fn missing_row(label: &str, missing: &[&str]) -> Row {
    Row {
        label: label.into(),
        status: Status::Missing,
        secs: None,
        limit: None,
        note: format!(
            "not in the bundle: {} (cargo xtask gpu-check build)",
            missing.join(", ")
        ),
    }
}

fn skipped(label: &str, why: &str) -> Row {
    Row {
        label: label.into(),
        status: Status::Skipped,
        secs: None,
        limit: None,
        note: why.into(),
    }
}

fn log_path(ctx: &Ctx, label: &str) -> PathBuf {
    let name: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let path = ctx.log_dir.join(format!("{name}.log"));
    let _ = std::fs::remove_file(&path);
    path
}

/// Adds a finished row's BENCH/OUTCOME lines and, for a failure, an excerpt of its log.
fn collect(report: &mut Report, row: &Row, log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    report.notes.extend(report::bench_and_outcome_lines(&text));
    if row.status.is_failure() {
        report.notes.push(format!("--- {}", row.label));
        if !row.note.is_empty() {
            report.notes.push(format!("    {}", row.note));
        }
        report.notes.extend(report::failure_excerpt(&text));
    }
}

fn run_libtest(ctx: &Ctx, check: &Check, binary: &str, report: &mut Report) {
    let bin = ctx.bin_dir.join(binary);
    let list_log = ctx.log_dir.join(format!("{binary}.list"));
    let mut list = ctx.command(&bin);
    list.args(["--list", "--ignored", "--format=terse"]);
    let Some(listing) = process::output_within(&mut list, Duration::from_secs(60), &list_log)
    else {
        report.rows.push(Row {
            label: check.label.into(),
            status: Status::Fail,
            secs: None,
            limit: None,
            note: format!("{binary} --list failed (see ldd notes)"),
        });
        return;
    };
    let names = listed_tests(&listing);
    if names.is_empty() {
        report.rows.push(Row {
            label: check.label.into(),
            status: Status::Fail,
            secs: None,
            limit: None,
            note: format!("{binary} lists no #[ignore]d test"),
        });
        return;
    }
    for name in names {
        let label = format!("{}::{name}", check.label);
        if let Some(why) = gpu_skip(&name, ctx.gpus) {
            report.rows.push(skipped(&label, &why));
            continue;
        }
        if let Some(row) = gate(ctx, check, &[]) {
            report.rows.push(Row { label, ..row });
            continue;
        }
        let Some(limit) = row_limit(TEST_LIMIT_SECS, ctx.left()) else {
            report.rows.push(skipped(&label, "time budget spent"));
            continue;
        };
        let log = log_path(ctx, &format!("{binary}__{name}"));
        let mut cmd = ctx.command(&bin);
        cmd.args([
            "--exact",
            &name,
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ]);
        let deadline = Instant::now() + Duration::from_secs(limit);
        let row = match process::run_until(&mut cmd, deadline, &log) {
            Ok(f) => {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let (status, note) = match f.exit {
                    Exit::Code(0) => (Status::Pass, report::first_outcome(&text)),
                    Exit::TimedOut => (Status::Timeout, Some(format!("killed after {limit} s"))),
                    other => (
                        Status::Fail,
                        Some(report::panic_message(&text).unwrap_or_else(|| other.to_string())),
                    ),
                };
                Row {
                    label,
                    status,
                    secs: Some(f.elapsed.as_secs_f64()),
                    limit: Some(limit),
                    note: note.unwrap_or_default(),
                }
            }
            Err(e) => Row {
                label,
                status: Status::Fail,
                secs: None,
                limit: Some(limit),
                note: e.to_string(),
            },
        };
        collect(report, &row, &log);
        report.rows.push(row);
    }
}

/// How a task step ended badly.
#[derive(Debug)]
enum StepError {
    /// A child ran past the row's deadline.
    TimedOut,
    /// Anything else: the note.
    Failed(String),
}

impl From<String> for StepError {
    fn from(s: String) -> Self {
        StepError::Failed(s)
    }
}

/// The children of one task row: one deadline, one log.
struct Steps<'a> {
    ctx: &'a Ctx,
    deadline: Instant,
    log: &'a Path,
}

impl Steps<'_> {
    /// A program of the bundle.
    fn bin(&self, name: &str) -> PathBuf {
        self.ctx.bin_dir.join(name)
    }

    /// Runs `program args` with `env` on top of the row environment; returns how it ended
    /// and what it printed.
    fn run(
        &self,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(Exit, String), StepError> {
        let before = std::fs::metadata(self.log).map_or(0, |m| m.len()) as usize;
        self.line(&format!("$ {} {}", program.display(), args.join(" ")));
        let mut cmd = self.ctx.command(program);
        cmd.args(args).envs(env.iter().copied());
        let f = process::run_until(&mut cmd, self.deadline, self.log)
            .map_err(|e| StepError::Failed(e.to_string()))?;
        let text = std::fs::read(self.log).unwrap_or_default();
        let new = String::from_utf8_lossy(text.get(before..).unwrap_or_default()).into_owned();
        if f.exit == Exit::TimedOut {
            return Err(StepError::TimedOut);
        }
        Ok((f.exit, new))
    }

    /// [`Self::run`], failing unless it exits 0.
    fn run_ok(
        &self,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<String, StepError> {
        let (exit, out) = self.run(program, args, env)?;
        if exit.success() {
            Ok(out)
        } else {
            Err(StepError::Failed(format!(
                "{} {}: {exit}",
                program.display(),
                args.first().copied().unwrap_or("")
            )))
        }
    }

    /// Appends a line to the row's log (OUTCOME and BENCH lines end up below the table).
    fn line(&self, line: &str) {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log)
        {
            let _ = writeln!(f, "{line}");
        }
    }

    /// A short train-cnn run into `TRAIN_ROOT/name`.
    fn train(&self, name: &str, flags: &[&str]) -> Result<PathBuf, StepError> {
        let out = Path::new(TRAIN_ROOT).join(name);
        let _ = std::fs::remove_dir_all(&out);
        let out_s = out.display().to_string();
        let batch = BATCH.to_string();
        let mut args = vec![
            "--seed",
            "7",
            "--train-size",
            "2000",
            "--eval-size",
            "500",
            "--batch-size",
            &batch,
            "--no-progress",
            "--out",
            &out_s,
        ];
        args.extend_from_slice(flags);
        self.run_ok(&self.bin("train-cnn"), &args, &[])?;
        Ok(out)
    }
}

fn run_task(ctx: &Ctx, task: Task, label: &str, limit: u64, log: &Path) -> Row {
    let start = Instant::now();
    let steps = Steps {
        ctx,
        deadline: start + Duration::from_secs(limit),
        log,
    };
    let result = match task {
        Task::CompareBackends => compare_backends(&steps),
        Task::DdprunNccl => ddprun_nccl(&steps),
        Task::StepTimes => step_times(&steps),
        Task::XtaskTrain => xtask_train(&steps),
        Task::CpuScaling => cpu_scaling(&steps),
    };
    let (status, note) = match result {
        Ok(()) => (Status::Pass, String::new()),
        Err(StepError::TimedOut) => (Status::Timeout, format!("killed after {limit} s")),
        Err(StepError::Failed(note)) => (Status::Fail, report::cut(&note, 200)),
    };
    Row {
        label: label.into(),
        status,
        secs: Some(start.elapsed().as_secs_f64()),
        limit: Some(limit),
        note,
    }
}

/// The last epoch of a train-cnn run's `metrics.json`.
fn last_epoch(run: &Path) -> Result<serde_json::Value, String> {
    let file = run.join("metrics.json");
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    v.as_array()
        .and_then(|a| a.last())
        .cloned()
        .ok_or_else(|| format!("{}: no epoch", file.display()))
}

fn field(epoch: &serde_json::Value, key: &str) -> Result<f64, String> {
    epoch
        .get(key)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| format!("metrics.json has no number {key}"))
}

/// The OUTCOME lines comparing two runs' last epochs, and the worst relative difference of
/// their losses.
pub fn compare_epochs(
    (a_name, a): (&str, &serde_json::Value),
    (b_name, b): (&str, &serde_json::Value),
    tolerance: f64,
) -> Result<(Vec<String>, f64), String> {
    let mut lines = Vec::new();
    let mut worst: f64 = 0.0;
    for key in ["train_loss", "eval_loss"] {
        let (x, y) = (field(a, key)?, field(b, key)?);
        let rel = (x - y).abs() / y.abs().max(1e-12);
        worst = worst.max(rel);
        lines.push(format!(
            "OUTCOME {key}: {a_name} {x:.6}, {b_name} {y:.6} (relative difference {rel:.1e}, bound {tolerance})"
        ));
    }
    lines.push(format!(
        "OUTCOME eval accuracy: {:.4} vs {:.4}",
        field(a, "eval_accuracy")?,
        field(b, "eval_accuracy")?
    ));
    Ok((lines, worst))
}

fn compare_backends(s: &Steps) -> Result<(), StepError> {
    let cuda = s.train("cuda", &["--backend", "cuda", "--sync-bn", "--epochs", "1"])?;
    let cpu = s.train("cpu", &["--backend", "cpu", "--sync-bn", "--epochs", "1"])?;
    let (a, b) = (last_epoch(&cuda)?, last_epoch(&cpu)?);
    let (lines, worst) = compare_epochs(("cuda", &a), ("cpu", &b), CUDA_VS_CPU_TOLERANCE)?;
    for l in &lines {
        s.line(l);
    }
    if worst > CUDA_VS_CPU_TOLERANCE {
        return Err(StepError::Failed(format!(
            "losses differ by {worst:.1e} (relative), above {CUDA_VS_CPU_TOLERANCE}"
        )));
    }
    Ok(())
}

fn ddprun_nccl(s: &Steps) -> Result<(), StepError> {
    let train = s.bin("train-cnn").display().to_string();
    let out = s.run_ok(
        &s.bin("ddprun"),
        &[
            "--nproc-per-node",
            "1",
            "--",
            &train,
            "--backend",
            "cuda",
            "--sync-bn",
            "--epochs",
            "1",
            "--train-size",
            "2000",
            "--eval-size",
            "500",
            "--no-progress",
            "--out",
            "/tmp/gpu-check-ddprun",
        ],
        &[("DDP_NCCL", "required"), ("RUST_LOG", "burn_ddp=info")],
    )?;
    if !out.contains("one-rank NCCL communicator") {
        return Err(
            "no NCCL communicator was created (no 'one-rank NCCL communicator' log line)"
                .to_string()
                .into(),
        );
    }
    s.line("OUTCOME ddprun world of one: gradients and SyncBatchNorm statistics over NCCL");
    Ok(())
}

/// The step-time runs: name and train-cnn flags.
const STEP_RUNS: [(&str, &[&str]); 4] = [
    ("cuda-bn", &["--backend", "cuda"]),
    ("cuda-syncbn", &["--backend", "cuda", "--sync-bn"]),
    ("wgpu-syncbn", &["--backend", "wgpu", "--sync-bn"]),
    ("cpu-syncbn", &["--backend", "cpu", "--sync-bn"]),
];

/// The BENCH lines of the step-time table from each run's samples/s (`None`: it failed).
pub fn step_time_lines(rates: &[(&str, Option<f64>)], batch: u32) -> Vec<String> {
    let mut lines = vec![format!(
        "BENCH | train-cnn run (last epoch, batch {batch}) | samples/s | ms/step | vs cpu |"
    )];
    let rate = |name: &str| rates.iter().find(|(n, _)| *n == name).and_then(|(_, r)| *r);
    let cpu = rate("cpu-syncbn");
    for (name, r) in rates {
        match r {
            Some(sps) => lines.push(format!(
                "BENCH | {name} | {sps:.0} | {:.2} | {} |",
                1000.0 * f64::from(batch) / sps,
                cpu.map_or("-".to_string(), |c| format!("{:.2}x", sps / c))
            )),
            None => lines.push(format!("OUTCOME {name}: no metrics (the run failed)")),
        }
    }
    if let (Some(bn), Some(sync)) = (rate("cuda-bn"), rate("cuda-syncbn")) {
        lines.push(format!(
            "BENCH | SyncBatchNorm vs BatchNorm step time on CUDA (world 1) | {:+.1} % | | |",
            100.0 * (bn / sync - 1.0)
        ));
    }
    lines
}

fn step_times(s: &Steps) -> Result<(), StepError> {
    let mut rates = Vec::new();
    for (name, flags) in STEP_RUNS {
        // Epoch 1 includes compiling the kernels; the table reads epoch 2.
        let mut args = flags.to_vec();
        args.extend(["--epochs", "2"]);
        let rate = match s.train(name, &args) {
            Ok(run) => last_epoch(&run)
                .and_then(|e| field(&e, "samples_per_sec"))
                .ok(),
            Err(StepError::TimedOut) => return Err(StepError::TimedOut),
            Err(StepError::Failed(e)) => {
                s.line(&format!("gpu-check: {name} failed: {e}"));
                None
            }
        };
        rates.push((name, rate));
    }
    for l in step_time_lines(&rates, BATCH) {
        s.line(&l);
    }
    let failed: Vec<&str> = rates
        .iter()
        .filter(|r| r.1.is_none())
        .map(|r| r.0)
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("no step time for {}", failed.join(", ")).into())
    }
}

fn xtask_train(s: &Steps) -> Result<(), StepError> {
    let train = s.bin("train-cnn").display().to_string();
    s.run_ok(
        &s.ctx.xtask,
        &[
            "train",
            "--gpus",
            "1",
            "--epochs",
            "1",
            "--program",
            &train,
            "--out",
            "/tmp/gpu-check-xtask",
            "--",
            "--train-size",
            "2000",
            "--eval-size",
            "500",
            "--no-progress",
        ],
        &[],
    )?;
    Ok(())
}

/// `BENCH |` lines of allreduce_bench's table rows (the lines that start with a size).
pub fn allreduce_bench_lines(output: &str, ranks: u32) -> Vec<String> {
    output
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| format!("BENCH | ddp-comm shm, {ranks} ranks | {}", l.trim()))
        .collect()
}

fn cpu_scaling(s: &Steps) -> Result<(), StepError> {
    let bench = s.bin("allreduce_bench").display().to_string();
    for n in [2u32, 4, 8] {
        let out = s.run_ok(
            &s.bin("ddprun"),
            &[
                "--nproc-per-node",
                &n.to_string(),
                "--no-prefix",
                "--",
                &bench,
                "--sizes",
                "1M,25M",
                "--transport",
                "shm",
            ],
            &[],
        )?;
        for l in allreduce_bench_lines(&out, n) {
            s.line(&l);
        }
    }
    // PyTorch gloo beside it, where this machine's Python has torch (a comparison only: its
    // failure does not fail the row).
    let gloo = s.bin("gloo_allreduce.py");
    let has_torch = gloo.is_file()
        && s.run(
            Path::new("python3"),
            &["-c", "import torch.distributed"],
            &[],
        )
        .is_ok_and(|(e, _)| e.success());
    if !has_torch {
        s.line("OUTCOME no torch on this machine (or no gloo_allreduce.py): gloo not measured");
        return Ok(());
    }
    let gloo = gloo.display().to_string();
    for n in [2u32, 4, 8] {
        let nproc = n.to_string();
        match s.run(
            Path::new("python3"),
            &[
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                &nproc,
                &gloo,
                "--sizes",
                "1M,25M",
            ],
            &[],
        ) {
            Ok((e, _)) if e.success() => {}
            Ok((e, _)) => s.line(&format!("gpu-check: gloo at {n} ranks failed ({e})")),
            Err(StepError::TimedOut) => return Err(StepError::TimedOut),
            Err(StepError::Failed(e)) => s.line(&format!("gpu-check: gloo at {n} ranks: {e}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn limits_shrink_to_the_budget_and_rows_are_skipped_when_it_is_spent() {
        assert_eq!(row_limit(150, Duration::from_secs(450)), Some(150));
        assert_eq!(row_limit(150, Duration::from_secs(100)), Some(95));
        assert_eq!(row_limit(150, Duration::from_secs(20)), Some(15));
        assert_eq!(row_limit(150, Duration::from_secs(19)), None);
        assert_eq!(row_limit(150, Duration::ZERO), None);
    }

    #[test]
    fn two_gpu_tests_need_two_devices() {
        assert!(gpu_skip("two_gpus_uneven_batches", 0).is_some());
        assert_eq!(
            gpu_skip("nccl::two_gpus_all_reduce", 1).as_deref(),
            Some("needs 2 CUDA devices (1 visible)")
        );
        assert_eq!(gpu_skip("two_gpus_uneven_batches", 2), None);
        assert_eq!(gpu_skip("one_gpu_kernels", 1), None);
        assert_eq!(gpu_skip("one_gpu_kernels", 0), None);
    }

    #[test]
    fn listings_drop_the_rank_entry_points() {
        let listing =
            "kernels::f32: test\nrank::child_entry: test\ntwo_gpus_x: test\nbench: benchmark\n";
        assert_eq!(listed_tests(listing), ["kernels::f32", "two_gpus_x"]);
    }

    #[test]
    fn cuda_and_cpu_losses_are_compared_relatively() {
        let a = serde_json::json!({"train_loss": 1.0005, "eval_loss": 2.0, "eval_accuracy": 0.5});
        let b = serde_json::json!({"train_loss": 1.0, "eval_loss": 2.0, "eval_accuracy": 0.5});
        let (lines, worst) = compare_epochs(("cuda", &a), ("cpu", &b), 1e-3).unwrap();
        assert!((worst - 5e-4).abs() < 1e-9, "{worst}");
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].starts_with("OUTCOME train_loss: cuda 1.000500, cpu 1.000000"),
            "{}",
            lines[0]
        );
        let bad = serde_json::json!({"train_loss": 1.0});
        assert!(compare_epochs(("cuda", &bad), ("cpu", &b), 1e-3).is_err());
    }

    #[test]
    fn step_time_table() {
        let lines = step_time_lines(
            &[
                ("cuda-bn", Some(4000.0)),
                ("cuda-syncbn", Some(3200.0)),
                ("wgpu-syncbn", None),
                ("cpu-syncbn", Some(400.0)),
            ],
            32,
        );
        assert_eq!(lines[1], "BENCH | cuda-bn | 4000 | 8.00 | 10.00x |");
        assert_eq!(lines[3], "OUTCOME wgpu-syncbn: no metrics (the run failed)");
        assert_eq!(
            lines[5],
            "BENCH | SyncBatchNorm vs BatchNorm step time on CUDA (world 1) | +25.0 % | | |"
        );
    }

    #[test]
    fn allreduce_rows_become_bench_lines() {
        let out = "launch -> first barrier done (2 ranks): 3.0 ms\n  size  median\n1M  12 us\n25M 300 us\n";
        assert_eq!(
            allreduce_bench_lines(out, 2),
            [
                "BENCH | ddp-comm shm, 2 ranks | 1M  12 us",
                "BENCH | ddp-comm shm, 2 ranks | 25M 300 us"
            ]
        );
    }

    fn script(dir: &Path, name: &str, body: &str) {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A stand-in for a libtest binary: lists three tests, passes `ok`, fails `bad`, and
    /// records what it ran.
    const FAKE_LIBTEST: &str = r#"
if [ "$1" = --list ]; then
  printf 'ok: test\nbad: test\ntwo_gpus_pair: test\nworker::child_entry: test\n'; exit 0
fi
echo "$3" >> "$DDP_TESTS_BIN_DIR/ran"
case "$2" in
  ok) echo "test ok ... OUTCOME all good"; exit 0 ;;
  bad) echo "thread 'ok' panicked at tests/x.rs:1:1:"; echo "wrong sum"; exit 101 ;;
  two_gpus_pair) exit 0 ;;
esac
exit 3
"#;

    fn ctx(dir: &Path, gpus: usize, cuda_error: Option<&str>) -> Ctx {
        let bin_dir = dir.join("bin");
        let log_dir = dir.join("logs");
        std::fs::create_dir_all(&bin_dir).unwrap();
        std::fs::create_dir_all(&log_dir).unwrap();
        script(&bin_dir, "fake-tests", FAKE_LIBTEST);
        Ctx {
            env: vec![("DDP_TESTS_BIN_DIR".into(), bin_dir.display().to_string())],
            bin_dir,
            log_dir,
            xtask: PathBuf::from("/nonexistent/xtask"),
            gpus,
            cuda_error: cuda_error.map(str::to_string),
            start: Instant::now(),
            budget: Duration::from_secs(300),
        }
    }

    const FAKE_CHECK: Check = Check {
        label: "fake",
        kind: Kind::Libtest("fake-tests"),
        needs: Needs::Cuda,
        binaries: &["fake-tests"],
    };

    fn statuses(r: &Report) -> Vec<(String, Status)> {
        r.rows.iter().map(|r| (r.label.clone(), r.status)).collect()
    }

    #[test]
    fn one_gpu_skips_the_two_gpu_tests_and_a_failure_does_not_stop_the_table() {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(dir.path(), 1, None);
        let missing = Check {
            label: "absent",
            kind: Kind::Task(Task::CpuScaling, 10),
            needs: Needs::Cpu,
            binaries: &["ddprun"],
        };
        let mut r = Report::default();
        run_all(&c, &[FAKE_CHECK, missing, FAKE_CHECK], &mut r);
        let one = [
            ("fake::ok".to_string(), Status::Pass),
            ("fake::bad".to_string(), Status::Fail),
            ("fake::two_gpus_pair".to_string(), Status::Skipped),
        ];
        let mut want = one.to_vec();
        want.push(("absent".into(), Status::Missing));
        want.extend(one);
        assert_eq!(statuses(&r), want);
        assert_eq!(r.rows[0].note, "all good");
        assert_eq!(r.rows[0].limit, Some(TEST_LIMIT_SECS));
        assert_eq!(r.rows[1].note, "wrong sum");
        assert_eq!(r.rows[2].note, "needs 2 CUDA devices (1 visible)");
        assert!(r.rows[3].note.contains("ddprun"));
        assert!(r.failed());
        assert!(r.notes.contains(&"OUTCOME all good".to_string()));
        assert!(r.notes.contains(&"--- fake::bad".to_string()));
        let ran = std::fs::read_to_string(c.bin_dir.join("ran")).unwrap();
        assert_eq!(ran, "--ignored\n--ignored\n--ignored\n--ignored\n");
    }

    #[test]
    fn two_gpus_run_every_test() {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(dir.path(), 2, None);
        let mut r = Report::default();
        run_all(&c, &[FAKE_CHECK], &mut r);
        assert_eq!(
            r.rows.iter().map(|r| r.status).collect::<Vec<_>>(),
            [Status::Pass, Status::Fail, Status::Pass]
        );
    }

    #[test]
    fn without_libcuda_cuda_rows_fail_unrun_and_a_spent_budget_skips() {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(
            dir.path(),
            0,
            Some("libcuda not found: cudarc could not load …"),
        );
        let task = Check {
            label: "cuda task",
            kind: Kind::Task(Task::CompareBackends, 10),
            needs: Needs::Cuda,
            binaries: &["train-cnn"],
        };
        let mut r = Report::default();
        run_all(&c, &[FAKE_CHECK, task], &mut r);
        assert_eq!(
            r.rows.iter().map(|r| r.status).collect::<Vec<_>>(),
            [Status::Fail, Status::Fail, Status::Skipped, Status::Fail]
        );
        assert!(r.rows[0].note.starts_with("libcuda not found"));
        assert!(r.rows[3].note.starts_with("libcuda not found"));
        assert!(!c.bin_dir.join("ran").exists(), "nothing ran");

        let spent = Ctx {
            budget: Duration::from_secs(10),
            cuda_error: None,
            ..c
        };
        let mut r = Report::default();
        run_all(&spent, &[FAKE_CHECK], &mut r);
        assert!(r.rows.iter().all(|r| r.status == Status::Skipped));
        assert!(!r.failed());
    }

    #[test]
    fn a_task_past_its_limit_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ctx(dir.path(), 0, None);
        script(&c.bin_dir, "ddprun", "sleep 30\n");
        script(&c.bin_dir, "allreduce_bench", "exit 0\n");
        c.budget = Duration::from_secs(26); // the limit becomes 26 - 5 = 21 s: too long a test
        let log = dir.path().join("t.log");
        let steps = Steps {
            ctx: &c,
            deadline: Instant::now() + Duration::from_millis(300),
            log: &log,
        };
        let t = Instant::now();
        assert!(matches!(cpu_scaling(&steps), Err(StepError::TimedOut)));
        assert!(t.elapsed() < Duration::from_secs(6));
    }

    #[test]
    fn cpu_scaling_collects_bench_lines() {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(dir.path(), 0, Some("libcuda not found"));
        // ddprun stand-in: run the program after `--` once, as one rank.
        script(
            &c.bin_dir,
            "ddprun",
            "while [ \"$1\" != -- ]; do shift; done; shift; exec \"$@\"\n",
        );
        script(
            &c.bin_dir,
            "allreduce_bench",
            "echo header; echo '1M 10 us'\n",
        );
        let check = CHECKS.iter().find(|c| c.needs == Needs::Cpu).unwrap();
        let mut r = Report::default();
        run_all(&c, std::slice::from_ref(check), &mut r);
        assert_eq!(r.rows[0].status, Status::Pass, "{:?} {:?}", r.rows, r.notes);
        assert!(
            r.notes
                .contains(&"BENCH | ddp-comm shm, 8 ranks | 1M 10 us".to_string())
        );
        assert!(r.notes.iter().any(|n| n.contains("gloo not measured")));
    }
}
