//! Rank program for the DDP integration tests (`tests/ddp.rs`).
//!
//! Every scenario trains a small MLP (no BatchNorm) on deterministic synthetic data with
//! `burn_ddp`, writes this rank's final parameters to `OUT/rank{r}.f32`, and — on rank 0 — runs
//! the single-process reference on the joined batch from the same initial weights and writes
//! `OUT/reference.f32`. Ranks start from *different* random initialisations (seed 1000 + rank),
//! so equality proves the broadcast. After every step all ranks compare a hash of their
//! parameters and the program fails unless they are bitwise identical.
//!
//! Scenarios: `equiv` (N ranks × batch b vs 1 × N·b), `accum` (4 micro-batches per step),
//! `unused` (a branch used only on rank 1, another never used), `mismatch` (rank 1 builds a
//! different model: must fail on every rank), `learner` (burn-train `Learner` vs the loop),
//! `live` (the loop `Ddp::recover` makes recoverable; `--victim R --die-at-step K` makes rank R
//! SIGKILL itself before step K, so that the others lose it in that step's gradient all-reduce;
//! a replacement started by `ddprun --recover live` does not).

use std::path::PathBuf;
use std::process::ExitCode;

use burn::data::dataloader::{DataLoaderBuilder, batcher::Batcher};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{
    AdamConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig,
    momentum::MomentumConfig,
};
use burn::tensor::{Device, Tensor};
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::recovery::StepStart;
use burn_ddp::sync_batch_norm::{SyncBatchNorm, SyncBatchNormConfig};
use burn_ddp::{Ddp, DdpModel, DdpOptimizer, SilentRenderer};
use clap::{Parser, ValueEnum};
use ddp_tests::{check_identical, flatten, write_f32};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Equiv,
    Accum,
    Unused,
    Mismatch,
    Learner,
    Live,
}

/// The device the ranks train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// Flex (CPU).
    Cpu,
    /// The default wgpu adapter (needs the `wgpu` feature); several ranks may share one GPU.
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// CubeCL's CPU runtime (burn-cpu: kernels compiled by LLVM; needs the `cpu` feature).
    #[cfg(feature = "cpu")]
    BurnCpu,
    /// CUDA device `LOCAL_RANK` (device 0 when one is visible; needs the `cuda` feature).
    /// `DDP_NCCL` picks the gradient path; with NCCL every sync must take the device path.
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Optim {
    Sgd,
    Adam,
}

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum)]
    scenario: Scenario,
    #[arg(long, value_enum, default_value = "sgd")]
    optim: Optim,
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Per-rank batch (per micro-batch for `accum`).
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    micro: usize,
    /// Gradient bucket cap in bytes (small values force several buckets).
    #[arg(long, default_value_t = burn_ddp::DEFAULT_BUCKET_CAP_BYTES)]
    bucket_bytes: usize,
    #[arg(long)]
    out: PathBuf,
    /// Device of every rank.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// `live`: the ranks that kill themselves (`--victim 1,2`), in the job's first attempt.
    #[arg(long, value_delimiter = ',')]
    victim: Vec<usize>,
    /// `live`: the step before which the victim kills itself.
    #[arg(long)]
    die_at_step: Option<u64>,
    /// `live`: the step before which each victim kills itself, by its place in `--victim`
    /// (instead of `--die-at-step`).
    #[arg(long, value_delimiter = ',')]
    die_at_steps: Vec<u64>,
    /// `live`: the victim kills itself this many milliseconds after its first step, wherever
    /// it then is (forward, backward, all-reduce, optimizer step).
    #[arg(long)]
    die_after_ms: Option<u64>,
    /// `live`: the optimizer state sharded across the ranks (ZeRO-1, `DdpOptimizer::sharded`).
    #[arg(long)]
    sharded: bool,
    /// `live`: SyncBatchNorm in the network; each step's forward and backward run inside
    /// `Ddp::catch_lost_peer`, from a `StepStart`.
    #[arg(long)]
    sync_bn: bool,
    /// `live`: the victim dies at its step after the forward pass, before the backward pass:
    /// the others lose it inside SyncBatchNorm's backward exchange.
    #[arg(long)]
    die_before_backward: bool,
    /// `live`: the victim exits with code 1 (an error of its own) before this step, in the
    /// job's first attempt.
    #[arg(long)]
    fail_at_step: Option<u64>,
    /// `live`: before this step the victim waits for the file `kill-launcher-now` under
    /// `--out` (60 s at most), then SIGKILLs its launcher (its parent): the whole node is lost,
    /// the victim with it (its parent-death signal).
    #[arg(long)]
    kill_launcher_at_step: Option<u64>,
    /// `live`: the victim stops itself (SIGSTOP) before this step: a hung rank.
    #[arg(long)]
    stop_at_step: Option<u64>,
    /// `live`: how many of each victim's replacements die too (each after the one before),
    /// counted in files under `--out`.
    #[arg(long, default_value_t = 0)]
    replacement_deaths: u32,
    /// `live`: a replacement that dies SIGKILLs itself this many milliseconds after its process
    /// started (before, while or after it joins the group).
    #[arg(long)]
    replacement_dies_after_ms: Option<u64>,
    /// `live`: a replacement that dies SIGKILLs itself right after it claimed its slot in the
    /// group's generation (ddp-comm's test knob `DDP_GROUP_FAULT=die-after-claim`).
    #[arg(long)]
    replacement_dies_after_claim: bool,
    /// `live`: `R:MS`: survivor rank R (its first process, in the first attempt) SIGKILLs itself
    /// MS milliseconds into its first recovery (re-forming the group, handing the state over).
    #[arg(long, value_parser = parse_rank_ms)]
    survivor_dies_in_recovery: Option<(usize, u64)>,
    /// Rank 0 compares its parameters with the single-process reference and fails above this
    /// max |Δparam| (prints an `OUTCOME` line; the GPU check script uses it).
    #[arg(long)]
    check: Option<f32>,
}

/// `R:MS` of `--survivor-dies-in-recovery`.
fn parse_rank_ms(s: &str) -> Result<(usize, u64), String> {
    let (r, ms) = s.split_once(':').ok_or("expected RANK:MS")?;
    Ok((
        r.parse().map_err(|e| format!("rank: {e}"))?,
        ms.parse().map_err(|e| format!("ms: {e}"))?,
    ))
}

/// SIGKILLs this process, saying when (wall-clock ms) on stdout first.
fn die_now() {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!("DYING at={at}");
    // SAFETY: kill and getpid have no preconditions.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

/// First thing in a replacement of a victim rank (`DDP_REJOIN=1`): whether it is one of the
/// `--replacement-deaths` that die, counted in `OUT/replacement-deaths-rank{R}`; if so, it
/// arms its death (a timer from now, or ddp-comm's knob after its claim).
fn arm_replacement_death(args: &Args) -> Result<(), String> {
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    if !ddp_comm::env::rejoining() || !args.victim.contains(&rank) || args.replacement_deaths == 0 {
        return Ok(());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    let counter = args.out.join(format!("replacement-deaths-rank{rank}"));
    let died = match std::fs::read_to_string(&counter) {
        Ok(t) => t.trim().parse::<u32>().map_err(|e| e.to_string())?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(format!("{}: {e}", counter.display())),
    };
    if died >= args.replacement_deaths {
        return Ok(());
    }
    std::fs::write(&counter, (died + 1).to_string()).map_err(|e| e.to_string())?;
    if args.replacement_dies_after_claim {
        // SAFETY: set before any other thread of this process starts.
        unsafe { std::env::set_var("DDP_GROUP_FAULT", "die-after-claim") };
    } else if let Some(ms) = args.replacement_dies_after_ms {
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(ms));
            die_now();
        });
    }
    Ok(())
}

const IN: usize = 6;
const HIDDEN: usize = 16;
const OUT: usize = 3;
const LR: f64 = 0.05;

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    /// `live --sync-bn` only: SyncBatchNorm after `fc1` (its exchange runs inside Burn's
    /// forward and backward).
    bn: Option<SyncBatchNorm>,
    fc2: Linear,
    /// Used only by rank 1's samples in the `unused` scenario.
    branch: Linear,
    /// Never used: must get no gradient and stay unchanged.
    never: Linear,
    act: Relu,
}

impl Mlp {
    fn new(hidden: usize, device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(IN, hidden).init(device),
            bn: None,
            fc2: LinearConfig::new(hidden, OUT).init(device),
            branch: LinearConfig::new(hidden, OUT).init(device),
            never: LinearConfig::new(hidden, OUT).init(device),
            act: Relu::new(),
        }
    }

    /// The same network with SyncBatchNorm after its first layer.
    fn with_sync_bn(self, device: &Device) -> Self {
        let hidden = self.fc1.weight.dims()[1];
        Mlp {
            bn: Some(SyncBatchNormConfig::new(hidden).init(device)),
            ..self
        }
    }

    fn forward(&self, x: Tensor<2>, use_branch: bool) -> Tensor<2> {
        let h = self.fc1.forward(x);
        let h = match &self.bn {
            Some(bn) => {
                let [n, hidden] = h.dims();
                bn.forward(h.reshape([n, hidden, 1])).reshape([n, hidden])
            }
            None => h,
        };
        let h = self.act.forward(h);
        let y = self.fc2.forward(h.clone());
        if use_branch {
            y + self.branch.forward(h)
        } else {
            y
        }
    }
}

fn batch(indices: impl Iterator<Item = usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    ddp_tests::batch::<IN, OUT>(indices, device)
}

fn mse(pred: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (pred - y).powi_scalar(2).mean()
}

/// Global sample indices of `rank`'s micro-batch `m` of step `step`.
fn shard(
    step: usize,
    m: usize,
    rank: usize,
    world: usize,
    b: usize,
    micro: usize,
) -> std::ops::Range<usize> {
    let start = ((step * micro + m) * world + rank) * b;
    start..start + b
}

fn optimizer(o: Optim) -> ModuleOptimizer {
    match o {
        Optim::Sgd => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init(),
        Optim::Adam => AdamConfig::new().init(),
    }
}

/// A batch for burn-train.
#[derive(Debug, Clone)]
struct XyBatch {
    x: Tensor<2>,
    y: Tensor<2>,
}

/// Turns sample indices into a batch.
#[derive(Debug, Clone)]
struct IndexBatcher;

impl Batcher<usize, XyBatch> for IndexBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> XyBatch {
        let (x, y) = batch(items.into_iter(), device);
        XyBatch { x, y }
    }
}

impl TrainStep for Mlp {
    type Input = XyBatch;
    type Output = RegressionOutput;

    fn step(&self, b: XyBatch) -> TrainOutput<RegressionOutput> {
        let output = self.forward(b.x, false);
        let loss = mse(output.clone(), b.y.clone());
        let grads = loss.backward();
        TrainOutput::new(
            self,
            grads,
            RegressionOutput {
                loss,
                output,
                targets: b.y,
            },
        )
    }
}

impl InferenceStep for Mlp {
    type Input = XyBatch;
    type Output = RegressionOutput;

    fn step(&self, b: XyBatch) -> RegressionOutput {
        let output = self.forward(b.x, false);
        let loss = mse(output.clone(), b.y.clone());
        RegressionOutput {
            loss,
            output,
            targets: b.y,
        }
    }
}

/// The same training twice from the same replicated weights: with burn-train's
/// `SupervisedTraining` on a `DdpModel`, and with the hand-written `DdpOptimizer` loop.
fn run_learner(args: &Args, ddp: &Ddp, initial: Mlp, device: &Device) -> Result<(), String> {
    let (rank, world, b) = (ddp.rank(), ddp.world_size(), args.batch);
    let mut model = initial.clone();
    let mut optim = DdpOptimizer::new(ddp, optimizer(args.optim));
    for step in 0..args.steps {
        let (x, y) = batch(shard(step, 0, rank, world, b, 1), device);
        let loss = mse(model.forward(x, false), y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim
            .try_step(LR, model, grads)
            .map_err(|e| e.to_string())?;
    }
    if ddp.is_main() {
        write_f32(&args.out.join("reference.f32"), &flatten(&model)).map_err(|e| e.to_string())?;
    }

    let shard_items: Vec<usize> = (0..args.steps)
        .flat_map(|s| shard(s, 0, rank, world, b, 1))
        .collect();
    let train = DataLoaderBuilder::new(IndexBatcher)
        .batch_size(b)
        .set_device(device.clone())
        .build(InMemDataset::new(shard_items));
    let valid = DataLoaderBuilder::new(IndexBatcher)
        .batch_size(b)
        .set_device(device.clone())
        .build(InMemDataset::new((0..b).collect::<Vec<usize>>()));
    let learner = Learner::new(DdpModel::new(ddp, initial), optimizer(args.optim), LR);
    let mut training =
        SupervisedTraining::new(args.out.join(format!("learner-rank{rank}")), train, valid)
            .num_epochs(1);
    if !ddp.is_main() {
        training = training.renderer(Box::new(SilentRenderer));
    }
    let result = training.launch(learner);
    if let Some(e) = result.error {
        return Err(format!("learner failed: {e}"));
    }
    let model = result.model.into_inner();
    check_identical(ddp, &model, args.steps)?;
    write_f32(&args.out.join(format!("rank{rank}.f32")), &flatten(&model))
        .map_err(|e| e.to_string())?;
    ddp.barrier().map_err(|e| e.to_string())
}

/// The `live` scenario: SGD with momentum (its state must be handed over too), every step's
/// batch a function of the step; on a lost peer, [`Ddp::recover`] and the step again. Prints
/// `PID rank=R pid=P` at the start and `END rank=R pid=P steps=N` at the end (the survivors'
/// must match), `RECOVERED rank=R step=K ms=T` after each recovery (T: the time `recover` took),
/// and the wall-clock milliseconds of a death (`DYING at=…`) and of a replacement's first
/// finished step (`FIRST STEP rank=R at=…`), for the time a recovery costs.
fn run_live(args: &Args, ddp: &Ddp) -> Result<(), String> {
    use burn_ddp::checkpoint::Progress;
    let (rank, world, b) = (ddp.rank(), ddp.world_size(), args.batch);
    let pid = std::process::id();
    println!("PID rank={rank} pid={pid}");
    let device = ddp.device().clone().autodiff();
    device.seed(1000 + rank as u64);
    let e = |e: burn_ddp::DdpError| e.to_string();
    let mlp = Mlp::new(HIDDEN, &device);
    let mlp = if args.sync_bn {
        mlp.with_sync_bn(&device)
    } else {
        mlp
    };
    let mut model = ddp.replicate_model(mlp).map_err(e)?;
    let mut optim = if args.sharded {
        DdpOptimizer::sharded(ddp, optimizer(Optim::Sgd))
    } else {
        DdpOptimizer::new(ddp, optimizer(Optim::Sgd))
    };
    let mut progress = Progress::default();
    let unix_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    };
    let die = die_now;
    // Only the first process of a victim rank, in the job's first attempt, dies.
    let first_attempt = std::env::var("DDP_RESTART_COUNT").map_or(true, |c| c == "0");
    let victim = args.victim.contains(&rank) && !ddp.is_replacement() && first_attempt;
    let recoveries = std::cell::Cell::new(0u32);
    let recover = |model, optim: &mut DdpOptimizer, progress| {
        let t = std::time::Instant::now();
        if let Some((r, ms)) = args.survivor_dies_in_recovery
            && r == rank
            && first_attempt
            && !ddp.is_replacement()
            && recoveries.replace(recoveries.get() + 1) == 0
        {
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                die_now();
            });
        }
        let (model, progress): (Mlp, Progress) = ddp.recover(model, optim, progress).map_err(e)?;
        println!(
            "RECOVERED rank={rank} step={} ms={:.1} generation={}",
            progress.step,
            t.elapsed().as_secs_f64() * 1e3,
            ddp.with_group(|pg| pg.generation())
        );
        Ok::<_, String>((model, progress))
    };
    let mut first_step = ddp.is_replacement();
    if ddp.is_replacement() {
        (model, progress) = recover(model, &mut optim, progress)?;
    }
    while progress.step < args.steps as u64 {
        let step = progress.step;
        let my_death = args
            .victim
            .iter()
            .position(|&v| v == rank)
            .and_then(|i| args.die_at_steps.get(i).copied())
            .or(args.die_at_step);
        if victim && my_death == Some(step) && !args.die_before_backward {
            die();
        }
        if victim && args.fail_at_step == Some(step) {
            return Err(format!(
                "failing on purpose before step {step} (--fail-at-step)"
            ));
        }
        if victim && args.kill_launcher_at_step == Some(step) {
            let go = args.out.join("kill-launcher-now");
            let waited = std::time::Instant::now();
            while !go.exists() && waited.elapsed() < std::time::Duration::from_secs(60) {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            println!("KILLING LAUNCHER rank={rank} at={}", unix_ms());
            // SAFETY: getppid and kill have no preconditions.
            unsafe { libc::kill(libc::getppid(), libc::SIGKILL) };
            // The parent-death signal follows; never go on as if nothing happened.
            std::thread::sleep(std::time::Duration::from_secs(30));
            return Err("the launcher was killed but this rank was not".into());
        }
        if victim && args.stop_at_step == Some(step) {
            println!("STOPPING rank={rank} at={}", unix_ms());
            // SAFETY: raise has no preconditions.
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        if victim
            && step == 1
            && let Some(ms) = args.die_after_ms
        {
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                die();
            });
        }
        let (x, y) = batch(shard(step as usize, 0, rank, world, b, 1), &device);
        let start = (args.sync_bn && ddp.recovers_live()).then(|| StepStart::take(&model));
        let dies_in_backward = victim && my_death == Some(step) && args.die_before_backward;
        let passes = ddp.catch_lost_peer(|| {
            let loss = mse(model.forward(x, false), y);
            if dies_in_backward {
                die();
            }
            GradientsParams::from_grads(loss.backward(), &model)
        });
        let grads = match passes {
            Ok(g) => g,
            Err(err) if err.lost_a_peer() => {
                eprintln!("rank {rank}: lost a peer in step {step}'s forward or backward: {err}");
                let before = match start {
                    Some(s) => s.restore(model),
                    None => model,
                };
                (model, progress) = recover(before, &mut optim, progress)?;
                continue;
            }
            Err(err) => return Err(err.to_string()),
        };
        match optim.try_step(LR, model.clone(), grads) {
            Ok(m) => {
                model = m;
                progress.step += 1;
                if ddp.uses_nccl() && !optim.synchronizer_mut().last_sync_on_device() {
                    return Err(format!(
                        "step {step}: an NCCL communicator exists but the gradients took the \
                         host path"
                    ));
                }
                if std::mem::take(&mut first_step) {
                    println!("FIRST STEP rank={rank} at={}", unix_ms());
                }
            }
            Err(err) if err.lost_a_peer() => {
                eprintln!("rank {rank}: lost a peer in step {step}: {err}");
                let before = match start {
                    Some(s) => s.restore(model),
                    None => model,
                };
                (model, progress) = recover(before, &mut optim, progress)?;
            }
            Err(err) => return Err(err.to_string()),
        }
    }
    check_identical(ddp, &model, args.steps)?;
    // A replacement is a rank like the others once it recovered: a later replicate_model
    // broadcasts to it as to any rank (a collective every rank makes).
    if ddp.is_replacement() {
        return Err("still a replacement after its recovery".into());
    }
    let model = ddp.replicate_model(model).map_err(e)?;
    check_identical(ddp, &model, args.steps)?;
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    write_f32(&args.out.join(format!("rank{rank}.f32")), &flatten(&model))
        .map_err(|e| e.to_string())?;
    println!("END rank={rank} pid={pid} steps={}", progress.step);
    Ok(())
}

fn run(args: &Args) -> Result<(), String> {
    let builder = Ddp::builder().bucket_cap_bytes(args.bucket_bytes);
    let builder = if args.scenario == Scenario::Live {
        builder.live_recovery()
    } else {
        builder
    };
    let builder = match args.device {
        DeviceArg::Cpu => builder.device(Device::flex()),
        #[cfg(feature = "wgpu")]
        DeviceArg::Wgpu => builder.device(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(feature = "cpu")]
        DeviceArg::BurnCpu => builder.device(Device::cpu()),
        DeviceArg::Cuda => builder.cuda(),
    };
    let ddp = builder.init().map_err(|e| e.to_string())?;
    if args.scenario == Scenario::Live {
        return run_live(args, &ddp);
    }
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let device = ddp.device().clone().autodiff();
    device.seed(1000 + rank as u64);
    let hidden = if args.scenario == Scenario::Mismatch && rank == 1 {
        HIDDEN + 1
    } else {
        HIDDEN
    };
    let model = Mlp::new(hidden, &device);
    let model = ddp.replicate_model(model).map_err(|e| e.to_string())?;
    let initial = model.clone();
    check_identical(&ddp, &model, 0)?;
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    if args.scenario == Scenario::Learner {
        return run_learner(args, &ddp, model, &device);
    }

    let use_branch = |r: usize| args.scenario == Scenario::Unused && r == 1;
    let (b, micro) = (args.batch, args.micro);
    let mut optim = DdpOptimizer::new(&ddp, optimizer(args.optim));
    let mut model = model;
    for step in 0..args.steps {
        let mut acc = GradientsAccumulator::<Mlp>::new();
        for m in 0..micro {
            let (x, y) = batch(shard(step, m, rank, world, b, micro), &device);
            let loss = mse(model.forward(x, use_branch(rank)), y).div_scalar(micro as f64);
            acc.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        model = optim
            .try_step(LR, model, acc.grads())
            .map_err(|e| e.to_string())?;
        if ddp.uses_nccl() && !optim.synchronizer_mut().last_sync_on_device() {
            return Err(format!(
                "step {step}: an NCCL communicator exists but the gradients took the host path"
            ));
        }
        check_identical(&ddp, &model, step + 1)?;
    }
    write_f32(&args.out.join(format!("rank{rank}.f32")), &flatten(&model))
        .map_err(|e| e.to_string())?;

    // Single-process reference on the joined batch, same initial weights, no communication.
    ddp.run_on_main(|| -> Result<(), String> {
        let mut model = initial;
        let mut optim = optimizer(args.optim);
        for step in 0..args.steps {
            let loss = if args.scenario == Scenario::Unused {
                // The branch applies to rank 1's samples only: mean of per-shard means.
                let mut sum: Option<Tensor<1>> = None;
                for m in 0..micro {
                    for r in 0..world {
                        let (x, y) = batch(shard(step, m, r, world, b, micro), &device);
                        let l = mse(model.forward(x, use_branch(r)), y);
                        sum = Some(match sum {
                            Some(s) => s + l,
                            None => l,
                        });
                    }
                }
                sum.expect("at least one shard")
                    .div_scalar((world * micro) as f64)
            } else {
                // One forward over the joined batch of N·micro·b samples.
                let all = (0..micro)
                    .flat_map(|m| (0..world).flat_map(move |r| shard(step, m, r, world, b, micro)));
                let (x, y) = batch(all, &device);
                mse(model.forward(x, false), y)
            };
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(LR, model, grads);
        }
        write_f32(&args.out.join("reference.f32"), &flatten(&model)).map_err(|e| e.to_string())
    })
    .map_err(|e| e.to_string())?
    .transpose()?;
    ddp.barrier().map_err(|e| e.to_string())?;
    if let (Some(tol), true) = (args.check, ddp.is_main()) {
        let read = |f: &str| {
            std::fs::read(args.out.join(f))
                .map(|b| {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect::<Vec<f32>>()
                })
                .map_err(|e| format!("{f}: {e}"))
        };
        let (mine, reference) = (read("rank0.f32")?, read("reference.f32")?);
        let max = mine
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let path = if ddp.uses_nccl() {
            "NCCL on device memory"
        } else {
            "host-staged"
        };
        println!(
            "OUTCOME {world} ranks × batch {b} ({:?}, {:?}, gradients {path}) vs 1 process × {}: max |Δparam| = {max:.1e}, ranks bitwise identical every step",
            args.device,
            args.optim,
            world * b
        );
        if mine.len() != reference.len() || max.is_nan() || max > tol {
            return Err(format!("max |Δparam| = {max:e} > {tol:e}"));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    burn_ddp::report_panics_as_errors("ddp_worker");
    let args = Args::parse();
    if let Err(e) = arm_replacement_death(&args) {
        eprintln!("ddp_worker error: {e}");
        return ExitCode::from(3);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ddp_worker error: {e}");
            ExitCode::from(3)
        }
    }
}
