//! The checks `gpu-check run` makes, in order of value (a spent budget skips the last; see
//! [`CHECKS`]), and how each becomes rows of the table.
//!
//! A [`Check`] is either every `#[ignore]`d test of a libtest binary (one row per test, tests
//! named `two_gpus_*` skipped with fewer than two GPUs) or a [`Task`] this module performs with
//! the unpacked programs. Every child process runs under a deadline (see [`super::process`]);
//! a failed row never stops the table.
//!
//! This file holds the table ([`CHECKS`]), the gating and budget helpers, the libtest runner
//! and the dispatch of a task row; the tasks are in `tasks.rs` (one process per GPU) and
//! `one_gpu.rs` (several NCCL ranks on one GPU), which share `steps.rs` and import nothing of
//! each other; the unit tests are in `tests.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::process::{self, Exit};
use super::report::{self, Report, Row, Status};

mod one_gpu;
mod steps;
mod tasks;
#[cfg(test)]
mod tests;

use steps::{StepError, Steps};
// The tasks' pure helpers stay at `rows::X`, where they were before the split; outside
// tasks.rs and steps.rs only the unit tests use them, so a build without tests sees the
// re-export unused.
#[cfg_attr(not(test), allow(unused_imports))]
pub use steps::compare_epochs;
#[cfg_attr(not(test), allow(unused_imports))]
pub use tasks::{allreduce_bench_lines, step_time_lines};

/// The note heading NCCL's `NCCL_DEBUG` lines (kept from the first row that printed any).
pub const NCCL_NOTE: &str = "--- NCCL_DEBUG=WARN lines of the first NCCL row:";

/// How many of NCCL's lines are kept.
const NCCL_LINES_KEPT: usize = 30;

/// The limit of one test of a libtest binary.
pub const TEST_LIMIT_SECS: u64 = 150;

/// A row is not started with less than this left of the run's budget.
pub const MIN_LEFT_SECS: u64 = 20;

/// Kept free at the end of the budget for the report.
pub const RESERVE_SECS: u64 = 5;

/// The relative difference allowed between the CUDA and the CPU run's losses after three
/// steps: f32 sums in another order, and CubeCL's TF32 matrix products on CUDA (a 10-bit
/// mantissa, unit roundoff 2^-11 ≈ 4.9e-4), keep them from agreeing bitwise.
pub const CUDA_VS_CPU_TOLERANCE: f64 = 1e-2;

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
    /// `xtask train --gpus 1 --program train-cnn` (this binary), then `--gpus 2
    /// --emulate-gpu-hosts`.
    XtaskTrain,
    /// ddp-comm's shared-memory all-reduce at 2, 4, 8 ranks, PyTorch gloo beside it.
    CpuScaling,
    /// train-cnn under `ddprun --emulate-gpu-hosts` at 2 and 4 ranks on one GPU, NCCL required.
    EmulatedHosts,
    /// ResNet-18 steps: Burn, burn-ddp (1 and 2 ranks on one GPU) and PyTorch, one table.
    ResnetBench,
}

/// How a check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every `#[ignore]`d test of this binary of the bundle, one row each (except those a
    /// [`Kind::Test`] row runs).
    Libtest(&'static str),
    /// One `#[ignore]`d test (binary, test name) as a row of its own, with this limit.
    Test(&'static str, &'static str, u64),
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

/// The smoke row's test in `burn-ddp-tests`.
pub const SMOKE_TEST: &str = "cuda::smoke::cuda_smoke_kernels_match_the_cpu";

/// The smoke row's test binary.
pub const SMOKE_BINARY: &str = "burn-ddp-tests";

/// The NCCL all-reduce row's test in `ddp-nccl-tests`.
pub const NCCL_RANKS_TEST: &str = "emulated_gpu_hosts_run_the_collectives_at_2_and_4_ranks";

/// The DDP-against-one-process-over-NCCL row's test in `ddp-tests`.
pub const DDP_NCCL_RANKS_TEST: &str = "cuda::nccl_ranks_match_one_process_on_the_joined_batch";

/// How many rows of [`CHECKS`] are the ones the check is for: the smoke row, then the 2-rank
/// (and 4-rank) NCCL all-reduce, DDP against one process over NCCL, and the ResNet table.
pub const FIRST_ROWS: usize = 4;

/// The checks, in order of value, so that a run its budget cuts (450 s by default) still
/// reports the first ones:
///
/// 1. the smoke row (that Burn's kernels compute on this GPU at all; 60 s limit, 1 s on an
///    H200; first, because a driver that refuses LLVM's PTX there switches the CUDA rows to
///    the NVRTC bundle),
/// 2. what no GPU has run yet and the GPU check is for ([`FIRST_ROWS`]): NCCL between 2 and 4
///    ranks, DDP against one process over NCCL, the ResNet-18 table; at their limits the first
///    three leave the ResNet row at least 160 s of the default budget (a unit test keeps that);
/// 3. the other multi-rank NCCL rows, never run on a GPU either: train-cnn on NCCL ranks,
///    SyncBatchNorm over NCCL ranks, DDP's other CUDA tests with live recovery over NCCL, the
///    NCCL transport's other tests;
/// 4. the rows that passed on an H200 (2026-12-04): SyncBatchNorm's kernels, burn-ddp on CUDA,
///    CUDA against the CPU, a world of one under ddprun, `xtask train`, step times;
/// 5. last what needs no GPU (CPU all-reduce scaling).
pub const CHECKS: &[Check] = &[
    Check {
        label: "CUDA smoke: element-wise, sum, exp/log, f16/bf16 vs CPU",
        kind: Kind::Test(SMOKE_BINARY, SMOKE_TEST, 60),
        needs: Needs::Cuda,
        binaries: &["burn-ddp-tests"],
    },
    Check {
        label: "NCCL all-reduce between 2, then 4 ranks on one GPU (emulated GPU hosts): sum and mean exact in f32, f64, bf16; broadcast, all-gather, reduce-scatter",
        kind: Kind::Test("ddp-nccl-tests", NCCL_RANKS_TEST, 90),
        needs: Needs::Cuda,
        binaries: &["ddp-nccl-tests"],
    },
    Check {
        label: "DDP against one process over NCCL: 2 ranks (SGD, Adam), 4 ranks (SGD), gradients all-reduced by NCCL",
        kind: Kind::Test("ddp-tests", DDP_NCCL_RANKS_TEST, 120),
        needs: Needs::Cuda,
        binaries: &["ddp-tests", "ddp_worker"],
    },
    Check {
        label: "ResNet-18 step time: Burn, burn-ddp 1 and 2 ranks, PyTorch beside it",
        kind: Kind::Task(Task::ResnetBench, 300),
        needs: Needs::Cuda,
        binaries: &["ddprun", "train-cnn"],
    },
    Check {
        label: "NCCL ranks on one GPU (emulated GPU hosts): ddprun 2 and 4 ranks, train-cnn, ZeRO-1",
        kind: Kind::Task(Task::EmulatedHosts, 180),
        needs: Needs::Cuda,
        binaries: &["ddprun", "train-cnn"],
    },
    Check {
        label: "SyncBatchNorm over NCCL: 2 and 4 ranks, uneven batches",
        kind: Kind::Test(
            "sync_batch_norm-tests",
            "cuda::nccl_ranks_uneven_batches_match_joined_batch",
            TEST_LIMIT_SECS,
        ),
        needs: Needs::Cuda,
        binaries: &["sync_batch_norm-tests", "syncbn_worker"],
    },
    Check {
        label: "DDP equivalence on CUDA (1 GPU over NCCL, 2 ranks); live recovery over NCCL",
        kind: Kind::Libtest("ddp-tests"),
        needs: Needs::Cuda,
        binaries: &["ddp-tests", "ddp_worker", "ddprun"],
    },
    Check {
        label: "ddp-nccl NCCL transport",
        kind: Kind::Libtest("ddp-nccl-tests"),
        needs: Needs::Cuda,
        binaries: &["ddp-nccl-tests"],
    },
    Check {
        label: "SyncBatchNorm on CUDA (kernels, NCCL world of one, host-staged)",
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
        label: "train-cnn cuda vs cpu, same seed: 3 steps (checked), 1 epoch",
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
        label: "cargo xtask train --gpus 1, --gpus 2 --emulate-gpu-hosts (the xtask binary)",
        kind: Kind::Task(Task::XtaskTrain, 240),
        needs: Needs::Cuda,
        binaries: &["train-cnn"],
    },
    Check {
        label: "step time: cuda / wgpu / cpu; BatchNorm vs SyncBatchNorm",
        kind: Kind::Task(Task::StepTimes, 300),
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
    /// What is left of the run's budget.
    fn left(&self) -> Duration {
        self.budget.saturating_sub(self.start.elapsed())
    }

    /// A command for `program` with the row environment.
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

/// Called after every row with the report so far and the new row (to print the row and
/// rewrite the partial table: a run killed by its time limit keeps what it reached).
pub type OnRow<'a> = &'a mut dyn FnMut(&Report, &Row);

/// Adds `row` to `report` and tells `on_row`.
fn push(report: &mut Report, mut row: Row, on_row: &mut dyn FnMut(&Report, &Row)) {
    if !report.label_prefix.is_empty() {
        row.label = format!("{}{}", report.label_prefix, row.label);
    }
    report.rows.push(row);
    let last = report.rows.last().expect("just pushed").clone();
    on_row(report, &last);
}

/// Runs every check into `report` (rows and notes), calling `on_row` after each row.
pub fn run_all(ctx: &Ctx, checks: &[Check], report: &mut Report, on_row: OnRow<'_>) {
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
                    if let Some(row) = gate(ctx, check, &missing) {
                        push(report, row, on_row);
                    }
                } else {
                    run_libtest(ctx, check, binary, report, on_row);
                }
            }
            Kind::Test(binary, name, limit) => {
                if let Some(row) = gate(ctx, check, &missing) {
                    push(report, row, on_row);
                    continue;
                }
                let Some(limit) = row_limit(limit, ctx.left()) else {
                    push(report, skipped(check.label, "time budget spent"), on_row);
                    continue;
                };
                let log = log_path(ctx, &format!("{binary}__{name}"));
                let row = run_one_test(ctx, check.label, binary, name, limit, &log);
                collect(report, &row, &log);
                push(report, row, on_row);
            }
            Kind::Task(task, limit) => {
                let gate = gate(ctx, check, &missing);
                if let Some(row) = gate {
                    push(report, row, on_row);
                    continue;
                }
                let Some(limit) = row_limit(limit, ctx.left()) else {
                    push(report, skipped(check.label, "time budget spent"), on_row);
                    continue;
                };
                let log = log_path(ctx, check.label);
                let row = run_task(ctx, task, check.label, limit, &log);
                collect(report, &row, &log);
                push(report, row, on_row);
            }
        }
    }
}

/// Runs `task` as the row `label` under `limit` seconds, its children's output in `log`.
fn run_task(ctx: &Ctx, task: Task, label: &str, limit: u64, log: &Path) -> Row {
    let start = Instant::now();
    let steps = Steps {
        ctx,
        deadline: start + Duration::from_secs(limit),
        log,
    };
    let result = match task {
        Task::CompareBackends => tasks::compare_backends(&steps),
        Task::DdprunNccl => tasks::ddprun_nccl(&steps),
        Task::StepTimes => tasks::step_times(&steps),
        Task::XtaskTrain => tasks::xtask_train(&steps),
        Task::CpuScaling => tasks::cpu_scaling(&steps),
        Task::EmulatedHosts => one_gpu::emulated_hosts(&steps),
        Task::ResnetBench => one_gpu::resnet_bench(&steps),
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

/// The MISSING row of a check whose bundle lacks `missing`.
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

/// A FAIL row of a check that could not run, `note` saying why.
fn unrun_failure(label: &str, note: String) -> Row {
    Row {
        label: label.into(),
        status: Status::Fail,
        secs: None,
        limit: None,
        note,
    }
}

/// The arguments that run the `#[ignore]`d test `name` of a libtest binary alone, its output
/// shown.
pub fn one_ignored_test_args(name: &str) -> [&str; 5] {
    [
        "--exact",
        name,
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ]
}

/// A SKIPPED row, `why` as its note.
fn skipped(label: &str, why: &str) -> Row {
    Row {
        label: label.into(),
        status: Status::Skipped,
        secs: None,
        limit: None,
        note: why.into(),
    }
}

/// The (removed, fresh) log of the row `label` (see [`log_file`]).
fn log_path(ctx: &Ctx, label: &str) -> PathBuf {
    let path = log_file(ctx, label);
    let _ = std::fs::remove_file(&path);
    path
}

/// The log of the smoke row, once it has run.
pub fn smoke_log(ctx: &Ctx) -> PathBuf {
    log_file(ctx, &format!("{SMOKE_BINARY}__{SMOKE_TEST}"))
}

/// The log file of the row `label`: its name with everything but `[A-Za-z0-9_.-]` as `_`.
fn log_file(ctx: &Ctx, label: &str) -> PathBuf {
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
    ctx.log_dir.join(format!("{name}.log"))
}

/// Adds a finished row's BENCH/OUTCOME lines and, for a failure, an excerpt of its log.
fn collect(report: &mut Report, row: &Row, log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    report.notes.extend(report::bench_and_outcome_lines(&text));
    // NCCL's own words (NCCL_DEBUG=WARN) from the first row that has any: the first NCCL
    // init on a new machine is where a driver, library or network mismatch shows.
    let nccl = report::nccl_lines(&text, NCCL_LINES_KEPT);
    if !nccl.is_empty() && !report.notes.iter().any(|n| n.starts_with(NCCL_NOTE)) {
        report.notes.push(format!("{NCCL_NOTE} {}", row.label));
        report
            .notes
            .extend(nccl.into_iter().map(|l| format!("    {l}")));
    }
    if row.status.is_failure() {
        report.notes.push(format!("--- {}", row.label));
        if !row.note.is_empty() {
            report.notes.push(format!("    {}", row.note));
        }
        report.notes.extend(report::failure_excerpt(&text));
    }
}

/// Every `#[ignore]`d test of `binary`, one row each (gated, skipped or run under
/// [`TEST_LIMIT_SECS`] or what is left of the budget).
fn run_libtest(
    ctx: &Ctx,
    check: &Check,
    binary: &str,
    report: &mut Report,
    on_row: &mut dyn FnMut(&Report, &Row),
) {
    let bin = ctx.bin_dir.join(binary);
    let list_log = ctx.log_dir.join(format!("{binary}.list"));
    let mut list = ctx.command(&bin);
    list.args(["--list", "--ignored", "--format=terse"]);
    let Some(listing) = process::output_within(&mut list, Duration::from_secs(60), &list_log)
    else {
        let note = format!("{binary} --list failed (see ldd notes)");
        push(report, unrun_failure(check.label, note), on_row);
        return;
    };
    // Tests with a row of their own are not repeated here.
    let names: Vec<String> = listed_tests(&listing)
        .into_iter()
        .filter(|n| {
            !CHECKS
                .iter()
                .any(|c| matches!(c.kind, Kind::Test(b, t, _) if b == binary && t == n))
        })
        .collect();
    if names.is_empty() {
        let note = format!("{binary} lists no #[ignore]d test");
        push(report, unrun_failure(check.label, note), on_row);
        return;
    }
    for name in names {
        let label = format!("{}::{name}", check.label);
        if let Some(why) = gpu_skip(&name, ctx.gpus) {
            push(report, skipped(&label, &why), on_row);
            continue;
        }
        if let Some(row) = gate(ctx, check, &[]) {
            push(report, Row { label, ..row }, on_row);
            continue;
        }
        let Some(limit) = row_limit(TEST_LIMIT_SECS, ctx.left()) else {
            push(report, skipped(&label, "time budget spent"), on_row);
            continue;
        };
        let log = log_path(ctx, &format!("{binary}__{name}"));
        let row = run_one_test(ctx, &label, binary, &name, limit, &log);
        collect(report, &row, &log);
        push(report, row, on_row);
    }
}

/// Runs the `#[ignore]`d test `name` of `binary` as the row `label`, within `limit` seconds.
fn run_one_test(ctx: &Ctx, label: &str, binary: &str, name: &str, limit: u64, log: &Path) -> Row {
    let bin = ctx.bin_dir.join(binary);
    let label = label.to_string();
    let mut cmd = ctx.command(&bin);
    cmd.args(one_ignored_test_args(name));
    let deadline = Instant::now() + Duration::from_secs(limit);
    match process::run_until(&mut cmd, deadline, log) {
        Ok(f) => {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let (status, note) = match f.exit {
                Exit::Code(0) => (Status::Pass, report::first_outcome(&text)),
                Exit::TimedOut if f.unreaped => (
                    Status::Timeout,
                    Some(format!(
                        "killed after {limit} s, not reaped {} s after SIGKILL (left behind)",
                        process::REAP_LIMIT.as_secs()
                    )),
                ),
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
    }
}
