//! The task rows of `gpu-check run`: the checks this module performs itself with the unpacked
//! programs (train-cnn runs compared across backends, ddprun over NCCL, step times, `xtask
//! train`, CPU all-reduce scaling), each one deadline and one log, and the pure helpers that
//! turn their output into OUTCOME and BENCH lines.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{CUDA_VS_CPU_TOLERANCE, Ctx, Task};
use crate::gpu_check::process::{self, Exit};
use crate::gpu_check::report::{self, Row, Status};

/// Where the train-cnn runs of the checks write.
const TRAIN_ROOT: &str = "/tmp/gpu-check-train";

/// Batch size of the train-cnn runs (for ms/step).
const BATCH: u32 = 32;

/// How a task step ended badly.
#[derive(Debug)]
pub(super) enum StepError {
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
pub(super) struct Steps<'a> {
    /// The run's context.
    pub(super) ctx: &'a Ctx,
    /// When every child of the row is killed.
    pub(super) deadline: Instant,
    /// The row's log: every child's output and the lines of [`Self::line`].
    pub(super) log: &'a Path,
}

impl Steps<'_> {
    /// A program of the bundle.
    pub(super) fn bin(&self, name: &str) -> PathBuf {
        self.ctx.bin_dir.join(name)
    }

    /// Runs `program args` with `env` on top of the row environment; returns how it ended
    /// and what it printed.
    pub(super) fn run(
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
    pub(super) fn run_ok(
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
    pub(super) fn line(&self, line: &str) {
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
        self.train_sized(name, "2000", flags)
    }

    /// [`Self::train`] on `images` training images.
    fn train_sized(&self, name: &str, images: &str, flags: &[&str]) -> Result<PathBuf, StepError> {
        let out = Path::new(TRAIN_ROOT).join(name);
        let _ = std::fs::remove_dir_all(&out);
        let out_s = out.display().to_string();
        let batch = BATCH.to_string();
        let mut args = vec![
            "--seed",
            "7",
            "--train-size",
            images,
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

/// Runs `task` as the row `label` under `limit` seconds, its children's output in `log`.
pub(super) fn run_task(ctx: &Ctx, task: Task, label: &str, limit: u64, log: &Path) -> Row {
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
        Task::EmulatedHosts => super::one_gpu::emulated_hosts(&steps),
        Task::ResnetBench => super::one_gpu::resnet_bench(&steps),
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
pub(super) fn last_epoch(run: &Path) -> Result<serde_json::Value, String> {
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

/// The number `key` of an epoch of `metrics.json`.
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

/// [`Task::CompareBackends`]: train-cnn on CUDA and on the CPU from the same weights and data
/// order. Three steps (96 images), losses within [`CUDA_VS_CPU_TOLERANCE`]: the pass criterion.
/// Then one epoch each, compared for the record only: CubeCL multiplies f32 matrices on CUDA's
/// tensor cores in TF32 (10-bit mantissa, as cuDNN does by default in PyTorch), and the
/// difference grows with every step (2–5 % after 63 steps on an H200).
fn compare_backends(s: &Steps) -> Result<(), StepError> {
    let flags = |backend| ["--backend", backend, "--sync-bn", "--epochs", "1"];
    let cuda = s.train_sized("cuda-3-steps", "96", &flags("cuda"))?;
    let cpu = s.train_sized("cpu-3-steps", "96", &flags("cpu"))?;
    let (a, b) = (last_epoch(&cuda)?, last_epoch(&cpu)?);
    let (lines, worst) = compare_epochs(("cuda", &a), ("cpu", &b), CUDA_VS_CPU_TOLERANCE)?;
    for l in &lines {
        s.line(&l.replace("OUTCOME ", "OUTCOME 3 steps: "));
    }
    let cuda = s.train("cuda", &flags("cuda"))?;
    let cpu = s.train("cpu", &flags("cpu"))?;
    let (a, b) = (last_epoch(&cuda)?, last_epoch(&cpu)?);
    let (lines, _) = compare_epochs(("cuda", &a), ("cpu", &b), f64::INFINITY)?;
    for l in &lines {
        s.line(&l.replace("OUTCOME ", "OUTCOME 1 epoch (TF32 drift, not checked): "));
    }
    if worst > CUDA_VS_CPU_TOLERANCE {
        return Err(StepError::Failed(format!(
            "losses after 3 steps differ by {worst:.1e} (relative), above {CUDA_VS_CPU_TOLERANCE}"
        )));
    }
    Ok(())
}

/// train-cnn's arguments under ddprun in the NCCL rows: one epoch of 2000 images on CUDA with
/// SyncBatchNorm.
pub(super) const DDPRUN_TRAIN_ARGS: [&str; 10] = [
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
];

/// [`Task::DdprunNccl`]: train-cnn as a world of one under ddprun, NCCL required and its
/// communicator logged.
fn ddprun_nccl(s: &Steps) -> Result<(), StepError> {
    let train = s.bin("train-cnn").display().to_string();
    let mut args = vec!["--nproc-per-node", "1", "--", &train];
    args.extend(DDPRUN_TRAIN_ARGS);
    args.extend(["--out", "/tmp/gpu-check-ddprun"]);
    let out = s.run_ok(
        &s.bin("ddprun"),
        &args,
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

/// [`Task::StepTimes`]: the [`STEP_RUNS`], two epochs each, as a table of epoch 2's rates.
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

/// [`Task::XtaskTrain`]: `xtask train --gpus 1` with the bundle's train-cnn as `--program`.
fn xtask_train(s: &Steps) -> Result<(), StepError> {
    let train = s.bin("train-cnn").display().to_string();
    // One rank per GPU, then two ranks on one GPU as emulated GPU hosts (NCCL between them).
    for (gpus, more) in [("1", None), ("2", Some("--emulate-gpu-hosts"))] {
        let mut args = vec!["train", "--gpus", gpus];
        args.extend(more);
        args.extend([
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
        ]);
        s.run_ok(&s.ctx.xtask, &args, &[])?;
    }
    s.line("OUTCOME cargo xtask train --gpus 1, then --gpus 2 --emulate-gpu-hosts: both trained");
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

/// [`Task::CpuScaling`]: allreduce_bench under ddprun at 2, 4, 8 ranks, then gloo where torch
/// is installed.
pub(super) fn cpu_scaling(s: &Steps) -> Result<(), StepError> {
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
