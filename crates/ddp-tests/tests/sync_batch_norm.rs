//! SyncBatchNorm equivalence tests.
//!
//! - World size 1 (no process group): `SyncBatchNorm` ≡ `burn::nn::BatchNorm` — output, input
//!   gradient, γ/β gradients and running statistics — on Flex and, with `--features wgpu`, on
//!   wgpu with the CubeCL kernels and with the tensor-op path; kernels ≡ tensor ops on wgpu;
//!   with `--features cpu` the same on burn-cpu (CubeCL's CPU runtime, the kernels compiled by
//!   LLVM), two and three ranks included.
//! - World sizes 2 and 3 (real rank processes, `syncbn_worker`): every rank's output and input
//!   gradient equal `BatchNorm` on the concatenated batch; γ/β gradients after DDP averaging
//!   equal the joined-batch gradients divided by the world size (each rank's loss is `Σ w ⊙ y`
//!   over its own rows, so the ranks' losses sum to the joined batch's loss); running statistics
//!   equal on every rank.
//! - Mean 1000, std 0.01: batch statistics within 1e-4 relative of an f64 reference.
//! - Half-precision inputs (f16, bf16) with an M2 beyond f16's range: the f32 accumulation
//!   matches the f32 layer within half-precision rounding.
//!
//! Tolerances are relative to the largest magnitude of the reference tensor.
//!
//! Longer than 600 lines: one file so that `cargo test --test sync_batch_norm` runs the whole
//! equivalence matrix (worlds 1–3, Flex/wgpu/burn-cpu/CUDA, precisions) against one reference.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::sync_batch_norm::{
    RunningVariance, SyncBatchNorm, SyncBatchNormConfig, SyncBatchNormError, SyncBatchNormImpl,
};
use ddp_testkit::syncbn_case::{Case, RankResult, Step, StepResult};

const TOL: f64 = 1e-5;

// ---------------------------------------------------------------------------------------------
// Data

/// xorshift64* — deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Roughly normal (Irwin–Hall of 4).
    fn normal(&mut self) -> f64 {
        ((0..4).map(|_| self.uniform()).sum::<f64>() - 2.0) * 3f64.sqrt()
    }
    fn vec(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (mean + std * self.normal()) as f32)
            .collect()
    }
}

fn make_case(rows: &[usize], channels: usize, spatial: &[usize], steps: usize, seed: u64) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let per_row = channels * spatial.iter().product::<usize>();
    let steps = (0..steps)
        .map(|s| Step {
            // Non-zero, per-step different mean.
            x: rows
                .iter()
                .map(|&r| rng.vec(r * per_row, 2.0 + s as f64, 1.5))
                .collect(),
            w: rows
                .iter()
                .map(|&r| rng.vec(r * per_row, 0.0, 1.0))
                .collect(),
        })
        .collect();
    Case {
        device: "flex".into(),
        nccl: false,
        tensor_ops: false,
        unbiased: false,
        channels,
        spatial: spatial.to_vec(),
        rows: rows.to_vec(),
        gamma: (0..channels).map(|c| 1.0 + 0.25 * c as f32).collect(),
        beta: (0..channels).map(|c| 0.1 * c as f32 - 0.2).collect(),
        steps,
    }
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

// ---------------------------------------------------------------------------------------------
// Running one process

/// A norm layer under test: BatchNorm or SyncBatchNorm.
enum Layer {
    Bn(BatchNorm),
    Sync(SyncBatchNorm),
}

impl Layer {
    fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Layer::Bn(l) => l.forward(x),
            Layer::Sync(l) => l.forward(x),
        }
    }
    fn grads(&self, grads: &burn::tensor::Gradients) -> (Vec<f32>, Vec<f32>) {
        let (g, b) = match self {
            Layer::Bn(l) => (l.gamma.grad(grads), l.beta.grad(grads)),
            Layer::Sync(l) => (l.gamma.grad(grads), l.beta.grad(grads)),
        };
        (values(g.unwrap()), values(b.unwrap()))
    }
    fn running(&self) -> (Vec<f32>, Vec<f32>) {
        match self {
            Layer::Bn(l) => (
                values(l.running_mean.value_sync()),
                values(l.running_var.value_sync()),
            ),
            Layer::Sync(l) => (
                values(l.running_mean.value_sync()),
                values(l.running_var.value_sync()),
            ),
        }
    }
}

fn init_bn(case: &Case, device: &Device) -> BatchNorm {
    let mut bn = BatchNormConfig::new(case.channels).init(device);
    bn.gamma = Param::from_data(TensorData::new(case.gamma.clone(), [case.channels]), device);
    bn.beta = Param::from_data(TensorData::new(case.beta.clone(), [case.channels]), device);
    bn
}

fn init_sync(case: &Case, device: &Device) -> SyncBatchNorm {
    SyncBatchNorm::from_batch_norm(
        init_bn(case, device),
        if case.unbiased {
            RunningVariance::Unbiased
        } else {
            RunningVariance::Biased
        },
        if case.tensor_ops {
            SyncBatchNormImpl::TensorOps
        } else {
            SyncBatchNormImpl::Auto
        },
    )
}

fn step_on<const D: usize>(
    layer: &Layer,
    x: &[f32],
    w: &[f32],
    shape: &[usize],
    device: &Device,
) -> StepResult {
    let x =
        Tensor::<D>::from_data(TensorData::new(x.to_vec(), shape.to_vec()), device).require_grad();
    let w = Tensor::<D>::from_data(TensorData::new(w.to_vec(), shape.to_vec()), device);
    let y = layer.forward(x.clone());
    let grads = (y.clone() * w).sum().backward();
    let (gamma_grad, beta_grad) = layer.grads(&grads);
    StepResult {
        y: values(y),
        x_grad: values(x.grad(&grads).unwrap()),
        gamma_grad,
        beta_grad,
    }
}

/// Runs `case` on the concatenation of every rank's rows in this process.
fn run_joined(case: &Case, layer: &Layer, device: &Device) -> RankResult {
    let total: usize = case.rows.iter().sum();
    let shape = case.shape(total);
    let steps = case
        .steps
        .iter()
        .map(|s| {
            let x = s.x.concat();
            let w = s.w.concat();
            match shape.len() {
                2 => step_on::<2>(layer, &x, &w, &shape, device),
                3 => step_on::<3>(layer, &x, &w, &shape, device),
                4 => step_on::<4>(layer, &x, &w, &shape, device),
                n => panic!("rank {n}"),
            }
        })
        .collect();
    let (running_mean, running_var) = layer.running();
    RankResult {
        steps,
        running_mean,
        running_var,
    }
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-12);
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
    assert!(
        err <= tol * scale,
        "{what}: max error {err:e} > {tol:e} × {scale:e}\n got {:?}\nwant {:?}",
        &got[..got.len().min(8)],
        &want[..want.len().min(8)]
    );
}

fn assert_results_close(what: &str, got: &RankResult, want: &RankResult, tol: f64) {
    for (i, (g, w)) in got.steps.iter().zip(&want.steps).enumerate() {
        assert_close(&format!("{what} step {i} y"), &g.y, &w.y, tol);
        assert_close(
            &format!("{what} step {i} x_grad"),
            &g.x_grad,
            &w.x_grad,
            tol,
        );
        assert_close(
            &format!("{what} step {i} gamma_grad"),
            &g.gamma_grad,
            &w.gamma_grad,
            tol,
        );
        assert_close(
            &format!("{what} step {i} beta_grad"),
            &g.beta_grad,
            &w.beta_grad,
            tol,
        );
    }
    assert_close(
        &format!("{what} running_mean"),
        &got.running_mean,
        &want.running_mean,
        tol,
    );
    assert_close(
        &format!("{what} running_var"),
        &got.running_var,
        &want.running_var,
        tol,
    );
}

/// World size 1: SyncBatchNorm on `device` ≡ BatchNorm on `device`.
fn check_world1(device: &Device, tensor_ops: bool) {
    // Odd channel counts and maps (100 × 7×7, 33 × 33) too: outputs whose rows are not a power
    // of two in bytes are where a padded (pitched) output layout would show.
    for (rows, channels, spatial) in [
        (vec![7], 3, vec![]),
        (vec![5], 3, vec![3, 4]),
        (vec![4], 3, vec![10]),
        (vec![3], 100, vec![7, 7]),
        (vec![2], 33, vec![33]),
        (vec![6], 40, vec![]),
    ] {
        let mut case = make_case(&rows, channels, &spatial, 2, 11 + rows[0] as u64);
        case.tensor_ops = tensor_ops;
        let device = device.clone().autodiff();
        let want = run_joined(&case, &Layer::Bn(init_bn(&case, &device)), &device);
        let got = run_joined(&case, &Layer::Sync(init_sync(&case, &device)), &device);
        assert_results_close(&format!("world 1 {spatial:?}"), &got, &want, TOL);
    }
}

#[test]
fn world1_matches_batch_norm_flex() {
    check_world1(&Device::flex(), false);
}

/// Mean 1000, std 0.01: the batch statistics (momentum 1 makes the running statistics equal
/// them) within 1e-4 relative of an f64 reference on the same f32 inputs.
fn check_large_mean(device: &Device, tensor_ops: bool) {
    let (n, c, s) = (16, 3, 64);
    let mut rng = Rng(7);
    let x = rng.vec(n * c * s, 1000.0, 0.01);
    let device = device.clone().autodiff();
    let layer = SyncBatchNormConfig::new(c)
        .with_momentum(1.0)
        .with_implementation(if tensor_ops {
            SyncBatchNormImpl::TensorOps
        } else {
            SyncBatchNormImpl::Auto
        })
        .init(&device);
    let input =
        Tensor::<3>::from_data(TensorData::new(x.clone(), [n, c, s]), &device).require_grad();
    let _ = layer.forward(input);
    let mean = values(layer.running_mean.value_sync());
    let var = values(layer.running_var.value_sync());
    for ch in 0..c {
        let vals: Vec<f64> = (0..n)
            .flat_map(|i| {
                x[(i * c + ch) * s..(i * c + ch + 1) * s]
                    .iter()
                    .map(|v| *v as f64)
            })
            .collect();
        let m = vals.iter().sum::<f64>() / vals.len() as f64;
        let v = vals.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / vals.len() as f64;
        let rel_m = (mean[ch] as f64 - m).abs() / m.abs();
        let rel_v = (var[ch] as f64 - v).abs() / v;
        assert!(
            rel_m <= 1e-4,
            "channel {ch}: mean {} vs {m} (rel {rel_m:e})",
            mean[ch]
        );
        assert!(
            rel_v <= 1e-4,
            "channel {ch}: var {} vs {v} (rel {rel_v:e})",
            var[ch]
        );
    }
}

#[test]
fn large_mean_statistics_flex() {
    check_large_mean(&Device::flex(), false);
}

/// Half-precision input (γ, β stay f32 parameters): 64Ki samples per channel with std 3 give
/// an M2 of ~590k, and a loss weight of mean 2 gives Σdy ≈ 131k — both beyond f16's range —
/// so every accumulation, and the γ/β gradients, must stay f32. Output, input gradient and
/// γ/β gradients must match the same layer on the f32 values within half-precision rounding,
/// and be finite. Both reduction layouts: 1024 values per sample and channel, and 16 (the
/// channel-tiled kernels, with a partial last tile of 8 of 40 channels).
fn check_half(device: &Device, dtype: burn::tensor::DType, tensor_ops: bool) {
    use burn::tensor::DType;
    for (n, c, s) in [(64, 2, 1024), (4096, 40, 16)] {
        let mut rng = Rng(23);
        let device = device.clone().autodiff();
        let x = Tensor::<3>::from_data(
            TensorData::new(rng.vec(n * c * s, 2.0, 3.0), [n, c, s]),
            &device,
        )
        .cast(dtype)
        .cast(DType::F32); // values representable in `dtype`
        let w = Tensor::<3>::from_data(
            TensorData::new(rng.vec(n * c * s, 2.0, 1.0), [n, c, s]),
            &device,
        );
        let implementation = if tensor_ops {
            SyncBatchNormImpl::TensorOps
        } else {
            SyncBatchNormImpl::Auto
        };
        let run = |input_dtype: DType| {
            let layer = SyncBatchNormConfig::new(c)
                .with_implementation(implementation)
                .init(&device);
            let input = x.clone().detach().cast(input_dtype).require_grad();
            let y = layer.forward(input.clone());
            assert_eq!(y.dtype(), input_dtype);
            let grads = (y.clone().cast(DType::F32) * w.clone()).sum().backward();
            let dx = input.grad(&grads).expect("input gradient");
            let dgamma = layer.gamma.grad(&grads).expect("γ gradient");
            let dbeta = layer.beta.grad(&grads).expect("β gradient");
            assert_eq!(dgamma.dtype(), DType::F32, "γ's gradient has γ's dtype");
            let f32s = |t: Tensor<3>| values(t.cast(DType::F32));
            (
                f32s(y.detach()),
                f32s(dx),
                values(dgamma),
                values(dbeta),
                values(layer.running_var.value_sync()),
            )
        };
        let (y, dx, dgamma, dbeta, var) = run(dtype);
        let (y_ref, dx_ref, dgamma_ref, dbeta_ref, var_ref) = run(DType::F32);
        for (what, got, want) in [
            ("output", &y, &y_ref),
            ("input grad", &dx, &dx_ref),
            ("γ grad", &dgamma, &dgamma_ref),
            ("β grad", &dbeta, &dbeta_ref),
            ("running var", &var, &var_ref),
        ] {
            let what = format!("{dtype:?} [{n}, {c}, {s}] {what}");
            assert!(got.iter().all(|v| v.is_finite()), "{what}: not finite");
            // Four units of the format's rounding (f16: 2^-11, bf16: 2^-8).
            let tol = if dtype == DType::BF16 { 1.6e-2 } else { 2e-3 };
            assert_close(&what, got, want, tol);
        }
    }
}

#[test]
fn half_precision_input_flex() {
    check_half(&Device::flex(), burn::tensor::DType::F16, true);
    check_half(&Device::flex(), burn::tensor::DType::BF16, true);
}

#[test]
fn unbiased_running_variance_follows_pytorch() {
    let (n, c) = (6, 2);
    let mut rng = Rng(3);
    let x = rng.vec(n * c, 0.5, 2.0);
    let device = Device::flex().autodiff();
    let layer = SyncBatchNormConfig::new(c)
        .with_running_variance(RunningVariance::Unbiased)
        .init(&device);
    let _ = layer.forward(Tensor::<2>::from_data(
        TensorData::new(x.clone(), [n, c]),
        &device,
    ));
    let var = values(layer.running_var.value_sync());
    for ch in 0..c {
        let vals: Vec<f64> = (0..n).map(|i| x[i * c + ch] as f64).collect();
        let m = vals.iter().sum::<f64>() / n as f64;
        let unbiased = vals.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1) as f64;
        let want = 0.9 + 0.1 * unbiased;
        assert!(
            ((var[ch] as f64) - want).abs() <= 1e-6 * want,
            "{} vs {want}",
            var[ch]
        );
    }
}

/// One sample per channel over all ranks with the unbiased running variance (`M2 / (n − 1)`
/// undefined): no error, output β, running statistics unchanged — on every path.
#[test]
fn one_sample_with_the_unbiased_variance_leaves_the_running_statistics_on_every_path() {
    let check_world1 = |device: &Device, what: &str| {
        let device = device.clone().autodiff();
        let layer = SyncBatchNormConfig::new(3)
            .with_running_variance(RunningVariance::Unbiased)
            .init(&device);
        let x = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, -2.0, 5.0], [1, 3]), &device);
        let y = layer
            .try_forward(x)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_close(&format!("{what} y"), &values(y), &[0.0; 3], 1e-6);
        assert_eq!(
            values(layer.running_mean.value_sync()),
            vec![0.0; 3],
            "{what}"
        );
        assert_eq!(
            values(layer.running_var.value_sync()),
            vec![1.0; 3],
            "{what}"
        );
    };
    check_world1(&Device::flex(), "world 1, tensor ops (Flex)");
    #[cfg(feature = "wgpu")]
    check_world1(
        &Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        "world 1, CubeCL kernels (wgpu)",
    );
    #[cfg(feature = "cpu")]
    check_world1(&Device::cpu(), "world 1, CubeCL kernels (burn-cpu)");
    // Two ranks, host-staged: one sample between them.
    let mut case = make_case(&[1, 0], 3, &[], 1, 47);
    case.unbiased = true;
    for (rank, got) in run_ranks(&case).iter().enumerate() {
        assert_eq!(got.running_mean, vec![0.0; 3], "rank {rank}");
        assert_eq!(got.running_var, vec![1.0; 3], "rank {rank}");
    }
}

#[test]
fn batch_norm_record_loads_and_layers_convert() {
    let device = Device::flex();
    let case = make_case(&[4], 3, &[], 1, 5);
    let mut bn = init_bn(&case, &device);
    bn.running_mean =
        burn::module::RunningState::new(Tensor::from_data([0.5f32, -1.0, 2.0], &device));
    bn.running_var =
        burn::module::RunningState::new(Tensor::from_data([1.5f32, 0.25, 3.0], &device));

    #[derive(Module, Debug)]
    struct Net {
        norm: BatchNorm,
    }
    #[derive(Module, Debug)]
    struct SyncNet {
        norm: SyncBatchNorm,
    }
    let net = Net { norm: bn.clone() };
    let synced = SyncNet {
        norm: SyncBatchNormConfig::new(3).init(&device),
    }
    .load_record(net.clone().into_record());
    let moved = SyncBatchNorm::from(bn.clone());
    let x = Tensor::<2>::from_data(TensorData::new(case.steps[0].x[0].clone(), [4, 3]), &device);
    // Eval (no autodiff): running statistics, no communication.
    let want = values(bn.forward(x.clone()));
    assert_close(
        "loaded record",
        &values(synced.norm.forward(x.clone())),
        &want,
        1e-6,
    );
    assert_close(
        "From<BatchNorm>",
        &values(moved.clone().forward(x.clone())),
        &want,
        1e-6,
    );
    let back = BatchNorm::from(moved);
    assert_close("From<SyncBatchNorm>", &values(back.forward(x)), &want, 1e-6);
    for (name, a, b) in [
        ("gamma", synced.norm.gamma.val(), bn.gamma.val()),
        ("beta", synced.norm.beta.val(), bn.beta.val()),
        (
            "running_mean",
            synced.norm.running_mean.value_sync(),
            bn.running_mean.value_sync(),
        ),
        (
            "running_var",
            synced.norm.running_var.value_sync(),
            bn.running_var.value_sync(),
        ),
    ] {
        assert_close(name, &values(a), &values(b), 0.0);
    }
}

#[test]
fn bad_input_is_an_error() {
    let device = Device::flex().autodiff();
    let layer = SyncBatchNormConfig::new(3).init(&device);
    let x = Tensor::<1>::zeros([3], &device);
    assert!(matches!(
        layer.try_forward(x),
        Err(SyncBatchNormError::Rank(1))
    ));
    let x = Tensor::<2>::zeros([2, 4], &device);
    assert!(matches!(
        layer.try_forward(x),
        Err(SyncBatchNormError::Channels {
            expected: 3,
            got: 4
        })
    ));
}

/// SyncBatchNorm's CubeCL kernels against its tensor-op path on the CubeCL device `device`
/// (`on` names it), world of one: 2-D, 4-D and long-spatial inputs.
#[cfg(any(feature = "wgpu", feature = "cpu"))]
fn check_kernels_match_tensor_ops(device: &Device, on: &str) {
    let device = device.clone().autodiff();
    for (rows, spatial) in [
        (vec![9], vec![]),
        (vec![6], vec![5, 7]),
        (vec![3], vec![300]),
    ] {
        let mut case = make_case(&rows, 4, &spatial, 2, 21);
        let kernels = run_joined(&case, &Layer::Sync(init_sync(&case, &device)), &device);
        case.tensor_ops = true;
        let ops = run_joined(&case, &Layer::Sync(init_sync(&case, &device)), &device);
        assert_results_close(
            &format!("kernels vs tensor ops on {on} {spatial:?}"),
            &kernels,
            &ops,
            TOL,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// wgpu (CubeCL kernels on Mesa lavapipe in CI)

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;

    fn device() -> Device {
        Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
    }

    #[test]
    fn world1_matches_batch_norm_wgpu_kernels() {
        check_world1(&device(), false);
    }

    #[test]
    fn world1_matches_batch_norm_wgpu_tensor_ops() {
        check_world1(&device(), true);
    }

    #[test]
    fn kernels_match_tensor_ops_wgpu() {
        check_kernels_match_tensor_ops(&device(), "wgpu");
    }

    #[test]
    fn half_precision_input_wgpu_kernels() {
        check_half(&device(), burn::tensor::DType::F16, false);
    }

    #[test]
    fn large_mean_statistics_wgpu_kernels() {
        check_large_mean(&device(), false);
    }

    #[test]
    fn large_mean_statistics_wgpu_tensor_ops() {
        check_large_mean(&device(), true);
    }
}

// ---------------------------------------------------------------------------------------------
// burn-cpu (the same CubeCL kernels compiled for the CPU by LLVM: CubeCL's CPU runtime)

#[cfg(feature = "cpu")]
mod cpu {
    use super::*;

    fn device() -> Device {
        Device::cpu()
    }

    #[test]
    fn world1_matches_batch_norm_cpu_kernels() {
        check_world1(&device(), false);
    }

    #[test]
    fn world1_matches_batch_norm_cpu_tensor_ops() {
        check_world1(&device(), true);
    }

    #[test]
    fn kernels_match_tensor_ops_cpu() {
        check_kernels_match_tensor_ops(&device(), "burn-cpu");
    }

    #[test]
    fn half_precision_input_cpu_kernels() {
        check_half(&device(), burn::tensor::DType::F16, false);
    }

    #[test]
    fn large_mean_statistics_cpu_kernels() {
        check_large_mean(&device(), false);
    }

    /// Two ranks on burn-cpu, uneven batches, 4-D input: the kernels' statistics exchanged
    /// through the host process group match one process on the joined batch.
    #[test]
    fn world2_uneven_4d_cpu_kernels_match_joined_batch() {
        let mut case = make_case(&[5, 3], 3, &[4, 4], 2, 45);
        case.device = "cpu".into();
        check_ranks(&case);
    }

    /// Three ranks on burn-cpu, one of them with no rows at all.
    #[test]
    fn world3_with_an_empty_rank_cpu_kernels_match_joined_batch() {
        let mut case = make_case(&[5, 3, 0], 3, &[3, 4], 2, 43);
        case.device = "cpu".into();
        check_ranks(&case);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    #[test]
    #[ignore = "needs CUDA"]
    fn world1_matches_batch_norm_cuda_kernels() {
        check_world1(&Device::cuda(0), false);
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn half_precision_input_cuda_kernels() {
        check_half(&Device::cuda(0), burn::tensor::DType::F16, false);
        check_half(&Device::cuda(0), burn::tensor::DType::BF16, false);
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn large_mean_statistics_cuda_kernels() {
        check_large_mean(&Device::cuda(0), false);
    }

    /// Two ranks sharing GPU 0 (or one GPU each): statistics host-staged over the process
    /// group (NCCL refuses two ranks on one GPU).
    #[test]
    #[ignore = "needs CUDA"]
    fn world2_host_staged_matches_joined_batch_cuda() {
        let mut case = make_case(&[5, 3], 3, &[4, 4], 2, 31);
        case.device = "cuda".into();
        check_ranks(&case);
    }

    /// A world of one with `NcclPolicy::Required`: the statistics' all-gather and the
    /// backward all-reduce go through a one-rank NCCL communicator on device memory.
    #[test]
    #[ignore = "needs CUDA"]
    fn world1_over_nccl_matches_batch_norm_cuda() {
        let mut case = make_case(&[6], 5, &[3, 3], 2, 37);
        case.device = "cuda".into();
        case.nccl = true;
        check_ranks(&case);
    }

    /// Statistics over NCCL between 2 and 4 processes (a GPU each, or sharing one as emulated
    /// GPU hosts), uneven batches: one rank with a single sample, one with none.
    #[test]
    #[ignore = "needs CUDA"]
    fn nccl_ranks_uneven_batches_match_joined_batch() {
        let cases = [
            (vec![7, 1], vec![3, 5]),
            (vec![2, 9], vec![]),
            (vec![5, 3, 0, 4], vec![3, 4]),
        ];
        for (rows, spatial) in cases {
            let mut case = make_case(&rows, 6, &spatial, 3, 41);
            case.device = "cuda".into();
            case.nccl = true;
            check_ranks(&case);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Real rank processes

static RUN: AtomicUsize = AtomicUsize::new(0);

/// Starts one `syncbn_worker` per rank with torchrun's variables (`ddp_testkit::RankJob`: deadline
/// 240 s, every rank killed and reaped after it) and returns each rank's report.
fn run_ranks(case: &Case) -> Vec<RankResult> {
    let world = case.rows.len();
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "syncbn-test-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let case_path = dir.join("case.json");
    std::fs::write(&case_path, serde_json::to_vec(case).unwrap()).unwrap();
    let job = ddp_testkit::RankJob::new(env!("CARGO_BIN_EXE_syncbn_worker"), world);
    // NCCL ranks on fewer GPUs than ranks: emulated GPU hosts.
    #[cfg(feature = "cuda")]
    let job = if case.nccl && case.device == "cuda" {
        ddp_tests::nccl_rank_env(world)
            .into_iter()
            .fold(job, |job, (r, k, v)| job.rank_env(r, k, v))
    } else {
        job
    };
    let job = job
        .arg(&case_path)
        .arg(&dir)
        .env("DDP_TIMEOUT_SECS", "60")
        .deadline(Duration::from_secs(240))
        .run()
        .expect("spawning syncbn_worker");
    assert!(job.success(), "{}", job.report());
    let results = (0..world)
        .map(|r| {
            serde_json::from_slice(&std::fs::read(dir.join(format!("rank{r}.json"))).unwrap())
                .unwrap()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    results
}

/// Every rank ≡ BatchNorm on the concatenated batch (on Flex).
fn check_ranks(case: &Case) {
    let world = case.rows.len();
    let device = Device::flex().autodiff();
    let mut want = run_joined(case, &Layer::Bn(init_bn(case, &device)), &device);
    if case.unbiased {
        // BatchNorm has no unbiased option: recompute the running variance in f64.
        let mut rv = vec![1.0f64; case.channels];
        let per = case.spatial.iter().product::<usize>();
        for step in &case.steps {
            let x = step.x.concat();
            let n = x.len() / (case.channels * per);
            for (c, r) in rv.iter_mut().enumerate() {
                let vals: Vec<f64> = (0..n)
                    .flat_map(|i| {
                        x[(i * case.channels + c) * per..(i * case.channels + c + 1) * per]
                            .iter()
                            .map(|v| *v as f64)
                    })
                    .collect();
                let m = vals.iter().sum::<f64>() / vals.len() as f64;
                let var =
                    vals.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (vals.len() - 1) as f64;
                *r = 0.9 * *r + 0.1 * var;
            }
        }
        want.running_var = rv.iter().map(|v| *v as f32).collect();
    }
    let got = run_ranks(case);
    let per_row = case.channels * case.spatial.iter().product::<usize>();
    let mut offset = 0;
    for (rank, result) in got.iter().enumerate() {
        let rows = case.rows[rank];
        let range = offset * per_row..(offset + rows) * per_row;
        offset += rows;
        for (i, (g, w)) in result.steps.iter().zip(&want.steps).enumerate() {
            let what = format!("world {world} rank {rank} step {i}");
            assert_close(&format!("{what} y"), &g.y, &w.y[range.clone()], TOL);
            assert_close(
                &format!("{what} x_grad"),
                &g.x_grad,
                &w.x_grad[range.clone()],
                TOL,
            );
            // DDP averages: mean over ranks = joined-batch gradient / world size.
            let scaled = |v: &[f32]| v.iter().map(|x| x / world as f32).collect::<Vec<_>>();
            assert_close(
                &format!("{what} gamma_grad"),
                &g.gamma_grad,
                &scaled(&w.gamma_grad),
                TOL,
            );
            assert_close(
                &format!("{what} beta_grad"),
                &g.beta_grad,
                &scaled(&w.beta_grad),
                TOL,
            );
        }
        assert_close(
            &format!("rank {rank} running_mean"),
            &result.running_mean,
            &want.running_mean,
            TOL,
        );
        assert_close(
            &format!("rank {rank} running_var"),
            &result.running_var,
            &want.running_var,
            TOL,
        );
    }
}

#[test]
fn world2_uneven_2d_matches_joined_batch() {
    check_ranks(&make_case(&[5, 3], 4, &[], 2, 41));
}

#[test]
fn world2_uneven_4d_unbiased_matches_joined_batch() {
    let mut case = make_case(&[3, 5], 3, &[4, 5], 2, 42);
    case.unbiased = true;
    check_ranks(&case);
}

#[test]
fn world3_with_an_empty_rank_4d_matches_joined_batch() {
    check_ranks(&make_case(&[5, 3, 0], 3, &[3, 4], 2, 43));
}

#[test]
fn world3_with_a_single_row_rank_2d_matches_joined_batch() {
    check_ranks(&make_case(&[5, 1, 3], 5, &[], 2, 44));
}

#[cfg(feature = "wgpu")]
#[test]
fn world2_uneven_4d_wgpu_kernels_match_joined_batch() {
    let mut case = make_case(&[5, 3], 3, &[4, 4], 2, 45);
    case.device = "wgpu".into();
    check_ranks(&case);
}
