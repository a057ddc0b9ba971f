//! A SyncBatchNorm rank for `tests/sync_batch_norm.rs`: joins the process group from the torchrun
//! environment, runs the case's training steps on its shard and writes what it saw as JSON.
//!
//! Usage: `syncbn_worker CASE.json OUT_DIR` (writes `OUT_DIR/rank{RANK}.json`).

use std::process::ExitCode;

use burn::module::Param;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::Ddp;
use burn_ddp::sync_batch_norm::{
    RunningVariance, SyncBatchNorm, SyncBatchNormConfig, SyncBatchNormImpl,
};
use ddp_comm::ReduceOp;
use ddp_testkit::syncbn_case::{Case, RankResult, StepResult};

/// Joins the job on the case's device: a fixed device for flex/wgpu, CUDA device `LOCAL_RANK`
/// (device 0 when only one is visible) with the case's NCCL policy for cuda.
fn join(case: &Case) -> Result<Ddp, String> {
    let builder = Ddp::builder();
    let builder = match case.device.as_str() {
        "flex" => builder.device(Device::flex()),
        #[cfg(feature = "wgpu")]
        "wgpu" => builder.device(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(feature = "cpu")]
        "cpu" => builder.device(Device::cpu()),
        "cuda" => builder.cuda().nccl(if case.nccl {
            burn_ddp::NcclPolicy::Required
        } else {
            burn_ddp::NcclPolicy::Disabled
        }),
        other => return Err(format!("unknown or disabled device {other:?}")),
    };
    builder.init().map_err(|e| e.to_string())
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default()
}

fn run(case_path: &str, out_dir: &str) -> Result<(), String> {
    let case: Case = serde_json::from_slice(
        &std::fs::read(case_path).map_err(|e| format!("reading {case_path}: {e}"))?,
    )
    .map_err(|e| format!("parsing {case_path}: {e}"))?;
    let ddp = join(&case)?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if world != case.rows.len() {
        return Err(format!(
            "world size {world} but the case has {} ranks",
            case.rows.len()
        ));
    }
    if case.nccl && !ddp.uses_nccl() {
        return Err("the case asks for NCCL but Ddp created no communicator".into());
    }

    let device = ddp.device().clone().autodiff();
    let channels = case.channels;
    let mut layer: SyncBatchNorm = SyncBatchNormConfig::new(channels)
        .with_running_variance(if case.unbiased {
            RunningVariance::Unbiased
        } else {
            RunningVariance::Biased
        })
        .with_implementation(if case.tensor_ops {
            SyncBatchNormImpl::TensorOps
        } else {
            SyncBatchNormImpl::Auto
        })
        .init(&device);
    layer.gamma = Param::from_data(TensorData::new(case.gamma.clone(), [channels]), &device);
    layer.beta = Param::from_data(TensorData::new(case.beta.clone(), [channels]), &device);

    let shape = case.shape(case.rows[rank]);
    let mut result = RankResult::default();
    for step in &case.steps {
        let (x, w) = (step.x[rank].clone(), step.w[rank].clone());
        let step = match shape.len() {
            2 => train_step::<2>(&layer, x, w, &shape, &device),
            3 => train_step::<3>(&layer, x, w, &shape, &device),
            4 => train_step::<4>(&layer, x, w, &shape, &device),
            n => return Err(format!("unsupported input rank {n}")),
        };
        let mut step = step.map_err(|e| format!("rank {rank}: {e}"))?;
        // DDP's averaging of parameter gradients.
        ddp.with_group(|pg| {
            pg.all_reduce(&mut step.gamma_grad, ReduceOp::Mean)?;
            pg.all_reduce(&mut step.beta_grad, ReduceOp::Mean)
        })
        .map_err(|e| e.to_string())?;
        result.steps.push(step);
    }
    result.running_mean = values(layer.running_mean.value_sync());
    result.running_var = values(layer.running_var.value_sync());

    let out = std::path::Path::new(out_dir).join(format!("rank{rank}.json"));
    std::fs::write(
        &out,
        serde_json::to_vec(&result).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("writing {}: {e}", out.display()))
}

/// Forward, `Σ w ⊙ y` loss, backward: output, input gradient and local γ/β gradients.
fn train_step<const D: usize>(
    layer: &SyncBatchNorm,
    x: Vec<f32>,
    w: Vec<f32>,
    shape: &[usize],
    device: &Device,
) -> Result<StepResult, burn_ddp::sync_batch_norm::SyncBatchNormError> {
    let x = Tensor::<D>::from_data(TensorData::new(x, shape.to_vec()), device).require_grad();
    let w = Tensor::<D>::from_data(TensorData::new(w, shape.to_vec()), device);
    let y = layer.try_forward(x.clone())?;
    let grads = (y.clone() * w).sum().backward();
    let channels = shape[1];
    Ok(StepResult {
        y: values(y),
        x_grad: x.grad(&grads).map(values).unwrap_or_default(),
        gamma_grad: layer
            .gamma
            .grad(&grads)
            .map(values)
            .unwrap_or(vec![0.0; channels]),
        beta_grad: layer
            .beta
            .grad(&grads)
            .map(values)
            .unwrap_or(vec![0.0; channels]),
    })
}

fn main() -> ExitCode {
    burn_ddp::report_panics_as_errors("syncbn_worker");
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: syncbn_worker CASE.json OUT_DIR");
        return ExitCode::from(2);
    }
    match run(&args[1], &args[2]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("syncbn_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
