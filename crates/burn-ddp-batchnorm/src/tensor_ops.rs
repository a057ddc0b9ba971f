//! SyncBatchNorm's per-channel operations as Burn tensor operations, generic over any backend:
//! the default bodies of burn-ddp's `SyncBatchNormBackend`, and the reference the CubeCL
//! kernels are tested against.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Shape, Slice};

use crate::stats::CombineOptions;

fn dims3<B: Backend>(x: &FloatTensor<B>) -> [usize; 3] {
    let shape = x.shape();
    [shape[0], shape[1], shape[2]]
}

/// Row `row` of a `[k, C]` tensor as a `[C]` tensor.
pub fn row_of<B: Backend>(t: FloatTensor<B>, row: usize, channels: usize) -> FloatTensor<B> {
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
pub fn to_dtype<B: Backend>(t: FloatTensor<B>, dtype: burn::tensor::DType) -> FloatTensor<B> {
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// Local statistics of `x` (`[N, C, S]`, `N·S ≥ 1`): a `[4, C]` f32 tensor of the pivot `K_c`
/// (the channel's first element), the mean of `x − K_c`, its M2 and the count `N·S`.
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

/// `y = ((x − K) − m) · (γ · invstd) + β` per channel, with the channel parameters
/// `params = [K; m; invstd; 1/N]` (`[4, C]`); `y` has `x`'s dtype.
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

/// Local backward sums: a `[2, C]` f32 tensor of `Σ dy` and `Σ dy · (x − μ)` per channel.
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

/// Every rank's statistics (`gathered`, `[W, 4, C]`, zeros for a rank without samples)
/// combined with this rank's (`local`, `[4, C]`) around a common pivot (Chan's parallel
/// formula): `[6, C]`, the channel parameters `[K; μ − K; 1/sqrt(σ² + ε); 1/N]` and the new
/// running mean and variance (unchanged where the channel had no sample).
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

/// Input gradient `dx = γ · invstd · (dy − g0 − (x − μ) · g1)` with `g0 = Σdy / N` and
/// `g1 = invstd² · Σdy(x − μ) / N`, from every rank's sums (`[2, C]`) and the channel
/// parameters.
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
