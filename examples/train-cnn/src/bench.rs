//! `train-cnn bench`: ResNet-18 training steps timed (`cargo xtask bench resnet`; the GPU
//! check's ResNet rows). A mode of the train-cnn program rather than a program of its own, so
//! that the GPU check's bundle carries no second copy of the CUDA stack.
//!
//! The CIFAR-layout ResNet-18 ([`crate::resnet`], 11,173,962 parameters, as PyTorch's) on
//! synthetic 3 × 32 × 32 images, SGD with momentum 0.9 and
//! cross-entropy, the step timed after a warm-up with the device synchronised before each clock
//! read. `scripts/resnet18_torch.py` is the same network and loop in PyTorch and prints the same
//! columns.
//!
//! - `--mode alone`: Burn without burn-ddp (no process group, Burn's `ModuleOptimizer`);
//! - `--mode ddp`: `burn_ddp::init()` (a world of one when started alone, N ranks under
//!   `ddprun`), `replicate_model`, [`DdpOptimizer`]. Each timed step is paired with one
//!   without gradient synchronisation (the wrapped optimizer stepped directly, PyTorch's
//!   `no_sync()`), run right before or after it (alternately): `sync ms` is the median step minus the median step
//!   without it, the time a step waits for the gradient all-reduce, and `own sync ms` is
//!   burn-ddp's own clock of its synchronisation ([`DdpOptimizer::last_sync_stats`]).
//!
//! Rank 0 prints one `RESNET {json}` line; `--count-params` prints `PARAMS <n>` and exits.

use std::time::{Duration, Instant};

use burn::nn::BatchNorm;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use burn_ddp::sync_batch_norm::SyncBatchNorm;
use burn_ddp::{Ddp, DdpOptimizer};
use clap::{Parser, ValueEnum};

use crate::norm::NormLayer;
use crate::params::trainable_params;
use crate::resnet::{ResNet, ResNetConfig};

/// The Burn release the workspace pins (`burn = "=0.22.1"`), for the table's labels.
const BURN_VERSION: &str = "0.22.1";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Burn alone: no burn-ddp.
    Alone,
    /// burn-ddp: the launcher's world (one rank when started alone).
    Ddp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// The CPU (Flex).
    Cpu,
    /// CubeCL's CPU runtime (burn-cpu; a build with train-cnn's `cpu` feature).
    BurnCpu,
    /// CUDA device `LOCAL_RANK` (a build with train-cnn's `cuda` feature).
    Cuda,
}

/// Time ResNet-18 training steps with Burn alone or with burn-ddp.
#[derive(Debug, Parser)]
#[command(name = "train-cnn bench")]
pub struct Args {
    /// Burn alone or burn-ddp.
    #[arg(long, value_enum, default_value_t = Mode::Ddp)]
    mode: Mode,
    /// SyncBatchNorm instead of BatchNorm (with `--mode ddp`).
    #[arg(long)]
    sync_bn: bool,
    /// The device every rank trains on.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Images per rank and step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Image rows and columns.
    #[arg(long, default_value_t = 32)]
    size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Print the trainable parameter count (`PARAMS <n>`) and exit.
    #[arg(long)]
    count_params: bool,
}

/// What a run measured, in milliseconds (medians over the timed steps).
struct Timing {
    step: f64,
    /// Steps without gradient synchronisation, and burn-ddp's own sync clock (`--mode ddp`).
    ddp: Option<(f64, f64)>,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2)
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// Runs the benchmark `args` describes (`train-cnn bench …`, parsed by clap).
///
/// # Errors
/// Bad settings, a device or a job that failed: one line.
pub fn run(args: &Args) -> Result<(), String> {
    let cfg = ResNetConfig::resnet18(3, 10);
    if args.count_params {
        let model: ResNet<BatchNorm> = cfg.init(&Device::flex());
        println!("PARAMS {}", trainable_params(&model));
        return Ok(());
    }
    if args.batch == 0 || args.steps == 0 {
        return Err("--batch and --steps must be at least 1".into());
    }
    match (args.mode, args.sync_bn) {
        (Mode::Alone, true) => Err("SyncBatchNorm needs burn-ddp: use --mode ddp".into()),
        (Mode::Alone, false) => {
            let device = alone_device(args.device)?;
            let t = time_alone::<BatchNorm>(args, &cfg, &device)?;
            print_row(args, "Burn", 1, &t);
            Ok(())
        }
        (Mode::Ddp, sync_bn) => {
            let builder = Ddp::builder();
            let builder = match args.device {
                DeviceArg::Cpu => builder.device(Device::flex()),
                DeviceArg::BurnCpu => builder.device(burn_cpu_device()?),
                DeviceArg::Cuda => builder.cuda(),
            };
            let ddp = builder.init().map_err(|e| e.to_string())?;
            let t = if sync_bn {
                time_ddp::<SyncBatchNorm>(&ddp, args, &cfg)
            } else {
                time_ddp::<BatchNorm>(&ddp, args, &cfg)
            }?;
            if ddp.is_main() {
                print_row(args, "burn-ddp", ddp.world_size(), &t);
            }
            Ok(())
        }
    }
}

#[cfg(feature = "cuda")]
fn alone_device(arg: DeviceArg) -> Result<Device, String> {
    match arg {
        DeviceArg::Cpu => Ok(Device::flex()),
        DeviceArg::BurnCpu => burn_cpu_device(),
        DeviceArg::Cuda => {
            // What burn-ddp's init does for a CUDA device: the kernels that call exp/log need
            // libdevice, which Burn alone finds only through CUDA_PATH.
            ddp_nccl::cuda_toolkit::prepare_libdevice().map_err(|e| e.to_string())?;
            Ok(Device::cuda(0))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn alone_device(arg: DeviceArg) -> Result<Device, String> {
    match arg {
        DeviceArg::Cpu => Ok(Device::flex()),
        DeviceArg::BurnCpu => burn_cpu_device(),
        DeviceArg::Cuda => Err("--device cuda needs train-cnn built with `--features cuda`".into()),
    }
}

/// CubeCL's CPU runtime, where this build has it.
fn burn_cpu_device() -> Result<Device, String> {
    #[cfg(feature = "cpu")]
    return Ok(Device::cpu());
    #[cfg(not(feature = "cpu"))]
    Err("--device burn-cpu needs train-cnn built with `--features cpu`".into())
}

/// One batch of synthetic images and labels for `rank` (the same every step: the data path is
/// not what this measures).
fn batch(args: &Args, rank: usize, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    device.seed(1000 + rank as u64);
    let images = Tensor::<4>::random(
        [args.batch, 3, args.size, args.size],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let labels: Vec<i64> = (0..args.batch)
        .map(|i| ((i * 7 + rank * 3) % 10) as i64)
        .collect();
    let labels = Tensor::from_data(TensorData::new(labels, [args.batch]), device);
    (images, labels)
}

/// Waits for every kernel queued on `device`.
fn wait_for(device: &Device) -> Result<(), String> {
    device.sync().map_err(|e| format!("the device failed: {e}"))
}

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        }))
        .init()
}

/// forward + cross-entropy + backward.
fn gradients<N: NormLayer>(
    model: &ResNet<N>,
    (images, labels): &(Tensor<4>, Tensor<1, Int>),
    device: &Device,
) -> GradientsParams {
    let loss = CrossEntropyLossConfig::new()
        .init(device)
        .forward(model.forward(images.clone()), labels.clone());
    GradientsParams::from_grads(loss.backward(), model)
}

fn time_alone<N: NormLayer>(
    args: &Args,
    cfg: &ResNetConfig,
    device: &Device,
) -> Result<Timing, String> {
    let device = device.clone().autodiff();
    device.seed(42);
    let mut model: ResNet<N> = cfg.init(&device);
    let mut optim = sgd();
    let data = batch(args, 0, &device);
    let mut steps = Vec::new();
    for i in 0..args.warmup + args.steps {
        wait_for(&device)?;
        let t = Instant::now();
        let grads = gradients(&model, &data, &device);
        model = optim.step(0.01, model, grads);
        wait_for(&device)?;
        if i >= args.warmup {
            steps.push(t.elapsed());
        }
    }
    Ok(Timing {
        step: median(steps),
        ddp: None,
    })
}

fn time_ddp<N: NormLayer>(ddp: &Ddp, args: &Args, cfg: &ResNetConfig) -> Result<Timing, String> {
    let device = ddp.device().clone().autodiff();
    device.seed(42);
    let error = |e: burn_ddp::DdpError| e.to_string();
    let mut model: ResNet<N> = ddp.replicate_model(cfg.init(&device)).map_err(error)?;
    let mut optim = DdpOptimizer::new(ddp, sgd());
    let data = batch(args, ddp.rank(), &device);
    let (mut steps, mut unsynced, mut own) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.warmup + args.steps {
        // Which of the pair runs first alternates, so that neither gains from its place.
        let order = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for synced in order {
            ddp.barrier().map_err(error)?;
            wait_for(&device)?;
            let t = Instant::now();
            let grads = gradients(&model, &data, &device);
            model = if synced {
                optim.try_step(0.01, model, grads).map_err(error)?
            } else {
                optim.optimizer_mut().step(0.01, model, grads)
            };
            wait_for(&device)?;
            if i >= args.warmup {
                if synced {
                    steps.push(t.elapsed());
                    own.push(optim.last_sync_stats().total);
                } else {
                    unsynced.push(t.elapsed());
                }
            }
        }
    }
    Ok(Timing {
        step: median(steps),
        ddp: Some((median(unsynced), median(own))),
    })
}

/// Rank 0's `RESNET {json}` line, the fields of `scripts/resnet18_torch.py`'s (`cargo xtask
/// bench resnet` reads both).
fn print_row(args: &Args, framework: &str, world: usize, t: &Timing) {
    let (no_sync_ms, own_sync_ms) = match t.ddp {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let row = serde_json::json!({
        "framework": framework,
        "version": match args.mode {
            Mode::Alone => BURN_VERSION.to_string(),
            Mode::Ddp => format!("{} on Burn {BURN_VERSION}", env!("CARGO_PKG_VERSION")),
        },
        "mode": match args.mode { Mode::Alone => "alone", Mode::Ddp => "ddp" },
        "ranks": world,
        "norm": if args.sync_bn { "SyncBatchNorm" } else { "BatchNorm" },
        "device": match args.device {
            DeviceArg::Cpu => "cpu",
            DeviceArg::BurnCpu => "burn-cpu",
            DeviceArg::Cuda => "cuda",
        },
        "batch": args.batch,
        "size": args.size,
        "steps": args.steps,
        "step_ms": t.step,
        "no_sync_ms": no_sync_ms,
        "own_sync_ms": own_sync_ms,
    });
    println!("RESNET {row}");
}
