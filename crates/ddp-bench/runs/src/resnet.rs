//! `cargo xtask bench resnet`: ResNet-18 (CIFAR layout, 11.2 M parameters) training steps,
//! burn-ddp beside PyTorch in the same run: each framework alone, DDP in a world of one, and
//! DDP on N ranks with BatchNorm and with SyncBatchNorm (PyTorch's over gloo on the CPU, NCCL
//! on CUDA). On the CPU Burn's rows run twice, on Flex and on burn-cpu (CubeCL's CPU runtime,
//! train-cnn's `cpu` feature). `train-cnn bench` is the Burn side, `scripts/resnet18_torch.py`
//! the PyTorch side; both print one `RESNET {json}` line, read here into one table.

use std::path::Path;
use std::process::Command;

use crate::torch::{self, TorchPython};

// The settings, the `RESNET` line and the table live in cargo-tasks, which the GPU check
// (cuda-tools) shares; re-exported here, where `cargo xtask bench resnet` names them.
pub use cargo_tasks::resnet::{Measured, ResnetRuns, parse, table};

/// Builds `train-cnn` and `ddprun`, finds PyTorch (or installs it), runs every row and
/// prints the table.
///
/// # Errors
/// A failed build, run or PyTorch install, or a row that printed no `RESNET` line.
pub fn run(r: &ResnetRuns) -> Result<(), String> {
    if r.device != "cpu" && r.device != "cuda" {
        return Err(format!("--device {:?}: cpu or cuda", r.device));
    }
    let root = cargo_tasks::workspace_root();
    let mut build = cargo_tasks::cargo();
    build
        .current_dir(&root)
        .args(["build", "--release", "-p", "train-cnn", "-p", "ddprun"]);
    if r.device == "cuda" {
        build.args(["--features", "train-cnn/cuda"]);
    } else {
        // burn-cpu's rows beside Flex's.
        build.args(["--features", "train-cnn/cpu"]);
    }
    cargo_tasks::run(&mut build)?;
    let release = cargo_tasks::target_dir(&root).join("release");
    let torch = if r.no_torch {
        None
    } else {
        Some(torch::find_or_install()?)
    };
    let script = root.join("scripts").join("resnet18_torch.py");
    let common = r.program_args();
    let mut rows = Vec::new();
    let bench = release.join("train-cnn");
    let n = r.nproc.to_string();
    // Burn: alone, burn-ddp alone (a world of one), burn-ddp on N ranks; on the CPU once on
    // Flex and once on burn-cpu (CubeCL's CPU runtime).
    let mut burn_runs = vec![common.clone()];
    if r.device == "cpu" {
        let on_burn_cpu = ResnetRuns {
            device: "burn-cpu".into(),
            ..r.clone()
        };
        burn_runs.push(on_burn_cpu.program_args());
    }
    for args in &burn_runs {
        rows.push(measure(
            Command::new(&bench)
                .args(["bench", "--mode", "alone"])
                .args(args),
        )?);
        rows.push(measure(Command::new(&bench).arg("bench").args(args))?);
        for sync_bn in [false, true] {
            let mut cmd = Command::new(release.join("ddprun"));
            cmd.args(["--nproc-per-node", &n, "--no-prefix", "--"])
                .arg(&bench)
                .arg("bench")
                .args(args);
            if sync_bn {
                cmd.arg("--sync-bn");
            }
            rows.push(measure(&mut cmd)?);
        }
    }
    if let Some(py) = &torch {
        // One thread per process, as Burn's CPU backend runs, and as torchrun sets for several
        // ranks on one node.
        let torch_common: Vec<String> = common
            .iter()
            .cloned()
            .chain(["--threads".into(), "1".into()])
            .collect();
        rows.push(measure(py.command().arg(&script).args(&torch_common))?);
        // PyTorch's SyncBatchNorm runs on GPUs only ("SyncBatchNorm layers only work with GPU
        // modules"): no such row on the CPU.
        let mut runs = vec![("1", false), (n.as_str(), false)];
        if r.device == "cuda" {
            runs.push((n.as_str(), true));
        }
        for (ranks, sync_bn) in runs {
            let mut cmd = torchrun(py, ranks, &script);
            cmd.arg("--ddp").args(&torch_common);
            if sync_bn {
                cmd.arg("--sync-bn");
            }
            rows.push(measure(&mut cmd)?);
        }
    }
    print!("{}", table(r, &rows));
    Ok(())
}

/// `python3 -m torch.distributed.run --standalone --nproc-per-node N SCRIPT` (a free port).
fn torchrun(py: &TorchPython, ranks: &str, script: &Path) -> Command {
    let mut cmd = py.command();
    cmd.args(["-m", "torch.distributed.run", "--standalone"])
        .args(["--nproc-per-node", ranks])
        .arg(script);
    cmd
}

/// Runs `cmd` and reads rank 0's `RESNET` line.
fn measure(cmd: &mut Command) -> Result<Measured, String> {
    eprintln!("bench resnet: {cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    parse(&stdout)
}
