//! Rank program of the `LiveTraining` tests (`tests/live_training.rs`): a small network with
//! plain BatchNorm (each rank's running statistics its own) and dropout, trained through
//! `burn_ddp::recovery::LiveTraining`, the loop a program writes to recover a lost rank live.
//!
//! Every step's batch is a function of (rank, step); the loss and the batch size are summed over
//! the ranks inside the step and added to the state handed over (`STEP k loss=BITS`); between
//! steps, every `--eval-every` steps, an evaluation on each rank's own model (its own running
//! statistics) summed over the ranks through `LiveTraining::collective` (`EVAL k loss=BITS`, rank
//! 0). At the end each rank writes its parameters and buffers to `OUT/rank{r}.f32` and prints
//! `END rank=R pid=P steps=N recoveries=K sum=BITS`. `--victim R --die-at-step K` makes rank R
//! SIGKILL itself before step K (in the job's first attempt; its replacement does not).

use std::path::PathBuf;
use std::process::ExitCode;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::checkpoint::Progress;
use burn_ddp::{Ddp, DdpOptimizer};
use clap::Parser;
use ddp_comm::ReduceOp;
use ddp_tests::{flatten, write_f32};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Per-rank batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long)]
    out: PathBuf,
    /// Seed every step's random state (`LiveTraining::seeded`).
    #[arg(long)]
    seed: Option<u64>,
    /// Do not keep every rank's buffers (`LiveTraining::keep_rank_buffers(false)`).
    #[arg(long)]
    forget_rank_buffers: bool,
    /// ZeRO-1 (`DdpOptimizer::sharded`).
    #[arg(long)]
    sharded: bool,
    /// Evaluate between steps every this many steps (0: never).
    #[arg(long, default_value_t = 4)]
    eval_every: u64,
    /// The rank that SIGKILLs itself (first attempt, not a replacement).
    #[arg(long)]
    victim: Option<usize>,
    /// Before which step the victim dies.
    #[arg(long)]
    die_at_step: Option<u64>,
    /// The victim dies inside the evaluation after step `--die-at-step` instead (between steps).
    #[arg(long)]
    die_in_eval: bool,
    /// The victim dies this many milliseconds after its first step, wherever it then is (a
    /// step's passes, the buffers' gather, the sums, the synchronisation, an evaluation).
    #[arg(long)]
    die_after_ms: Option<u64>,
}

const IN: usize = 5;
const HIDDEN: usize = 12;
const LR: f64 = 0.05;

#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    bn: BatchNorm,
    drop: Dropout,
    fc2: Linear,
    act: Relu,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            fc1: LinearConfig::new(IN, HIDDEN).init(device),
            bn: BatchNormConfig::new(HIDDEN).init(device),
            drop: DropoutConfig::new(0.3).init(),
            fc2: LinearConfig::new(HIDDEN, 1).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.bn.forward(self.fc1.forward(x));
        self.fc2.forward(self.drop.forward(self.act.forward(h)))
    }
}

/// The batch of rank `rank` at step `step`: inputs and targets from a fixed formula, shifted per
/// rank so that each rank's BatchNorm statistics differ.
fn batch(rank: usize, step: u64, b: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let mut x = Vec::with_capacity(b * IN);
    let mut y = Vec::with_capacity(b);
    for i in 0..b {
        let t = (step as usize * b + i) as f32;
        let row: Vec<f32> = (0..IN)
            .map(|j| {
                ((t * 0.37 + j as f32 * 1.3).sin() + rank as f32 * 0.5) * (1.0 + j as f32 * 0.1)
            })
            .collect();
        y.push(row.iter().sum::<f32>() * 0.2 - rank as f32 * 0.1);
        x.extend(row);
    }
    (
        Tensor::from_data(TensorData::new(x, [b, IN]), device),
        Tensor::from_data(TensorData::new(y, [b, 1]), device),
    )
}

fn die_now() {
    // SAFETY: kill and getpid have no preconditions.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

fn run(args: &Args) -> Result<(), String> {
    let e = |e: burn_ddp::DdpError| e.to_string();
    let ddp = Ddp::builder()
        .live_recovery()
        .device(Device::flex())
        .init()
        .map_err(e)?;
    let (rank, pid) = (ddp.rank(), std::process::id());
    println!("PID rank={rank} pid={pid}");
    let device = ddp.device().clone().autodiff();
    // Different initialisations: equality afterwards proves the replication.
    device.seed(1000 + rank as u64);
    let model = ddp.replicate_model(Net::new(&device)).map_err(e)?;
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        }))
        .init();
    let optim = if args.sharded {
        DdpOptimizer::sharded(&ddp, sgd)
    } else {
        DdpOptimizer::new(&ddp, sgd)
    };
    let first_attempt = std::env::var("DDP_RESTART_COUNT").map_or(true, |c| c == "0");
    let victim = args.victim == Some(rank) && !ddp.is_replacement() && first_attempt;
    // The state: the loss summed over every rank and step, as f64 bits of each step's sum.
    let mut start = ddp
        .live(model, optim)
        .keep_rank_buffers(!args.forget_rank_buffers)
        // Every step's batch is a function of its progress: ZeRO-1 may go back a step.
        .batches_from_progress();
    if let Some(seed) = args.seed {
        start = start.seeded(seed);
    }
    let mut live = start.start(Progress::default(), 0.0f64).map_err(e)?;
    if live.recoveries() > 0 {
        println!("RECOVERED rank={rank} step={}", live.progress().step);
    }
    let b = args.batch;
    loop {
        // Between steps, at the top of the loop and from the progress: a replacement starts
        // here, and makes the evaluation the others make next (or skips it, made already).
        let done = live.progress().step;
        if args.eval_every > 0 && done > 0 && done % args.eval_every == 0 {
            let dies_here = victim && args.die_in_eval && args.die_at_step == Some(done);
            let eval = live
                .collective(|l| {
                    if dies_here {
                        die_now();
                    }
                    let model = l.model().valid();
                    let device = device.clone().without_autodiff();
                    let mut sums = [0f64; 1];
                    for s in 0..3 {
                        let (x, y) = batch(rank, 10_000 + s, b, &device);
                        let loss = (model.forward(x) - y).powi_scalar(2).mean();
                        sums[0] += loss.into_scalar::<f32>() as f64;
                    }
                    l.ddp()
                        .with_group(|pg| pg.all_reduce(&mut sums, ReduceOp::Sum))?;
                    Ok(sums[0])
                })
                .map_err(e)?;
            if let Some(loss) = eval
                && rank == 0
            {
                println!("EVAL {done} loss={:016x}", loss.to_bits());
            }
        }
        if done >= args.steps {
            break;
        }
        if victim && args.die_at_step == Some(done) && !args.die_in_eval {
            die_now();
        }
        if victim
            && done == 1
            && let Some(ms) = args.die_after_ms
        {
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                die_now();
            });
        }
        let recoveries = live.recoveries();
        let summed = live
            .step(LR, |model, progress| {
                let (x, y) = batch(rank, progress.step, b, &device);
                let loss = (model.forward(x) - y).powi_scalar(2).mean();
                let value = loss.clone().into_scalar::<f32>() as f64;
                (GradientsParams::from_grads(loss.backward(), model), [value])
            })
            .map_err(e)?;
        if live.recoveries() > recoveries {
            println!("RECOVERED rank={rank} step={}", live.progress().step);
        }
        if let Some([loss]) = summed {
            *live.state_mut() += loss;
            println!("STEP {done} loss={:016x}", loss.to_bits());
        }
    }
    let recoveries = live.recoveries();
    let (model, _, progress, sum) = live.into_parts();
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    burn_ddp::checkpoint::commit_running_states(&model);
    write_f32(&args.out.join(format!("rank{rank}.f32")), &flatten(&model))
        .map_err(|e| e.to_string())?;
    ddp.barrier().map_err(e)?;
    println!(
        "END rank={rank} pid={pid} steps={} recoveries={recoveries} sum={:016x}",
        progress.step,
        sum.to_bits()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    burn_ddp::report_panics_as_errors("live_worker");
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("live_worker: {err}");
            ExitCode::FAILURE
        }
    }
}
