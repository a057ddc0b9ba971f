//! Rank program of the hang doctor's tests (`tests/hang_doctor.rs`): a small MLP trained with
//! `DdpOptimizer` (which marks the sync and optimizer phases and labels its collectives), the
//! data and forward phases marked as a program marks them, an evaluation loss all-reduced
//! after the last step (label `evaluation loss`), then a checkpoint phase.
//!
//! `--scenario` makes rank `--victim` misbehave at step `--at-step` (printing
//! `HANG-START <unix ms> pid=<its pid>` the moment it does): `data-sleep` (its data loader sleeps),
//! `compute-loop` (its forward spins), `deadlock` (two threads of its own lock two mutexes in
//! opposite orders), `sigstop` (it stops itself), `skip` (it skips the evaluation all-reduce),
//! `extra` (it calls the evaluation all-reduce twice), `slow` (its forward takes three times
//! as long from the first step: a straggler, the job completes), `fail` (it exits with an
//! error). `healthy`: nobody does.
//! Every rank sleeps `--checkpoint-ms` in its checkpoint phase, prints
//! `END rank=R sum=BITS` (a hash of its parameters) and exits.

use std::process::ExitCode;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::doctor::{self, Label, Phase};
use burn_ddp::{Ddp, DdpOptimizer};
use clap::{Parser, ValueEnum};
use ddp_tests::flatten;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Healthy,
    DataSleep,
    ComputeLoop,
    Deadlock,
    Sigstop,
    Skip,
    Extra,
    Slow,
    Fail,
}

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum)]
    scenario: Scenario,
    #[arg(long, default_value_t = 1)]
    victim: usize,
    #[arg(long, default_value_t = 3)]
    at_step: u64,
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Each forward's work, in milliseconds (a sleep: the ranks share two cores).
    #[arg(long, default_value_t = 20)]
    work_ms: u64,
    #[arg(long, default_value_t = 0)]
    checkpoint_ms: u64,
}

const IN: usize = 8;

#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            fc1: LinearConfig::new(IN, 16).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(16, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

fn hang_start() {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!("HANG-START {ms} pid={}", std::process::id());
}

/// The data loader: the batch of (rank, step); the victim's sleeps under `data-sleep`.
fn load_batch(device: &Device, rank: usize, step: u64, stuck: bool) -> (Tensor<2>, Tensor<2>) {
    if stuck {
        hang_start();
        std::thread::sleep(Duration::from_secs(600));
    }
    let b = 4;
    let mut x = Vec::with_capacity(b * IN);
    let mut y = Vec::with_capacity(b);
    for i in 0..b {
        let t = (step as usize * 31 + rank * 7 + i) as f32;
        let row: Vec<f32> = (0..IN).map(|j| (t * 0.37 + j as f32 * 1.3).sin()).collect();
        y.push(row.iter().sum::<f32>() * 0.2);
        x.extend(row);
    }
    (
        Tensor::from_data(TensorData::new(x, [b, IN]), device),
        Tensor::from_data(TensorData::new(y, [b, 1]), device),
    )
}

/// The forward's work: a sleep of `ms`; the victim's spins forever under `compute-loop`.
fn forward_work(ms: u64, spin: bool) {
    if spin {
        hang_start();
        let mut x = 1u64;
        loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
    std::thread::sleep(Duration::from_millis(ms));
}

/// Two threads take two locks in opposite orders: neither ever returns.
fn deadlock() {
    let a = Arc::new(Mutex::new(0u32));
    let b = Arc::new(Mutex::new(0u32));
    let both = Arc::new(Barrier::new(2));
    let (a2, b2, both2) = (a.clone(), b.clone(), both.clone());
    let other = std::thread::spawn(move || {
        let _b = b2.lock().unwrap();
        both2.wait();
        let _a = a2.lock().unwrap();
    });
    let _a = a.lock().unwrap();
    both.wait();
    hang_start();
    let _b = b.lock().unwrap();
    other.join().unwrap();
}

fn run(args: &Args) -> Result<(), String> {
    let e = |e: burn_ddp::DdpError| e.to_string();
    let ddp = Ddp::builder().device(Device::flex()).init().map_err(e)?;
    let rank = ddp.rank();
    let device = ddp.device().clone().autodiff();
    device.seed(7);
    let mut model = ddp.replicate_model(Net::new(&device)).map_err(e)?;
    let mut optim = DdpOptimizer::new(&ddp, SgdConfig::new().init());
    let victim = rank == args.victim;
    let now = |s: Scenario, step: u64| victim && args.scenario == s && step == args.at_step;
    for step in 0..args.steps {
        doctor::set_phase(Phase::Data);
        let (x, y) = load_batch(&device, rank, step, now(Scenario::DataSleep, step));
        doctor::set_phase(Phase::Forward);
        let slow = victim && args.scenario == Scenario::Slow;
        forward_work(
            args.work_ms * if slow { 3 } else { 1 },
            now(Scenario::ComputeLoop, step),
        );
        if now(Scenario::Deadlock, step) {
            deadlock();
        }
        if now(Scenario::Fail, step) {
            return Err(format!("rank {rank} fails at step {step} (injected)"));
        }
        if now(Scenario::Sigstop, step) {
            hang_start();
            // SAFETY: kill and getpid have no preconditions.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        }
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        doctor::set_phase(Phase::Backward);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.try_step(0.05, model, grads).map_err(e)?;
        if rank == 0 {
            println!("STEP {step}");
        }
    }
    // The evaluation: every rank's loss averaged (the victim skips it, or calls it twice).
    doctor::set_phase(Phase::Other);
    let (x, y) = load_batch(&device, rank, args.steps, false);
    let loss = (model.forward(x) - y)
        .powi_scalar(2)
        .mean()
        .into_scalar::<f32>();
    let calls = match args.scenario {
        Scenario::Skip if victim => {
            hang_start();
            0
        }
        Scenario::Extra if victim => 2,
        _ => 1,
    };
    for call in 0..calls {
        if call == 1 {
            hang_start();
        }
        let mut values = [f64::from(loss)];
        doctor::label_next(Label::new("evaluation loss"));
        ddp.average_scalars(&mut values).map_err(e)?;
    }
    let _checkpoint = doctor::enter(Phase::Checkpoint);
    std::thread::sleep(Duration::from_millis(args.checkpoint_ms));
    let params = flatten(&model);
    let sum = params
        .iter()
        .fold(0u64, |h, v| h.rotate_left(5) ^ u64::from(v.to_bits()));
    println!("END rank={rank} sum={sum:016x}");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    burn_ddp::report_panics_as_errors("hang_worker");
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hang_worker: {err}");
            ExitCode::FAILURE
        }
    }
}
