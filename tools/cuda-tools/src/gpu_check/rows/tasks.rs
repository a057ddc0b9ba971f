//! The task rows of `gpu-check run` on one process per GPU (train-cnn runs compared across
//! backends, ddprun over NCCL in a world of one, step times, `xtask train`, CPU all-reduce
//! scaling), each one deadline and one log, and the pure helpers that turn their output into
//! OUTCOME and BENCH lines. The rows of several NCCL ranks on one GPU are in `one_gpu.rs`; what
//! both use is in `steps.rs`.

use std::path::Path;

use super::CUDA_VS_CPU_TOLERANCE;
use super::steps::{BATCH, DDPRUN_TRAIN_ARGS, StepError, Steps, compare_epochs, field, last_epoch};

/// [`super::Task::CompareBackends`]: train-cnn on CUDA and on the CPU from the same weights and data
/// order. Three steps (96 images), losses within [`CUDA_VS_CPU_TOLERANCE`]: the pass criterion.
/// Then one epoch each, compared for the record only: CubeCL multiplies f32 matrices on CUDA's
/// tensor cores in TF32 (10-bit mantissa, as cuDNN does by default in PyTorch), and the
/// difference grows with every step (2–5 % after 63 steps on an H200).
pub(super) fn compare_backends(s: &Steps) -> Result<(), StepError> {
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

/// [`super::Task::DdprunNccl`]: train-cnn as a world of one under ddprun, NCCL required and its
/// communicator logged.
pub(super) fn ddprun_nccl(s: &Steps) -> Result<(), StepError> {
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

/// [`super::Task::StepTimes`]: the [`STEP_RUNS`], two epochs each, as a table of epoch 2's rates.
pub(super) fn step_times(s: &Steps) -> Result<(), StepError> {
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

/// [`super::Task::XtaskTrain`]: `xtask train --gpus 1` with the bundle's train-cnn as `--program`.
pub(super) fn xtask_train(s: &Steps) -> Result<(), StepError> {
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

/// [`super::Task::CpuScaling`]: allreduce_bench under ddprun at 2, 4, 8 ranks, then gloo where torch
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
