//! The backend extension behind [`SyncBatchNorm`](super::SyncBatchNorm): four local per-channel
//! operations, a tensor-op implementation that runs on every backend, CubeCL kernels for the
//! `Cube` backend (see `kernels.rs`), and an `Autodiff` implementation whose backward pass makes
//! the one cross-rank all-reduce.
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

use burn::backend::{
    Backend, TensorMetadata,
    autodiff::{
        Autodiff, NodeId,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::FloatTensor,
};
use burn::tensor::{Shape, Slice};

#[cfg(feature = "cube")]
use burn::backend::fusion::custom::TensorSpec;

/// Lazy-Fusion metadata of the `[rows, C]` per-channel outputs.
#[cfg(feature = "cube")]
fn per_channel_spec(x: &TensorSpec, rows: usize) -> TensorSpec {
    TensorSpec::new(Shape::new([rows, x.shape[1]]), burn::tensor::DType::F32)
}

/// The scalar settings of [`SyncBatchNormBackend::sync_bn_combine`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CombineOptions {
    /// Added to the variance in `1 / sqrt(σ² + ε)`.
    pub epsilon: f64,
    /// Weight of the batch statistics in the running-statistics update.
    pub momentum: f64,
    /// Whether the running variance takes `M2 / (N − 1)` (PyTorch) instead of `M2 / N`.
    pub unbiased: bool,
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

/// The tensor-op implementation, generic over any backend (the default trait bodies).
pub mod tensor_ops {
    use super::*;

    fn dims3<B: Backend>(x: &FloatTensor<B>) -> [usize; 3] {
        let shape = x.shape();
        [shape[0], shape[1], shape[2]]
    }

    /// Row `row` of a `[k, C]` tensor as a `[C]` tensor.
    pub(crate) fn row_of<B: Backend>(
        t: FloatTensor<B>,
        row: usize,
        channels: usize,
    ) -> FloatTensor<B> {
        let row = B::float_slice(
            t,
            &[
                Slice::new(row as isize, Some(row as isize + 1), 1),
                Slice::full(),
            ],
        );
        B::float_reshape(row, Shape::new([channels]))
    }

    /// Row `row` of a `[k, C]` tensor as a `[1, C, 1]` tensor.
    fn channel_row<B: Backend>(t: FloatTensor<B>, row: usize, channels: usize) -> FloatTensor<B> {
        B::float_reshape(row_of::<B>(t, row, channels), Shape::new([1, channels, 1]))
    }

    /// `[N, C, S]` → `[C, N·S]`.
    fn per_channel_rows<B: Backend>(t: FloatTensor<B>, [n, c, s]: [usize; 3]) -> FloatTensor<B> {
        B::float_reshape(B::float_swap_dims(t, 0, 1), Shape::new([c, n * s]))
    }

    /// `(x − K) − m` for `x: [N, C, S]`.
    fn centred<B: Backend>(x: FloatTensor<B>, params: FloatTensor<B>, c: usize) -> FloatTensor<B> {
        let pivot = channel_row::<B>(params.clone(), 0, c);
        let m = channel_row::<B>(params, 1, c);
        B::float_sub(B::float_sub(x, pivot), m)
    }

    /// `t` in f32 (itself when it already is).
    fn to_f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
        to_dtype::<B>(t, burn::tensor::DType::F32)
    }

    /// `t` in `dtype` (itself when it already is).
    pub(crate) fn to_dtype<B: Backend>(
        t: FloatTensor<B>,
        dtype: burn::tensor::DType,
    ) -> FloatTensor<B> {
        if t.dtype() == dtype {
            t
        } else {
            B::float_cast(t, dtype.into())
        }
    }

    /// See [`SyncBatchNormBackend::sync_bn_stats`].
    pub fn stats<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
        let x = to_f32::<B>(x);
        let [n, c, s] = dims3::<B>(&x);
        let (x_device, x_dtype) = (x.device(), x.dtype());
        let pivot = B::float_slice(
            x.clone(),
            &[
                Slice::new(0, Some(1), 1),
                Slice::full(),
                Slice::new(0, Some(1), 1),
            ],
        );
        let shifted = per_channel_rows::<B>(B::float_sub(x, pivot.clone()), [n, c, s]);
        let mean = B::float_mean_dim(shifted.clone(), 1); // [C, 1]
        let dev = B::float_sub(shifted, mean.clone());
        let m2 = B::float_sum_dim(B::float_mul(dev.clone(), dev), 1); // [C, 1]
        let row = |t: FloatTensor<B>| B::float_reshape(t, Shape::new([1, c]));
        let count = B::float_full(
            Shape::new([1, c]),
            ((n * s) as f64).into(),
            &x_device,
            x_dtype.into(),
        );
        B::float_cat(vec![row(pivot), row(mean), row(m2), count], 0)
    }

    /// See [`SyncBatchNormBackend::sync_bn_normalize`].
    pub fn normalize<B: Backend>(
        x: FloatTensor<B>,
        params: FloatTensor<B>,
        gamma: FloatTensor<B>,
        beta: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let [_, c, _] = dims3::<B>(&x);
        let dtype = x.dtype();
        let (x, gamma, beta) = (to_f32::<B>(x), to_f32::<B>(gamma), to_f32::<B>(beta));
        let invstd = channel_row::<B>(params.clone(), 2, c);
        let gamma = B::float_reshape(gamma, Shape::new([1, c, 1]));
        let beta = B::float_reshape(beta, Shape::new([1, c, 1]));
        let scale = B::float_mul(invstd, gamma);
        let y = B::float_add(B::float_mul(centred::<B>(x, params, c), scale), beta);
        to_dtype::<B>(y, dtype)
    }

    /// See [`SyncBatchNormBackend::sync_bn_grad_sums`].
    pub fn grad_sums<B: Backend>(
        grad: FloatTensor<B>,
        x: FloatTensor<B>,
        params: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let dims = dims3::<B>(&x);
        let c = dims[1];
        let (grad, x) = (to_f32::<B>(grad), to_f32::<B>(x));
        let xmu = centred::<B>(x, params, c);
        let weighted = B::float_mul(grad.clone(), xmu);
        let sum = |t: FloatTensor<B>| {
            B::float_reshape(
                B::float_sum_dim(per_channel_rows::<B>(t, dims), 1),
                Shape::new([1, c]),
            )
        };
        B::float_cat(vec![sum(grad), sum(weighted)], 0)
    }

    /// See [`SyncBatchNormBackend::sync_bn_combine`].
    pub fn combine<B: Backend>(
        gathered: FloatTensor<B>,
        local: FloatTensor<B>,
        running_mean: FloatTensor<B>,
        running_var: FloatTensor<B>,
        options: CombineOptions,
    ) -> FloatTensor<B> {
        let shape = gathered.shape();
        let (world, c) = (shape[0], shape[2]);
        let row = |r: usize| {
            let rows = B::float_slice(
                gathered.clone(),
                &[
                    Slice::full(),
                    Slice::new(r as isize, Some(r as isize + 1), 1),
                    Slice::full(),
                ],
            );
            B::float_reshape(rows, Shape::new([world, c]))
        };
        let (pivots, means, m2s, counts) = (row(0), row(1), row(2), row(3));
        let sum = |t: FloatTensor<B>| B::float_sum_dim(t, 0); // [1, C]
        let at_least_one = |t: FloatTensor<B>| B::float_clamp_min(t, 1.0.into());
        let as_row = |t: FloatTensor<B>| B::float_reshape(t, Shape::new([1, c]));

        // Counts are whole numbers ≥ 0, so min(count, 1) is 1 exactly where a rank has samples.
        let present = B::float_clamp_max(counts.clone(), 1.0.into());
        let present_ranks = at_least_one(sum(present.clone()));
        let pivot = B::float_div(sum(B::float_mul(pivots.clone(), present)), present_ranks);
        let d = B::float_add(B::float_sub(pivots, pivot.clone()), means);
        let total = sum(counts.clone());
        let safe_total = at_least_one(total.clone());
        let delta = B::float_div(
            sum(B::float_mul(counts.clone(), d.clone())),
            safe_total.clone(),
        );
        let dev = B::float_sub(d, delta.clone());
        let m2 = B::float_add(
            sum(m2s),
            sum(B::float_mul(B::float_mul(counts, dev.clone()), dev)),
        );
        let biased = B::float_div(m2.clone(), safe_total.clone());
        let invstd = B::float_recip(B::float_sqrt(B::float_add_scalar(
            biased.clone(),
            options.epsilon.into(),
        )));
        let local_pivot = as_row(row_of::<B>(local, 0, c));
        let local_mean = B::float_add(
            B::float_sub(pivot.clone(), local_pivot.clone()),
            delta.clone(),
        );

        let (var, min_count) = if options.unbiased {
            let n_minus_1 = at_least_one(B::float_sub_scalar(total.clone(), 1.0.into()));
            (B::float_div(m2, n_minus_1), 1.0)
        } else {
            (biased, 0.0)
        };
        // BatchNorm's update, then kept only where total > min_count (a 0/1 mask: whole
        // numbers again).
        let valid = B::float_clamp_max(
            B::float_clamp_min(B::float_sub_scalar(total, min_count.into()), 0.0.into()),
            1.0.into(),
        );
        let invalid = B::float_add_scalar(B::float_neg(valid.clone()), 1.0.into());
        let update = |old: FloatTensor<B>, batch: FloatTensor<B>| {
            let old = as_row(old);
            let blended = B::float_add(
                B::float_mul_scalar(old.clone(), (1.0 - options.momentum).into()),
                B::float_mul_scalar(batch, options.momentum.into()),
            );
            // blended · valid + old · (1 − valid): exactly one of the two, as both are finite.
            B::float_add(
                B::float_mul(blended, valid.clone()),
                B::float_mul(old, invalid.clone()),
            )
        };
        let new_mean = update(running_mean, B::float_add(pivot, delta));
        let new_var = update(running_var, var);
        B::float_cat(
            vec![
                local_pivot,
                local_mean,
                invstd,
                B::float_recip(safe_total),
                new_mean,
                new_var,
            ],
            0,
        )
    }

    /// See [`SyncBatchNormBackend::sync_bn_grad_input`].
    pub fn grad_input<B: Backend>(
        grad: FloatTensor<B>,
        x: FloatTensor<B>,
        params: FloatTensor<B>,
        gamma: FloatTensor<B>,
        sums: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let [_, c, _] = dims3::<B>(&x);
        let dtype = x.dtype();
        let (grad, x, gamma) = (to_f32::<B>(grad), to_f32::<B>(x), to_f32::<B>(gamma));
        let invstd = channel_row::<B>(params.clone(), 2, c);
        let inv_n = channel_row::<B>(params.clone(), 3, c);
        let gamma = B::float_reshape(gamma, Shape::new([1, c, 1]));
        let g0 = B::float_mul(channel_row::<B>(sums.clone(), 0, c), inv_n.clone());
        // invstd · (invstd · (Σ / N)): no invstd² that could overflow on its own.
        let g1 = B::float_mul(
            invstd.clone(),
            B::float_mul(
                invstd.clone(),
                B::float_mul(channel_row::<B>(sums, 1, c), inv_n),
            ),
        );
        let xmu = centred::<B>(x, params, c);
        let inner = B::float_sub(B::float_sub(grad, g0), B::float_mul(xmu, g1));
        to_dtype::<B>(B::float_mul(inner, B::float_mul(gamma, invstd)), dtype)
    }
}

/// Reads a small backend tensor to the host as f64 (blocking).
pub(crate) fn read_host<B: Backend>(
    t: FloatTensor<B>,
) -> Result<Vec<f64>, super::SyncBatchNormError> {
    let err = |what: String| super::SyncBatchNormError::Device(what);
    let data = burn::tensor::try_read_sync(B::float_into_data(t))
        .ok_or_else(|| err("this platform can't read tensors synchronously".into()))?
        .map_err(|e| err(format!("reading per-channel values from the device: {e:?}")))?;
    data.convert::<f64>()
        .try_into_vec::<f64>()
        .map_err(|e| err(format!("per-channel values as f64: {e:?}")))
}

/// Uploads a small host buffer as a `shape` tensor of `dtype` on `device`.
pub(crate) fn upload<B: Backend>(
    values: &[f64],
    shape: &[usize],
    dtype: burn::tensor::DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let data = burn::tensor::TensorData::new(values.to_vec(), shape.to_vec()).convert_dtype(dtype);
    B::float_from_data(data, device)
}

#[derive(Debug)]
struct SyncBatchNormBackward;

impl<B: SyncBatchNormBackend> Backward<B, 3> for SyncBatchNormBackward {
    // x and γ are checkpointed; the channel parameters come from the forward pass.
    type State = (NodeId, NodeId, FloatTensor<B>, bool);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, gamma_state, params, kernels) = ops.state;
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
        let gamma: FloatTensor<B> = checkpointer.retrieve_node_output(gamma_state);
        let channels = params.shape()[1];
        let row = |t: FloatTensor<B>, r: usize| tensor_ops::row_of::<B>(t, r, channels);
        let invstd = row(params.clone(), 2);

        // Local Σdy and Σdy·(x − μ) in f32 (zero on a rank without samples), on the device.
        let local = if x.shape().num_elements() > 0 {
            B::sync_bn_grad_sums(grad.clone(), x.clone(), params.clone(), kernels)
        } else {
            B::float_zeros(
                Shape::new([2, channels]),
                &x.device(),
                burn::tensor::FloatDType::F32,
            )
        };

        // γ and β: local gradients (averaged across ranks by DDP like any parameter), in the
        // dtype γ and β had in the forward pass (the input's; see `SyncBatchNorm::forward`).
        let param_dtype = gamma.dtype();
        if let Some(node) = node_gamma {
            let g = B::float_mul(row(local.clone(), 1), invstd.clone());
            grads.register::<B>(node.id, tensor_ops::to_dtype::<B>(g, param_dtype));
        }
        if let Some(node) = node_beta {
            let g = row(local.clone(), 0);
            grads.register::<B>(node.id, tensor_ops::to_dtype::<B>(g, param_dtype));
        }

        if let Some(node) = node_x {
            // One all-reduce of the 2C sums: every rank's input gradient depends on all samples.
            let global = super::exchange::Exchange::current()
                .all_reduce_sum::<B>(local)
                .unwrap_or_else(|e| {
                    // The autodiff backward pass can't return errors; the collective is broken
                    // on every rank, so every rank stops with this message.
                    tracing::error!(
                        "SyncBatchNorm backward: all-reduce of the per-channel sums failed: {e}"
                    );
                    panic!("SyncBatchNorm backward: all-reduce of the per-channel sums failed: {e}")
                });
            let dx = if x.shape().num_elements() > 0 {
                B::sync_bn_grad_input(grad, x, params, gamma, global, kernels)
            } else {
                grad
            };
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: SyncBatchNormBackend, C: CheckpointStrategy> SyncBatchNormBackend for Autodiff<B, C> {
    fn sync_bn_stats(x: FloatTensor<Self>, kernels: bool) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_stats(x.into_primitive(), kernels))
    }

    fn sync_bn_combine(
        gathered: FloatTensor<Self>,
        local: FloatTensor<Self>,
        running_mean: FloatTensor<Self>,
        running_var: FloatTensor<Self>,
        options: CombineOptions,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_combine(
            gathered.into_primitive(),
            local.into_primitive(),
            running_mean.into_primitive(),
            running_var.into_primitive(),
            options,
            kernels,
        ))
    }

    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let params = params.into_primitive();
        match SyncBatchNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let gamma_state = prep.checkpoint(&gamma);
                let output = B::sync_bn_normalize(
                    x.into_primitive(),
                    params.clone(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    kernels,
                );
                prep.finish((x_state, gamma_state, params, kernels), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sync_bn_normalize(
                x.into_primitive(),
                params,
                gamma.into_primitive(),
                beta.into_primitive(),
                kernels,
            )),
        }
    }

    fn sync_bn_grad_sums(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_grad_sums(
            grad.into_primitive(),
            x.into_primitive(),
            params.into_primitive(),
            kernels,
        ))
    }

    fn sync_bn_grad_input(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        sums: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_grad_input(
            grad.into_primitive(),
            x.into_primitive(),
            params.into_primitive(),
            gamma.into_primitive(),
            sums.into_primitive(),
            kernels,
        ))
    }
}
