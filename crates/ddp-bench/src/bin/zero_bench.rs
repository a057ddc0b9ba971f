//! Sharded vs unsharded optimizer state (ZeRO stage 1) rank program: step time, optimizer
//! state bytes and peak memory of one rank, for `cargo xtask bench zero`.
//!
//! Trains an MLP of `--layers` square layers of width `--width` (default 4 × 3600²: 51.8 M
//! parameters) with Adam through [`DdpOptimizer::new`] or, with `--shard`,
//! [`DdpOptimizer::sharded`], `--warmup` untimed steps then `--steps` timed ones (a barrier
//! before each, so a step is every rank's). Rank 0 prints one line
//! `ZERO {json}` with the median step time and its parts on rank 0 (backward, gradient sync,
//! optimizer step, parameter all-gather, live recovery's shard copies with `--live-copies`
//! under `ddprun --recover live`), every rank's optimizer-state bytes and every
//! rank's peak resident memory (`VmHWM`). A process measures one mode: the peak memory of a
//! process is its own high-water mark.

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp::{Ddp, DdpOptimizer};
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// Shard the optimizer state (`DdpOptimizer::sharded`).
    #[arg(long)]
    shard: bool,
    /// Recover live (`DdpBuilder::live_recovery`; run under `ddprun --recover live`): sharded,
    /// each rank also keeps a copy of its predecessor's shard after every step.
    #[arg(long)]
    live_copies: bool,
    /// Square layers of the MLP.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of each layer.
    #[arg(long, default_value_t = 3600)]
    width: usize,
    /// Per-rank batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first (the first creates Adam's state).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
}

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
    act: Relu,
}

impl Mlp {
    fn new(layers: usize, width: usize, device: &Device) -> Self {
        Mlp {
            layers: (0..layers)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        let h = self
            .layers
            .iter()
            .fold(x, |h, l| self.act.forward(l.forward(h)));
        h.powi_scalar(2).mean()
    }
}

/// This process's peak resident set (`VmHWM`), in bytes.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

fn run(args: &Args) -> Result<(), burn_ddp::DdpError> {
    let builder = Ddp::builder().device(Device::flex());
    let builder = if args.live_copies {
        builder.live_recovery()
    } else {
        builder
    };
    let ddp = builder.init()?;
    let device = ddp.device().clone().autodiff();
    device.seed(7);
    let mut model = ddp.replicate_model(Mlp::new(args.layers, args.width, &device))?;
    let params = model.num_params();
    let mut optim = if args.shard {
        DdpOptimizer::sharded(&ddp, AdamConfig::new().init())
    } else {
        DdpOptimizer::new(&ddp, AdamConfig::new().init())
    };
    let mut times = Vec::new();
    // Where rank 0's step goes: backward, gradient sync, optimizer step, parameter gather.
    let (mut backward, mut sync, mut stepping, mut gather, mut copies) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..args.warmup + args.steps {
        let x = Tensor::<2>::random([args.batch, args.width], Distribution::Default, &device);
        ddp.barrier()?;
        let t = Instant::now();
        let grads = GradientsParams::from_grads(model.loss(x).backward(), &model);
        let backward_time = t.elapsed();
        let t_step = Instant::now();
        model = optim.try_step(1e-4, model, grads)?;
        let step_time = t_step.elapsed();
        ddp.barrier()?;
        if step >= args.warmup {
            times.push(t.elapsed());
            backward.push(backward_time);
            let synced = optim.last_sync_stats().total;
            sync.push(synced);
            match optim.last_shard_stats() {
                Some(s) => {
                    stepping.push(s.optimizer_step);
                    gather.push(s.gather);
                    copies.push(s.shard_copies);
                }
                None => {
                    stepping.push(step_time.saturating_sub(synced));
                    gather.push(Duration::ZERO);
                    copies.push(Duration::ZERO);
                }
            }
        }
    }
    let state = optim.state_size_bytes()? as i64;
    let rss = peak_rss_bytes() as i64;
    let world = ddp.world_size();
    let (mut states, mut rsss) = (vec![0i64; world], vec![0i64; world]);
    ddp.with_group(|pg| {
        pg.all_gather(&[state], &mut states)?;
        pg.all_gather(&[rss], &mut rsss)
    })?;
    if ddp.is_main() {
        let list = |v: &[i64]| v.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let line = format!(
            "{{\"mode\":\"{}\",\"ranks\":{world},\"params\":{params},\"batch\":{},\
             \"step_ms\":{:.3},\"backward_ms\":{:.3},\"sync_ms\":{:.3},\"optimizer_ms\":{:.3},\
             \"gather_ms\":{:.3},\"copies_ms\":{:.3},\"state_bytes\":[{}],\"peak_rss_bytes\":[{}]}}",
            match (args.shard, optim.recovers_with_copies()) {
                (false, _) => "unsharded",
                (true, false) => "sharded",
                (true, true) => "sharded, live-recovery copies",
            },
            args.batch,
            median_ms(times),
            median_ms(backward),
            median_ms(sync),
            median_ms(stepping),
            median_ms(gather),
            median_ms(copies),
            list(&states),
            list(&rsss),
        );
        println!("ZERO {line}");
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run(&Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zero_bench: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
