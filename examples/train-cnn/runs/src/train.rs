//! `cargo xtask train`: build the `train-cnn` example and run it as rank processes through the
//! launcher library (`cargo xtask compare` runs it the same way).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use ddprun::{LaunchConfig, launch};

/// Which device the ranks train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// CUDA device `LOCAL_RANK` (Burn's CUDA backend).
    Cuda,
    /// wgpu (Vulkan/Metal/DX12) — for GPUs without CUDA.
    Wgpu,
    /// The CPU backend (Flex).
    Cpu,
    /// CubeCL's CPU runtime (burn-cpu: Burn's GPU kernels compiled for the CPU by LLVM), with
    /// SyncBatchNorm's CubeCL kernels. Slower than Flex on this project's CNN: see
    /// docs/benchmarks.md.
    BurnCpu,
}

/// Options of `cargo xtask train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Ranks on CUDA GPUs, one per device (builds the example with Burn's CUDA backend).
    #[arg(long, conflicts_with = "cpus")]
    pub gpus: Option<usize>,
    /// CPU ranks (default 2 when --gpus is not given).
    #[arg(long)]
    pub cpus: Option<usize>,
    /// Device backend (default: cuda with --gpus, cpu otherwise).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Synchronise BatchNorm statistics across ranks (the default).
    #[arg(long, overrides_with = "no_sync_bn")]
    pub sync_bn: bool,
    /// Keep per-rank BatchNorm statistics.
    #[arg(long)]
    pub no_sync_bn: bool,
    /// Shard the optimizer state across the ranks (ZeRO stage 1; train-cnn's
    /// `--shard-optimizer`): the same training, each rank holding the momentum of its own
    /// parameters only.
    #[arg(long)]
    pub shard_optimizer: bool,
    /// Samples per batch on each rank [default: 32].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Epochs.
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.02)]
    pub lr: f64,
    /// Seed of initialisation, synthetic data and data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// `synthetic` (embedded, generated; the default) or `mnist:DIR` (IDX files).
    #[arg(long, default_value = "synthetic")]
    pub data: String,
    /// Output directory [default: runs/train].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue from `OUT/checkpoint.bin`.
    #[arg(long)]
    pub resume: bool,
    /// Start the ranks again after a rank failed, up to this many times (torchrun's
    /// --max-restarts); train-cnn resumes from its last checkpoint.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Every rank writes its timeline to DIR (`DDP_TRACE`); the ranks are merged into
    /// DIR/trace.json (open it in https://ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Gradients on the wire: none, bf16, fp16 (16-bit values, f32 accumulation).
    #[arg(long, value_name = "none|bf16|fp16")]
    pub compression: Option<String>,
    /// With --gpus N on a machine with fewer GPUs: every rank an NCCL host of its own
    /// (`ddprun --emulate-gpu-hosts`), so that the N ranks share the GPU(s) through NCCL; for
    /// trying the multi-GPU path on one GPU, not for speed.
    #[arg(long, requires = "gpus")]
    pub emulate_gpu_hosts: bool,
    /// Run this `train-cnn` binary instead of building one in release (e.g. a debug build).
    #[arg(long, value_name = "PATH")]
    pub program: Option<PathBuf>,
    /// More arguments for `train-cnn` (after `--`), e.g. `-- --train-size 2000`.
    #[arg(last = true)]
    pub extra: Vec<String>,
}

impl TrainArgs {
    fn ranks_and_backend(&self) -> Result<(usize, BackendArg), String> {
        match self.gpus {
            Some(0) => Err("--gpus must be at least 1".into()),
            Some(n) => Ok((n, self.backend.unwrap_or(BackendArg::Cuda))),
            None => {
                let n = self.cpus.unwrap_or(2);
                if n == 0 {
                    return Err("--cpus must be at least 1".into());
                }
                Ok((n, self.backend.unwrap_or(BackendArg::Cpu)))
            }
        }
    }

    fn sync_bn(&self) -> bool {
        !self.no_sync_bn || self.sync_bn
    }
}

/// Fails with a clear message when `gpus` CUDA ranks cannot run here (the same check every
/// rank makes in `burn_ddp::init`, made once before the build).
pub(crate) fn check_cuda(gpus: usize) -> Result<(), String> {
    let visible = ddp_nccl::visible_cuda_devices().map_err(|e| {
        format!(
            "--gpus {gpus}: {e}. Run on CPU ranks with `cargo xtask train --cpus N`, or on a \
             non-CUDA GPU with `--backend wgpu`."
        )
    })?;
    if visible < gpus {
        return Err(format!(
            "--gpus {gpus}: only {visible} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES={})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
        ));
    }
    Ok(())
}

/// Builds `train-cnn` for `backend` in release and returns its path, or returns `program`
/// (a `--program` given) instead.
pub(crate) fn build_example(
    root: &Path,
    program: Option<&Path>,
    backend: BackendArg,
) -> Result<PathBuf, String> {
    if let Some(p) = program {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--program {}: no such file", p.display()))
        };
    }
    let mut cmd = cargo_tasks::cargo();
    cmd.current_dir(root).args([
        "build",
        "--release",
        "-p",
        "train-cnn",
        "--bin",
        "train-cnn",
    ]);
    match backend {
        BackendArg::Cuda => {
            cmd.args(["--features", "cuda"]);
        }
        BackendArg::Wgpu => {
            cmd.args(["--features", "wgpu"]);
        }
        BackendArg::BurnCpu => {
            cmd.args(["--features", "cpu"]);
        }
        BackendArg::Cpu => {}
    }
    cargo_tasks::run(&mut cmd)?;
    Ok(cargo_tasks::target_dir(root)
        .join("release")
        .join("train-cnn"))
}

pub(crate) fn backend_name(b: BackendArg) -> &'static str {
    match b {
        BackendArg::Cuda => "cuda",
        BackendArg::Wgpu => "wgpu",
        BackendArg::Cpu => "cpu",
        BackendArg::BurnCpu => "burn-cpu",
    }
}

/// The `train-cnn` arguments for one run.
fn example_args(
    a: &TrainArgs,
    backend: BackendArg,
    batch: usize,
    sync_bn: bool,
    compression: Option<&str>,
    out: &Path,
) -> Vec<OsString> {
    let mut v: Vec<OsString> = [
        "--backend",
        backend_name(backend),
        "--batch-size",
        &batch.to_string(),
        "--epochs",
        &a.epochs.to_string(),
        "--lr",
        &a.lr.to_string(),
        "--seed",
        &a.seed.to_string(),
        "--data",
        &a.data,
    ]
    .iter()
    .map(OsString::from)
    .collect();
    v.push("--out".into());
    v.push(out.into());
    if sync_bn {
        v.push("--sync-bn".into());
    }
    if a.resume {
        v.push("--resume".into());
    }
    if a.shard_optimizer {
        v.push("--shard-optimizer".into());
    }
    if let Some(c) = compression {
        v.push("--compression".into());
        v.push(c.into());
    }
    v.extend(a.extra.iter().map(OsString::from));
    v
}

/// Launches `ranks` processes of `program`; returns an error naming the failed rank.
pub(crate) fn launch_ranks(
    ranks: usize,
    max_restarts: usize,
    trace: Option<&Path>,
    emulate_gpu_hosts: bool,
    program: &Path,
    args: &[OsString],
) -> Result<(), String> {
    let cfg = LaunchConfig {
        nproc_per_node: ranks,
        rank0_stderr_direct: true,
        forward_signals: true,
        max_restarts,
        trace: trace.map(Path::to_path_buf),
        emulate_gpu_hosts,
        ..LaunchConfig::default()
    };
    let report = launch(&cfg, program.as_os_str(), args).map_err(|e| e.to_string())?;
    if report.success() {
        let restarts = match report.attempt {
            0 => String::new(),
            n => format!(" after {n} restart(s)"),
        };
        eprintln!(
            "xtask: all {} ranks exited 0 in {:.1} s{restarts}",
            report.exits.len(),
            report.elapsed.as_secs_f64()
        );
        Ok(())
    } else {
        Err(report
            .summary()
            .unwrap_or_else(|| "the launch failed".to_string()))
    }
}

/// `cargo xtask train`.
pub fn train(root: &Path, a: &TrainArgs) -> Result<(), String> {
    let (ranks, backend) = a.ranks_and_backend()?;
    if a.gpus.is_some() && backend == BackendArg::Cuda {
        // Emulated GPU hosts share the GPU(s): one is enough.
        check_cuda(if a.emulate_gpu_hosts { 1 } else { ranks })?;
    }
    let program = build_example(root, a.program.as_deref(), backend)?;
    let out = root.join(a.out.as_deref().unwrap_or(Path::new("runs/train")));
    let batch = a.batch_size.unwrap_or(32);
    eprintln!(
        "xtask train: {ranks} {} rank(s) × batch {batch} ({}{}), output in {}",
        backend_name(backend),
        if a.sync_bn() {
            "SyncBatchNorm"
        } else {
            "per-rank BatchNorm"
        },
        if a.shard_optimizer {
            ", sharded optimizer state"
        } else {
            ""
        },
        out.display()
    );
    let args = example_args(
        a,
        backend,
        batch,
        a.sync_bn(),
        a.compression.as_deref(),
        &out,
    );
    launch_ranks(
        ranks,
        a.max_restarts,
        a.trace.as_deref(),
        a.emulate_gpu_hosts,
        &program,
        &args,
    )
}

/// The last epoch's metrics of a run (its `metrics.json`).
pub(crate) fn last_epoch(dir: &Path) -> Result<serde_json::Value, String> {
    let path = dir.join("metrics.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let rows = v
        .as_array()
        .or_else(|| v.get("epochs").and_then(|e| e.as_array()))
        .ok_or_else(|| format!("{}: no epochs", path.display()))?;
    rows.last()
        .cloned()
        .ok_or_else(|| format!("{}: no epochs", path.display()))
}
