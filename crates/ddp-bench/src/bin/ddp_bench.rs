//! DDP step-time benchmark rank program: compute vs gradient-sync time per step.
//!
//! Run it with 1 and with N ranks (`ddprun --nproc-per-node 2 target/release/ddp_bench`, or
//! alone for 1 rank). For each model (an MLP of ~10.5 M parameters, a small CNN) and each
//! bucket cap it times `--steps` steps after `--warmup` and prints one table row from rank 0:
//!
//! - `compute`: forward + backward + `GradientsParams::from_grads` (this rank's work),
//! - `skew`: a barrier after the backward, i.e. waiting for the slowest rank's compute (it is
//!   not part of the synchronisation: without the barrier the presence exchange, the step's
//!   first collective, would absorb it),
//! - `sync`: [`burn_ddp::GradientSynchronizer::sync`] (presence exchange, host copies,
//!   bucket all-reduces overlapped on the comm thread, write-back),
//! - `fill`: time the calling thread spent reading gradients into host buckets,
//! - `allreduce`: time the comm thread spent inside bucket all-reduces,
//! - `write-back`: time turning reduced buckets back into gradient tensors,
//! - `raw`: one plain all-reduce of the same number of f32 values (the floor), timed in the
//!   same step right after the sync (this machine's memory bandwidth varies from minute to
//!   minute, so the two are measured side by side),
//! - `optim`: the optimizer update,
//! - `sync/raw`: the median over steps of sync ÷ raw of the same step: the cost of
//!   bucketing and copies on top of the wire,
//! - `overhead`: sync / (compute + optim), the step time DDP adds besides skew,
//! - `beyond raw`: (sync − raw) / (compute + optim), what DDP adds on top of the wire time
//!   of the same bytes (0 where sync is not slower than the raw all-reduce).
//!
//! - `wire`: the gradient wire format (`--compression none,bf16,fp16`), and `sync vs first`:
//!   the first format's sync time over this one's, in the same run (above 1: faster).
//!
//! All times are medians over the timed steps, in milliseconds.
//!
//! The last columns compare the **sharded optimizer state** (ZeRO stage 1) with the unsharded
//! one at the row's bucket cap and wire format, with Adam (its state is what sharding divides;
//! `--no-sharded` leaves them out): `Adam step ms`, a whole training step (forward, backward,
//! [`DdpOptimizer::try_step`], between barriers) unsharded and sharded, `sharded vs
//! unsharded` (the sharded step time over the unsharded one, measured in the same run), and
//! the optimizer state each rank holds (the largest over ranks), unsharded → sharded. Peak
//! memory per rank needs one process per mode: `cargo xtask bench zero`.
//!
//! After the table, **the flight recorder's cost** (the hang doctor's ring of collectives,
//! `burn_ddp::doctor`), per model at the first bucket cap: the SGD step (forward, backward,
//! [`DdpOptimizer::try_step`], between barriers) with the recorder on and off, step by step
//! in the order on, off, off, on … (`step ms on / off`, `on vs off`: medians of `4 ×
//! ⌈steps / 2⌉` steps), and, measured without the step's noise,
//! what the recorder adds to one collective (a 4-byte all-reduce timed on and off, 2 000 calls
//! per block) times the collectives of a step, as a share of the step (`estimated cost %`).
//!
//! The very last column, `replica check ms`: what the first synchronisation adds once, the
//! comparison of the ranks' parameters that catches a forgotten `replicate_model`
//! ([`GradientSynchronizer::check_replicas`]: a fingerprint of every parameter's values and an
//! all-gather of 8 bytes a rank), timed alone (median of 5).

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::AdamConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp::{Ddp, DdpOptimizer, GradientSynchronizer};
use clap::{Parser, ValueEnum};
use ddp_comm::{Compression, ReduceOp};

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
    #[arg(long, default_value_t = 11)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Overlap host copies with communication: auto (a comm thread where the host has two
    /// cores per local rank), on, off.
    #[arg(long, default_value = "auto")]
    overlap: String,
    /// Per-rank batch size.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Gradient wire formats to compare (none, bf16, fp16); the first is the baseline of the
    /// `vs first` column, measured in the same run.
    #[arg(long, value_delimiter = ',', default_values = ["none"])]
    compression: Vec<Compression>,
    /// Leave out the sharded-optimizer columns (Adam unsharded and sharded per row).
    #[arg(long)]
    no_sharded: bool,
    /// Leave out the flight recorder's cost (the table after the main one).
    #[arg(long)]
    no_recorder_cost: bool,
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
    skew: f64,
    sync: f64,
    fill: f64,
    write_back: f64,
    allreduce: f64,
    raw: f64,
    optim: f64,
    /// Median over steps of sync ÷ raw of the same step.
    ratio: Option<f64>,
    buckets: usize,
    /// Adam, unsharded then sharded: step ms and optimizer state MiB per rank (the largest).
    adam: Option<[(f64, f64); 2]>,
    /// The replica check the first synchronisation makes (median of 5, ms).
    check: f64,
}

fn bench<M: Module>(
    ddp: &Ddp,
    args: &Args,
    cap_bytes: usize,
    compression: Compression,
    mut model: M,
    loss: impl Fn(&M) -> Tensor<1>,
) -> Result<Row, burn_ddp::DdpError> {
    let mut sync =
        GradientSynchronizer::new(ddp.group().clone(), cap_bytes).with_compression(compression);
    match args.overlap.as_str() {
        "on" => sync = sync.with_overlap(true),
        "off" => sync = sync.with_overlap(false),
        _ => {}
    }
    let mut optim: ModuleOptimizer = SgdConfig::new().init();
    let (mut compute, mut syncs, mut ars, mut opts) = (vec![], vec![], vec![], vec![]);
    let (mut skews, mut fills, mut writes) = (vec![], vec![], vec![]);
    let mut buckets = 0;
    // The floor: a plain all-reduce of as many f32 values, timed in every step right after
    // the sync, so that both see the same state of a shared machine.
    let mut raw = vec![];
    let mut ratios: Vec<f64> = vec![];
    let mut raw_buf: Vec<f32> = Vec::new();
    for step in 0..args.warmup + args.steps {
        let t0 = Instant::now();
        let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
        let t1 = Instant::now();
        if ddp.world_size() > 1 {
            ddp.barrier()?;
        }
        let t1b = Instant::now();
        let grads = sync.sync(&model, grads)?;
        let t2 = Instant::now();
        model = optim.step(1e-4, model, grads);
        let _ = model.devices().first().map(|d| d.sync());
        let t3 = Instant::now();
        let st = sync.last_stats();
        buckets = st.buckets;
        if ddp.world_size() > 1 && st.elements > 0 {
            raw_buf.resize(st.elements, 1.0);
            ddp.barrier()?;
            let t = Instant::now();
            ddp.with_group(|pg| {
                pg.all_reduce_compressed(&mut raw_buf, ReduceOp::Mean, compression)
            })?;
            if step >= args.warmup {
                raw.push(t.elapsed());
                ratios.push((t2 - t1b).as_secs_f64() / t.elapsed().as_secs_f64());
            }
        }
        if step >= args.warmup {
            compute.push(t1 - t0);
            skews.push(t1b - t1);
            syncs.push(t2 - t1b);
            ars.push(st.all_reduce);
            fills.push(st.fill);
            writes.push(st.write_back);
            opts.push(t3 - t2);
        }
    }
    // What the first step's sync did besides its buckets, timed alone.
    let mut checks = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        sync.check_replicas(&model)?;
        checks.push(t.elapsed());
    }
    Ok(Row {
        check: median(checks),
        compute: median(compute),
        skew: median(skews),
        fill: median(fills),
        write_back: median(writes),
        sync: median(syncs),
        allreduce: median(ars),
        raw: median(raw),
        ratio: {
            ratios.sort_by(f64::total_cmp);
            ratios.get(ratios.len() / 2).copied()
        },
        optim: median(opts),
        buckets,
        adam: None,
    })
}

/// Adam, sharded or not: the median step time (ms) and the optimizer state per rank (MiB, the
/// largest over ranks).
fn bench_optimizer<M: Module>(
    ddp: &Ddp,
    args: &Args,
    (cap, compression): (usize, Compression),
    sharded: bool,
    mut model: M,
    loss: impl Fn(&M) -> Tensor<1>,
) -> Result<(f64, f64), burn_ddp::DdpError> {
    let sync = GradientSynchronizer::new(ddp.group().clone(), cap).with_compression(compression);
    let mut optim = DdpOptimizer::with_synchronizer(AdamConfig::new().init(), sync);
    if sharded {
        optim = optim.into_sharded();
    }
    let mut steps = Vec::new();
    for step in 0..args.warmup + args.steps {
        ddp.barrier()?;
        let t = Instant::now();
        let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
        model = optim.try_step(1e-4, model, grads)?;
        let _ = model.devices().first().map(|d| d.sync());
        ddp.barrier()?;
        if step >= args.warmup {
            steps.push(t.elapsed());
        }
    }
    let mut largest = [optim.state_size_bytes()? as i64];
    ddp.with_group(|pg| pg.all_reduce(&mut largest, ReduceOp::Max))?;
    Ok((median(steps), largest[0] as f64 / (1024.0 * 1024.0)))
}

/// One row: the gradient sync with SGD, then (unless `--no-sharded`) Adam unsharded and
/// sharded, each from the same replicated model. Returns the row and the parameter count.
fn measure<M: Module>(
    ddp: &Ddp,
    args: &Args,
    setting: (usize, Compression),
    make: impl Fn() -> M,
    loss: impl Fn(&M) -> Tensor<1>,
) -> Result<(Row, usize), burn_ddp::DdpError> {
    let model = ddp.replicate_model(make())?;
    let params = model.num_params();
    let mut row = bench(ddp, args, setting.0, setting.1, model, &loss)?;
    if !args.no_sharded {
        let mut adam = [(0.0, 0.0); 2];
        for (sharded, out) in [false, true].into_iter().zip(&mut adam) {
            let model = ddp.replicate_model(make())?;
            *out = bench_optimizer(ddp, args, setting, sharded, model, &loss)?;
        }
        row.adam = Some(adam);
    }
    Ok((row, params))
}

/// The flight recorder's cost for one model: (step ms on, step ms off, collectives per step,
/// recorder µs per collective).
fn recorder_cost<M: Module>(
    ddp: &Ddp,
    args: &Args,
    mut model: M,
    loss: impl Fn(&M) -> Tensor<1>,
) -> Result<(f64, f64, f64, f64), burn_ddp::DdpError> {
    use burn_ddp::doctor::recorder;
    const BLOCKS: usize = 6;
    let mut optim = DdpOptimizer::new(ddp, burn::optim::SgdConfig::new().init());
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let mut collectives = (0u64, 0usize);
    // After the warm-up, steps alternate on, off, off, on … (each pair in both orders, so that
    // a drift of the machine falls on both sides alike).
    let timed = 4 * args.steps.div_ceil(2).max(1);
    for i in 0..args.warmup + timed {
        let enabled = i < args.warmup || matches!((i - args.warmup) % 4, 0 | 3);
        recorder::set_enabled(enabled);
        ddp.barrier()?;
        let before = recorder::snapshot(0).finished;
        let t = Instant::now();
        let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
        model = optim.try_step(1e-4, model, grads)?;
        let _ = model.devices().first().map(|d| d.sync());
        let took = t.elapsed();
        ddp.barrier()?;
        if i < args.warmup {
            continue;
        }
        if enabled {
            // The step's collectives (the barrier after it excluded).
            let during = recorder::snapshot(0).finished - before;
            collectives = (collectives.0 + during.saturating_sub(1), collectives.1 + 1);
            on.push(took);
        } else {
            off.push(took);
        }
    }
    // One collective, on and off, without the step around it.
    let mut tiny = [0f32];
    let (mut tiny_on, mut tiny_off) = (Vec::new(), Vec::new());
    for block in 0..BLOCKS {
        let enabled = block % 2 == 0;
        recorder::set_enabled(enabled);
        ddp.barrier()?;
        let t = Instant::now();
        for _ in 0..2000 {
            ddp.with_group(|pg| pg.all_reduce(&mut tiny, ReduceOp::Sum))?;
        }
        let per_call = t.elapsed() / 2000;
        if enabled { &mut tiny_on } else { &mut tiny_off }.push(per_call);
    }
    recorder::set_enabled(true);
    let per_step = collectives.0 as f64 / collectives.1.max(1) as f64;
    let per_collective_us = (median(tiny_on) - median(tiny_off)) * 1e3;
    Ok((median(on), median(off), per_step, per_collective_us))
}

fn run(args: &Args) -> Result<(), burn_ddp::DdpError> {
    let ddp = burn_ddp::init()?;
    let device = ddp.device().clone().autodiff();
    let transport = {
        let kinds = ddp.with_group(|pg| pg.transports());
        let mut names: Vec<String> = kinds.iter().map(|t| format!("{t:?}")).collect();
        names.sort();
        names.dedup();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join("+")
        }
    };
    if ddp.is_main() {
        println!(
            "| model | params | ranks | transport | wire | bucket MiB | buckets | compute ms | skew ms | sync ms | sync vs first | fill ms | allreduce ms | write-back ms | raw allreduce ms | sync/raw | optim ms | overhead % | beyond raw % | Adam step ms, unsharded → sharded | sharded vs unsharded | Adam state MiB per rank, unsharded → sharded | replica check ms (first step only) |"
        );
        println!(
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
    }
    for &model in &args.models {
        for &mib in &args.bucket_mib {
            let cap = (mib * 1024.0 * 1024.0) as usize;
            let mut first_sync = None;
            for &compression in &args.compression {
                let setting = (cap, compression);
                // Every model of a row starts from the same seed.
                let (row, params) = match model {
                    Model::Mlp => measure(
                        &ddp,
                        args,
                        setting,
                        || {
                            device.seed(7);
                            Mlp::new(&device)
                        },
                        |m: &Mlp| m.loss(args.batch, &device),
                    )?,
                    Model::Cnn => measure(
                        &ddp,
                        args,
                        setting,
                        || {
                            device.seed(7);
                            Cnn::new(&device)
                        },
                        |m: &Cnn| m.loss(args.batch, &device),
                    )?,
                };
                let base = *first_sync.get_or_insert(row.sync);
                if ddp.is_main() {
                    let overhead = 100.0 * row.sync / (row.compute + row.optim);
                    let beyond = 100.0 * (row.sync - row.raw).max(0.0) / (row.compute + row.optim);
                    let ratio = row
                        .ratio
                        .map_or_else(|| "—".to_string(), |r| format!("{r:.2}"));
                    let speedup = if row.sync > 0.0 {
                        format!("{:.2}x", base / row.sync)
                    } else {
                        "—".to_string()
                    };
                    let sharded = row.adam.map_or_else(
                        || "— | — | —".to_string(),
                        |[(u, us), (s, ss)]| {
                            format!("{u:.1} → {s:.1} | {:.3} | {us:.1} → {ss:.1}", s / u)
                        },
                    );
                    println!(
                        "| {model:?} | {params} | {} | {transport} | {compression} | {mib} | {} | {:.1} | {:.1} | {:.1} | {speedup} | {:.1} | {:.1} | {:.1} | {:.1} | {ratio} | {:.1} | {overhead:.1} | {beyond:.1} | {sharded} | {:.1} |",
                        ddp.world_size(),
                        row.buckets,
                        row.compute,
                        row.skew,
                        row.sync,
                        row.fill,
                        row.allreduce,
                        row.write_back,
                        row.raw,
                        row.optim,
                        row.check
                    );
                }
            }
        }
    }
    if !args.no_recorder_cost {
        recorder_table(&ddp, args, &device)?;
    }
    ddp.barrier()
}

/// The flight recorder's cost, one row per model (see the crate docs).
fn recorder_table(ddp: &Ddp, args: &Args, device: &Device) -> Result<(), burn_ddp::DdpError> {
    if ddp.is_main() {
        println!(
            "\n| model | ranks | step ms, recorder on / off | on vs off | collectives per step | recorder µs per collective | estimated cost % of the step |"
        );
        println!("|---|---|---|---|---|---|---|");
    }
    for &model in &args.models {
        device.seed(7);
        let (on, off, per_step, per_collective_us) = match model {
            Model::Mlp => recorder_cost(ddp, args, ddp.replicate_model(Mlp::new(device))?, |m| {
                m.loss(args.batch, device)
            })?,
            Model::Cnn => recorder_cost(ddp, args, ddp.replicate_model(Cnn::new(device))?, |m| {
                m.loss(args.batch, device)
            })?,
        };
        if ddp.is_main() {
            let estimated = 100.0 * per_step * per_collective_us.max(0.0) / (off * 1e3);
            println!(
                "| {model:?} | {} | {on:.2} / {off:.2} | {:.3} | {per_step:.1} | {per_collective_us:.3} | {estimated:.4} |",
                ddp.world_size(),
                on / off
            );
        }
    }
    Ok(())
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
