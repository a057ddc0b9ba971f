//! What every task row's steps share: [`Steps`] (the children of one row under one deadline,
//! one log), how a step fails ([`StepError`]), short train-cnn runs, and reading and comparing
//! their `metrics.json`. The task rows (`tasks.rs`, `one_gpu.rs`) import this module and
//! nothing of each other; `mod.rs` dispatches to them.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::Ctx;
use crate::gpu_check::process::{self, Exit};

/// Where the train-cnn runs of the checks write.
const TRAIN_ROOT: &str = "/tmp/gpu-check-train";

/// Batch size of the train-cnn runs (for ms/step).
pub(super) const BATCH: u32 = 32;

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
    pub(super) fn train(&self, name: &str, flags: &[&str]) -> Result<PathBuf, StepError> {
        self.train_sized(name, "2000", flags)
    }

    /// [`Self::train`] on `images` training images.
    pub(super) fn train_sized(
        &self,
        name: &str,
        images: &str,
        flags: &[&str],
    ) -> Result<PathBuf, StepError> {
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
pub(super) fn field(epoch: &serde_json::Value, key: &str) -> Result<f64, String> {
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
