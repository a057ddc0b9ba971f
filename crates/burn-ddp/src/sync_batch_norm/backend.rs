//! The backend extension behind [`SyncBatchNorm`](super::SyncBatchNorm): four local per-channel
//! operations, with default bodies from the tensor-op path (`burn_ddp_batchnorm::tensor_ops`),
//! CubeCL kernels for
//! the `Cube` backend (`cube.rs`, over `burn-ddp-batchnorm`'s kernels) and an `Autodiff` implementation whose backward pass makes
//! the one cross-rank all-reduce (`autodiff.rs`).
//!
//! All operations take the input as a contiguous-or-not `[N, C, S]` tensor (`S` is the product of
//! the spatial dimensions, 1 for `[N, C]` inputs) and describe each channel's centring with a
//! `[4, C]` "channel parameter" tensor `P`:
//!
//! - `P[0, c]` — the *pivot* `K_c`: this rank's first sample of channel `c`. Subtracting it first
//!   (`x − K`, exact in floating point for values within a factor of two) keeps a large common
//!   offset (mean 1000, std 0.01) out of every accumulation.
//! - `P[1, c]` — `m_c = μ_c − K_c`, the global mean relative to the pivot.
//! - `P[2, c]` — `1 / sqrt(σ²_c + ε)` for the global biased variance `σ²_c`.
//! - `P[3, c]` — `1 / N`, the reciprocal of the number of samples of the channel over all
//!   ranks (read by the backward pass only).
//!
//! so `x − μ` is evaluated as `(x − K) − m`. `P` is computed on the device from every rank's
//! statistics, so neither the forward nor the backward pass needs host values.

use burn::backend::{Backend, tensor::FloatTensor};
#[cfg(feature = "cube")]
use burn::tensor::Shape;

#[cfg(feature = "cube")]
use burn::backend::fusion::custom::TensorSpec;

use burn_ddp_batchnorm::CombineOptions;
use burn_ddp_batchnorm::tensor_ops;

/// Lazy-Fusion metadata of the `[rows, C]` per-channel outputs.
#[cfg(feature = "cube")]
fn per_channel_spec(x: &TensorSpec, rows: usize) -> TensorSpec {
    TensorSpec::new(Shape::new([rows, x.shape[1]]), burn::tensor::DType::F32)
}

/// Per-channel operations of a synchronised batch norm. The cross-rank exchange is not here:
/// these are computations on one device that a backend can implement with kernels.
///
/// `kernels = false` asks a backend that has kernels to use the tensor-op implementation instead
/// (the default bodies), so both paths can be compared on one device.
///
/// **Dtypes.** `x` and `grad` may be f32, f16 or bf16; everything per channel is f32: the
/// statistics and backward sums these operations return, and the channel parameters, γ, β,
/// running statistics and gathered statistics they take (the kernels read those as f32). The
/// element-wise results (`sync_bn_normalize`, `sync_bn_grad_input`) have `x`'s dtype.
#[burn::backend::backend_extension(
    Cube: cfg(feature = "cube"),
    Flex,
    Fusion: cfg(feature = "cube"),
    Autodiff
)]
pub trait SyncBatchNormBackend: Backend {
    /// Local statistics of `x` (`[N, C, S]`, `N·S ≥ 1`): a `[4, C]` tensor of the pivot `K_c`
    /// (the channel's first element), the mean of `x − K_c`, its sum of squared deviations
    /// (M2), computed in one pass per channel, and the count `N·S`.
    #[fusion(meta = |x, _k| per_channel_spec(x, 4))]
    fn sync_bn_stats(x: FloatTensor<Self>, kernels: bool) -> FloatTensor<Self> {
        let _ = kernels;
        tensor_ops::stats::<Self>(x)
    }

    /// Combines every rank's statistics into the global ones, per channel, on the device, and
    /// updates the running statistics.
    ///
    /// `gathered` is `[W, 4, C]`: each rank's [`sync_bn_stats`](Self::sync_bn_stats) (zeros
    /// for a rank without samples), `local` this rank's `[4, C]`, `running_mean` and
    /// `running_var` are `[C]`. Returns `[6, C]`: rows 0–3 the channel parameters `P` (this
    /// rank's `K`, `μ − K`, `1 / sqrt(σ² + ε)`, `1 / N`), rows 4 and 5 the new running mean
    /// and variance — `old · (1 − momentum) + batch · momentum` as BatchNorm updates them, with
    /// the batch variance `M2 / N` (or `M2 / (N − 1)` when `unbiased`), or unchanged where the
    /// channel had no sample (fewer than two when `unbiased`).
    ///
    /// The means are first re-expressed relative to a common pivot `P₀` (the average of the
    /// non-empty ranks' pivots, which lies among the samples): `d_r = (K_r − P₀) + m_r`,
    /// `δ = Σ n_r d_r / N`, `μ = P₀ + δ`, `M2 = Σ M2_r + Σ n_r (d_r − δ)²` (Chan's parallel
    /// formula), so data with mean 1000 and std 0.01 loses nothing to cancellation.
    #[fusion(meta = |_g, local, _rm, _rv, _o, _k| per_channel_spec(local, 6))]
    fn sync_bn_combine(
        gathered: FloatTensor<Self>,
        local: FloatTensor<Self>,
        running_mean: FloatTensor<Self>,
        running_var: FloatTensor<Self>,
        options: CombineOptions,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let _ = kernels;
        tensor_ops::combine::<Self>(gathered, local, running_mean, running_var, options)
    }

    /// `y = ((x − K) − m) · (γ · invstd) + β` per channel, with `P = [K; m; invstd; 1/N]`.
    ///
    /// On `Autodiff` its backward pass makes the cross-rank all-reduce of the 2C sums.
    #[fusion(dtype = x, shape = x)]
    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let _ = kernels;
        tensor_ops::normalize::<Self>(x, params, gamma, beta)
    }

    /// Local backward sums: a `[2, C]` tensor of `Σ dy` and `Σ dy · (x − μ)` per channel.
    #[fusion(meta = |_dy, x, _p, _k| per_channel_spec(x, 2))]
    fn sync_bn_grad_sums(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let _ = kernels;
        tensor_ops::grad_sums::<Self>(grad, x, params)
    }

    /// Input gradient `dx = γ · invstd · (dy − g0 − (x − μ) · g1)` with `g0 = Σdy / N` and
    /// `g1 = invstd² · Σdy(x − μ) / N`, from `sums = [Σdy; Σdy(x − μ)]` over every rank's
    /// samples (`[2, C]`) and `1/N`, `invstd` from `params`.
    #[fusion(dtype = x, shape = x)]
    fn sync_bn_grad_input(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        sums: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let _ = kernels;
        tensor_ops::grad_input::<Self>(grad, x, params, gamma, sums)
    }
}

impl SyncBatchNormBackend for burn::backend::Flex {}
