//! SyncBatchNorm benchmark (what `cargo xtask bench syncbn` runs).
//!
//! 1. Step time (forward + backward + SGD step; no gradient all-reduce, which is the same for
//!    both variants) of a small CNN with `BatchNorm` vs `SyncBatchNorm`, at per-rank batch 8, 32
//!    and 64, on `--ranks` CPU rank processes (Flex) that this program launches itself.
//! 2. With `--features wgpu`, on the default wgpu adapter (one process): SyncBatchNorm with the
//!    CubeCL kernels and with tensor ops against Burn's `BatchNorm` (output, input and γ/β
//!    gradients, running stats; exit status 1 above 1e-4 relative), then forward + backward
//!    times of the three. `--ranks 0` skips the CPU table (the GPU check script runs it so).
//! 3. With `--features cpu`, the same on burn-cpu (CubeCL's CPU runtime: the kernels compiled
//!    for the CPU by LLVM).
//!
//! `cargo run -p ddp-bench --bin syncbn_bench [--features wgpu,cpu] -- [--ranks 2] [--steps 20]`
//! Prints markdown tables on stdout (rank 0).

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{
    BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d,
    conv::{Conv2d, Conv2dConfig},
    loss::CrossEntropyLossConfig,
    pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig},
};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Int, Tensor, activation::relu};
use burn_ddp::Ddp;
use burn_ddp::sync_batch_norm::{SyncBatchNorm, SyncBatchNormConfig};
use ddp_comm::ReduceOp;

/// The norm layer of the benchmark CNN: the same model with either layer.
#[derive(Module, Debug)]
enum Norm {
    Batch(BatchNorm),
    Sync(SyncBatchNorm),
}

impl Norm {
    fn new(channels: usize, sync: bool, device: &Device) -> Self {
        if sync {
            Norm::Sync(SyncBatchNormConfig::new(channels).init(device))
        } else {
            Norm::Batch(BatchNormConfig::new(channels).init(device))
        }
    }
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Norm::Batch(l) => l.forward(x),
            Norm::Sync(l) => l.forward(x),
        }
    }
}

/// conv(3→16) → norm → relu → conv(16→32, stride 2) → norm → relu → pool → linear(32→10).
#[derive(Module, Debug)]
struct Cnn {
    conv1: Conv2d,
    norm1: Norm,
    conv2: Conv2d,
    norm2: Norm,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

impl Cnn {
    fn new(sync: bool, device: &Device) -> Self {
        Cnn {
            conv1: Conv2dConfig::new([3, 16], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            norm1: Norm::new(16, sync, device),
            conv2: Conv2dConfig::new([16, 32], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm2: Norm::new(32, sync, device),
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(32, 10).init(device),
        }
    }
    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = relu(self.norm1.forward(self.conv1.forward(x)));
        let x = relu(self.norm2.forward(self.conv2.forward(x)));
        self.head.forward(self.pool.forward(x).flatten(1, 3))
    }
}

/// Median step time (ms) of `steps` training steps after 3 warm-up steps; each step starts
/// after a barrier so that rank skew doesn't count.
fn cnn_step_ms(ddp: &Ddp, sync: bool, batch: usize, steps: usize) -> Result<f64, String> {
    let device = Device::flex().autodiff();
    let mut model = Cnn::new(sync, &device);
    let mut optim = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let x = Tensor::<4>::random([batch, 3, 32, 32], Distribution::Normal(0.5, 1.0), &device);
    let targets = Tensor::<1, Int>::from_data(
        burn::tensor::TensorData::new((0..batch as i64).map(|i| i % 10).collect(), [batch]),
        &device,
    );
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 3 {
        ddp.barrier().map_err(|e| e.to_string())?;
        let start = Instant::now();
        let loss = loss_fn.forward(model.forward(x.clone()), targets.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.01, model, grads);
        let _ = loss.into_data(); // wait for the step
        if i >= 3 {
            times.push(start.elapsed());
        }
    }
    Ok(median_ms(&mut times))
}

fn median_ms(times: &mut [Duration]) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

struct Args {
    ranks: usize,
    steps: usize,
    batches: Vec<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        ranks: 2,
        steps: 20,
        batches: vec![8, 32, 64],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: std::num::ParseIntError| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--ranks" => args.ranks = value.parse().map_err(bad)?,
            "--steps" => args.steps = value.parse().map_err(bad)?,
            "--batches" => {
                args.batches = value
                    .split(',')
                    .map(|b| b.trim().parse().map_err(bad))
                    .collect::<Result<_, _>>()?
            }
            _ => {
                return Err(format!(
                    "unknown flag {flag} (--ranks N (0: no CPU table), --steps N, --batches 8,32,64)"
                ));
            }
        }
    }
    if args.steps == 0 || args.batches.is_empty() || args.batches.contains(&0) {
        return Err("--steps and --batches must be positive".into());
    }
    Ok(args)
}

/// One rank: the CNN table (printed by rank 0; times are the slowest rank's).
fn rank_main(args: &Args) -> Result<(), String> {
    let ddp = Ddp::builder()
        .device(Device::flex())
        .init()
        .map_err(|e| e.to_string())?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let mut t = [
            cnn_step_ms(&ddp, false, batch, args.steps)?,
            cnn_step_ms(&ddp, true, batch, args.steps)?,
        ];
        ddp.with_group(|pg| pg.all_reduce(&mut t, ReduceOp::Max))
            .map_err(|e| e.to_string())?;
        rows.push((batch, t[0], t[1]));
    }
    if rank == 0 {
        println!(
            "\n### CNN step time, {world} CPU ranks (Flex), median of {} steps, slowest rank\n",
            args.steps
        );
        println!("| batch / rank | BatchNorm ms | SyncBatchNorm ms | overhead |");
        println!("|---:|---:|---:|---:|");
        for (batch, bn, sbn) in rows {
            println!(
                "| {batch} | {bn:.2} | {sbn:.2} | {:+.1} % |",
                (sbn / bn - 1.0) * 100.0
            );
        }
    }
    Ok(())
}

/// Starts `ranks` copies of this program as rank processes and waits for them (30 min deadline).
fn launch(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let mut children = Vec::new();
    for rank in 0..args.ranks {
        let child = Command::new(&exe)
            .args(std::env::args().skip(1))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", args.ranks.to_string())
            .env("LOCAL_WORLD_SIZE", args.ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("RAYON_NUM_THREADS", "1")
            .spawn()
            .map_err(|e| format!("spawning rank {rank}: {e}"))?;
        children.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(1800);
    let mut failed = None;
    let mut running = children.len();
    while running > 0 {
        running = 0;
        for (rank, child) in children.iter_mut().enumerate() {
            match child.try_wait().map_err(|e| e.to_string())? {
                Some(status) if !status.success() => failed = failed.or(Some((rank, status))),
                Some(_) => {}
                None => running += 1,
            }
        }
        if failed.is_some() || Instant::now() > deadline {
            for child in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(match failed {
                Some((rank, status)) => format!("rank {rank} failed: {status}"),
                None => "ranks ran past the 30 min deadline".into(),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// max |a − b| / max |b| over two tensors' values (normwise relative error).
#[cfg(any(feature = "wgpu", feature = "cpu"))]
fn max_rel_err<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f64 {
    let a: Vec<f32> = a
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default();
    let b: Vec<f32> = b
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default();
    if a.len() != b.len() || a.is_empty() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
        .fold(0f64, f64::max);
    if scale > 0.0 { diff / scale } else { diff }
}

/// SyncBatchNorm on a CubeCL device `on` (wgpu, or burn-cpu: CubeCL's CPU runtime), world of
/// one: kernels and tensor ops against Burn's BatchNorm (output, input gradient, γ/β
/// gradients, running stats), then forward + backward timings of the three. Returns an error
/// when a difference is above 1e-4 relative.
#[cfg(any(feature = "wgpu", feature = "cpu"))]
fn cube_table(args: &Args, device: Device, on: &str) -> Result<(), String> {
    use burn_ddp::sync_batch_norm::SyncBatchNormImpl;
    const TOL: f64 = 1e-4;
    let device = device.autodiff();
    // One step of a layer on `x`: output, input grad, gamma grad, beta grad, running mean/var.
    // Loss Σ y·w with a fixed random w (Σ y² would have an identically zero input gradient).
    let run = |layer: &Norm, x: &Tensor<4>, w: &Tensor<4>| {
        let x = x.clone().require_grad();
        let y = layer.forward(x.clone());
        let grads = (y.clone() * w.clone()).sum().backward();
        let (gamma, beta, mean, var) = match layer {
            Norm::Batch(l) => (&l.gamma, &l.beta, &l.running_mean, &l.running_var),
            Norm::Sync(l) => (&l.gamma, &l.beta, &l.running_mean, &l.running_var),
        };
        [
            y.detach().flatten::<1>(0, 3),
            x.grad(&grads).unwrap().flatten::<1>(0, 3),
            gamma.grad(&grads).unwrap(),
            beta.grad(&grads).unwrap(),
            mean.value(),
            var.value(),
        ]
    };
    let layer = |which: Option<SyncBatchNormImpl>| match which {
        None => Norm::Batch(BatchNormConfig::new(16).init(&device)),
        Some(i) => Norm::Sync(
            SyncBatchNormConfig::new(16)
                .with_implementation(i)
                .init(&device),
        ),
    };
    println!(
        "\n### SyncBatchNorm vs Burn's BatchNorm on {on}, world of one (max |Δ| / max |BatchNorm|)\n"
    );
    println!(
        "| batch | path | output | input grad | γ grad | β grad | running mean | running var |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    let mut worst = 0f64;
    for &batch in &args.batches {
        let x = Tensor::<4>::random([batch, 16, 32, 32], Distribution::Normal(3.0, 2.0), &device);
        let w = Tensor::<4>::random([batch, 16, 32, 32], Distribution::Normal(0.0, 1.0), &device);
        let reference = run(&layer(None), &x, &w);
        for (name, which) in [
            ("CubeCL kernels", SyncBatchNormImpl::Auto),
            ("tensor ops", SyncBatchNormImpl::TensorOps),
        ] {
            let got = run(&layer(Some(which)), &x, &w);
            let errs: Vec<f64> = got
                .into_iter()
                .zip(reference.clone())
                .map(|(a, b)| max_rel_err(a, b))
                .collect();
            worst = errs.iter().copied().fold(worst, f64::max);
            let cells: Vec<String> = errs.iter().map(|e| format!("{e:.1e}")).collect();
            println!("| {batch} | {name} | {} |", cells.join(" | "));
        }
    }
    let time = |which: Option<SyncBatchNormImpl>, batch: usize| {
        let layer = layer(which);
        let x = Tensor::<4>::random([batch, 16, 32, 32], Distribution::Normal(3.0, 2.0), &device)
            .require_grad();
        let mut times = Vec::new();
        for i in 0..args.steps + 3 {
            let start = Instant::now();
            let y = layer.forward(x.clone());
            let grads = (y.clone() * y).sum().backward();
            let _ = x.grad(&grads).map(|g| g.sum().into_data());
            if i >= 3 {
                times.push(start.elapsed());
            }
        }
        median_ms(&mut times)
    };
    println!(
        "\n### Forward + backward on {on} ([B, 16, 32, 32]), median of {} steps\n",
        args.steps
    );
    println!(
        "| batch | BatchNorm ms | SyncBatchNorm kernels ms | SyncBatchNorm tensor ops ms | kernels / BatchNorm | tensor ops / kernels |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for &batch in &args.batches {
        let b = time(None, batch);
        let k = time(Some(SyncBatchNormImpl::Auto), batch);
        let t = time(Some(SyncBatchNormImpl::TensorOps), batch);
        println!(
            "| {batch} | {b:.2} | {k:.2} | {t:.2} | {:.2}× | {:.2}× |",
            k / b,
            t / k
        );
    }
    if worst > TOL {
        return Err(format!(
            "SyncBatchNorm on {on} differs from BatchNorm by {worst:.1e} relative (> {TOL:.0e})"
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("syncbn_bench: {e}");
            return ExitCode::from(2);
        }
    };
    let result = if std::env::var_os("RANK").is_some() {
        rank_main(&args)
    } else {
        let cpu = if args.ranks > 0 {
            launch(&args)
        } else {
            Ok(())
        };
        #[cfg(feature = "wgpu")]
        let cpu = cpu.and_then(|()| {
            cube_table(
                &args,
                Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
                "wgpu",
            )
        });
        #[cfg(feature = "cpu")]
        let cpu = cpu.and_then(|()| cube_table(&args, Device::cpu(), "burn-cpu"));
        cpu
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("syncbn_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
