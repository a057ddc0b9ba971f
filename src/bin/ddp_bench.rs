//! DDP step-time benchmark rank program: compute vs gradient-sync time per step.
//!
//! Run it with 1 and with N ranks (`ddprun --nproc-per-node 2 target/release/ddp_bench`, or
//! alone for 1 rank). For each model (an MLP of ~10.5 M parameters, a small CNN) and each
//! bucket cap it times `--steps` steps after `--warmup` and prints one table row from rank 0:
//!
//! - `compute`: forward + backward + `GradientsParams::from_grads` (this rank's work),
//! - `sync`: [`burn_ddp::GradientSynchronizer::sync`] (presence exchange, host copies,
//!   bucket all-reduces overlapped on the comm thread, write-back). It includes waiting for
//!   the slowest rank to finish its backward (the presence exchange is the first collective
//!   of a step), so on a shared, loaded CPU it also measures compute skew between ranks,
//! - `allreduce`: time the comm thread spent inside bucket all-reduces,
//! - `raw`: one plain all-reduce of the same number of f32 values in a loop (the floor),
//! - `optim`: the optimizer update,
//! - `overhead`: sync / (compute + optim).
//!
//! All times are medians over the timed steps, in milliseconds.

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp::{Ddp, GradientSynchronizer};
use clap::{Parser, ValueEnum};
use ddp_comm::ReduceOp;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Model {
    Mlp,
    Cnn,
}

#[derive(Debug, Parser)]
struct Args {
    /// Models to run.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["mlp", "cnn"])]
    models: Vec<Model>,
    /// Bucket caps to sweep, in MiB.
    #[arg(long, value_delimiter = ',', default_values = ["1", "5", "25", "100"])]
    bucket_mib: Vec<f64>,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Per-rank batch size.
    #[arg(long, default_value_t = 16)]
    batch: usize,
}

#[derive(Module, Debug)]
struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
    l4: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            l1: LinearConfig::new(1024, 2048).init(device),
            l2: LinearConfig::new(2048, 2048).init(device),
            l3: LinearConfig::new(2048, 2048).init(device),
            l4: LinearConfig::new(2048, 10).init(device),
            act: Relu::new(),
        }
    }
    fn loss(&self, batch: usize, device: &Device) -> Tensor<1> {
        let x = Tensor::<2>::random([batch, 1024], Distribution::Default, device);
        let h = self.act.forward(self.l1.forward(x));
        let h = self.act.forward(self.l2.forward(h));
        let h = self.act.forward(self.l3.forward(h));
        self.l4.forward(h).powi_scalar(2).mean()
    }
}

#[derive(Module, Debug)]
struct Cnn {
    c1: Conv2d,
    c2: Conv2d,
    c3: Conv2d,
    pool: AdaptiveAvgPool2d,
    fc: Linear,
    act: Relu,
}

impl Cnn {
    fn new(device: &Device) -> Self {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        Cnn {
            c1: conv(3, 32),
            c2: conv(32, 64),
            c3: conv(64, 128),
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(128, 10).init(device),
            act: Relu::new(),
        }
    }
    fn loss(&self, batch: usize, device: &Device) -> Tensor<1> {
        let x = Tensor::<4>::random([batch, 3, 32, 32], Distribution::Default, device);
        let h = self.act.forward(self.c1.forward(x));
        let h = self.act.forward(self.c2.forward(h));
        let h = self.act.forward(self.c3.forward(h));
        let h = self.pool.forward(h).flatten::<2>(1, 3);
        self.fc.forward(h).powi_scalar(2).mean()
    }
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

struct Row {
    compute: f64,
    sync: f64,
    allreduce: f64,
    raw: f64,
    optim: f64,
    buckets: usize,
}

fn bench<M: Module>(
    ddp: &Ddp,
    args: &Args,
    cap_bytes: usize,
    mut model: M,
    loss: impl Fn(&M) -> Tensor<1>,
) -> Result<Row, burn_ddp::DdpError> {
    let mut sync = GradientSynchronizer::new(ddp.group().clone(), cap_bytes);
    let mut optim: ModuleOptimizer = SgdConfig::new().init();
    let (mut compute, mut syncs, mut ars, mut opts) = (vec![], vec![], vec![], vec![]);
    let mut elements = 0;
    let mut buckets = 0;
    for step in 0..args.warmup + args.steps {
        let t0 = Instant::now();
        let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
        let t1 = Instant::now();
        let grads = sync.sync(&model, grads)?;
        let t2 = Instant::now();
        model = optim.step(1e-4, model, grads);
        let _ = model.devices().first().map(|d| d.sync());
        let t3 = Instant::now();
        let st = sync.last_stats();
        elements = st.elements;
        buckets = st.buckets;
        if step >= args.warmup {
            compute.push(t1 - t0);
            syncs.push(t2 - t1);
            ars.push(st.all_reduce);
            opts.push(t3 - t2);
        }
    }
    // The floor: a plain all-reduce of as many f32 values, same number of repetitions.
    let mut raw = vec![];
    if ddp.world_size() > 1 && elements > 0 {
        let mut buf = vec![1.0f32; elements];
        for _ in 0..args.steps {
            let t = Instant::now();
            burn_ddp::comm::lock(ddp.group()).all_reduce(&mut buf, ReduceOp::Sum)?;
            raw.push(t.elapsed());
        }
    }
    Ok(Row {
        compute: median(compute),
        sync: median(syncs),
        allreduce: median(ars),
        raw: median(raw),
        optim: median(opts),
        buckets,
    })
}

fn run(args: &Args) -> Result<(), burn_ddp::DdpError> {
    let ddp = burn_ddp::init()?;
    let device = ddp.device().clone().autodiff();
    if ddp.is_main() {
        println!(
            "| model | params | ranks | bucket MiB | buckets | compute ms | sync ms | allreduce ms | raw allreduce ms | optim ms | overhead % |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
    }
    for &model in &args.models {
        for &mib in &args.bucket_mib {
            let cap = (mib * 1024.0 * 1024.0) as usize;
            device.seed(7);
            let (row, params) = match model {
                Model::Mlp => {
                    let m = ddp.replicate_model(Mlp::new(&device))?;
                    let p = m.num_params();
                    (
                        bench(&ddp, args, cap, m, |m| m.loss(args.batch, &device))?,
                        p,
                    )
                }
                Model::Cnn => {
                    let m = ddp.replicate_model(Cnn::new(&device))?;
                    let p = m.num_params();
                    (
                        bench(&ddp, args, cap, m, |m| m.loss(args.batch, &device))?,
                        p,
                    )
                }
            };
            if ddp.is_main() {
                let overhead = 100.0 * row.sync / (row.compute + row.optim);
                println!(
                    "| {model:?} | {params} | {} | {mib} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {overhead:.1} |",
                    ddp.world_size(),
                    row.buckets,
                    row.compute,
                    row.sync,
                    row.allreduce,
                    row.raw,
                    row.optim
                );
            }
        }
    }
    ddp.barrier()
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ddp_bench error: {e}");
            std::process::ExitCode::from(3)
        }
    }
}
