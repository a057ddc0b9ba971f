//! CubeCL kernels of SyncBatchNorm's per-channel operations on the `Cube` backend (wgpu, CUDA,
//! …), and their launchers: `burn_ddp::sync_batch_norm::SyncBatchNormBackend`'s implementation
//! for `CubeBackend` calls them.
//!
//! Layout: the input is made contiguous as `[N, C, S]`. The two per-channel reductions come in
//! two layouts, chosen so that adjacent units read adjacent addresses:
//! - `S ≥ 32` (convolution maps): one cube per channel; its units stride over the channel's
//!   `N·S` elements.
//! - `S < 32` (e.g. `[N, C]`): one cube per 32 channels, 32 units across channels × 8 across
//!   samples.
//!
//! Each unit keeps its own running (count, mean, M2) — Welford's update, on values shifted by
//! the channel's first element — and the cube combines the units' partials with Chan's formula
//! in shared memory. The two element-wise kernels launch one unit per element. Every kernel
//! reads its input once.
//!
//! Whatever the input's float type `F` (f32, f16, bf16), every accumulation and every
//! per-channel value is f32: the statistics and backward sums are written as f32, the channel
//! parameters, γ and β are read as f32, and only the element-wise outputs are converted back to
//! `F` (PyTorch's rule for half-precision batch norm). A CubeCL tensor argument carries no
//! type, so the launchers assert that those inputs really are f32. Outputs are allocated contiguous: the
//! kernels index them as packed arrays.
//!
//! Longer than 600 lines because each of the five kernels sits beside its launcher, whose
//! layout choice and f32 assertions must match the kernel's indexing line for line.

use burn::backend::{TensorMetadata, cubecl::dtype_to_storage_type};
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use crate::stats::CombineOptions;

/// Units per cube of the per-channel reductions (a power of two; the shared buffers' size).
const BLOCK: usize = 256;

/// Chan's combination of two partial (count, mean, M2) triples into the first.
#[cube]
fn chan_merge<F: Float>(
    count: &mut Shared<[F]>,
    mean: &mut Shared<[F]>,
    m2: &mut Shared<[F]>,
    a: usize,
    b: usize,
) {
    let nb = count[b];
    if nb > F::new(0.0) {
        let na = count[a];
        let n = na + nb;
        let delta = mean[b] - mean[a];
        mean[a] += delta * nb / n;
        let m2_b = m2[b];
        m2[a] += m2_b + delta * delta * na * nb / n;
        count[a] = n;
    }
}

/// The shared-memory reduction of `lanes` partial (count, mean, M2) triples that sit `spacing`
/// slots apart, by a tree of Chan combinations: afterwards lane 0's `slot` holds them all. Every
/// unit of the cube calls it (it synchronises the cube); `lanes` is a power of two and a
/// runtime value (a comptime-derived loop bound failed verification: see DESIGN.md).
#[cube]
#[allow(clippy::too_many_arguments)]
fn chan_tree(
    count: &mut Shared<[f32]>,
    mean: &mut Shared<[f32]>,
    m2: &mut Shared<[f32]>,
    slot: usize,
    lane: usize,
    lanes: usize,
    spacing: usize,
) {
    let mut stride = lanes / 2;
    while stride > 0 {
        if lane < stride {
            chan_merge::<f32>(count, mean, m2, slot, slot + stride * spacing);
        }
        sync_cube();
        stride /= 2;
    }
}

/// [`chan_tree`] for two running sums: afterwards lane 0's `slot` holds each total.
#[cube]
fn sum_tree(
    a: &mut Shared<[f32]>,
    b: &mut Shared<[f32]>,
    slot: usize,
    lane: usize,
    lanes: usize,
    spacing: usize,
) {
    let mut stride = lanes / 2;
    while stride > 0 {
        if lane < stride {
            let sum_a = a[slot] + a[slot + stride * spacing];
            let sum_b = b[slot] + b[slot + stride * spacing];
            a[slot] = sum_a;
            b[slot] = sum_b;
        }
        sync_cube();
        stride /= 2;
    }
}

/// One cube per channel: out = [pivot; mean(x − pivot); M2; count] as a `[4, C]` tensor.
#[cube(launch)]
fn stats_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let channels = x.shape(1);
    let spatial = x.shape(2);
    let total = x.shape(0) * spatial;
    let pivot = f32::cast_from(x[c * spatial]);

    // Welford over this unit's elements.
    let mut count = f32::new(0.0);
    let mut mean = f32::new(0.0);
    let mut m2 = f32::new(0.0);
    let mut j = unit;
    while j < total {
        let sample = j / spatial;
        let s = j % spatial;
        let v = f32::cast_from(x[(sample * channels + c) * spatial + s]) - pivot;
        count += f32::new(1.0);
        let delta = v - mean;
        mean += delta / count;
        m2 += delta * (v - mean);
        j += units;
    }

    let mut sh_count = Shared::new_slice(block);
    let mut sh_mean = Shared::new_slice(block);
    let mut sh_m2 = Shared::new_slice(block);
    sh_count[unit] = count;
    sh_mean[unit] = mean;
    sh_m2[unit] = m2;
    sync_cube();

    chan_tree(
        &mut sh_count,
        &mut sh_mean,
        &mut sh_m2,
        unit,
        unit,
        units,
        1,
    );

    if unit == 0 {
        out[c] = pivot;
        out[channels + c] = sh_mean[0];
        out[2 * channels + c] = sh_m2[0];
        out[3 * channels + c] = sh_count[0];
    }
}

/// One cube per channel: out = [Σ dy; Σ dy·(x − μ)] as a `[2, C]` tensor.
#[cube(launch)]
fn grad_sums_kernel<F: Float>(
    grad: &Tensor<F>,
    x: &Tensor<F>,
    params: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let channels = x.shape(1);
    let spatial = x.shape(2);
    let total = x.shape(0) * spatial;
    let pivot = params[c];
    let m = params[channels + c];

    let mut sum_dy = f32::new(0.0);
    let mut sum_dy_xmu = f32::new(0.0);
    let mut j = unit;
    while j < total {
        let sample = j / spatial;
        let s = j % spatial;
        let index = (sample * channels + c) * spatial + s;
        let dy = f32::cast_from(grad[index]);
        sum_dy += dy;
        sum_dy_xmu += dy * ((f32::cast_from(x[index]) - pivot) - m);
        j += units;
    }

    let mut sh_dy = Shared::new_slice(block);
    let mut sh_dy_xmu = Shared::new_slice(block);
    sh_dy[unit] = sum_dy;
    sh_dy_xmu[unit] = sum_dy_xmu;
    sync_cube();

    sum_tree(&mut sh_dy, &mut sh_dy_xmu, unit, unit, units, 1);

    if unit == 0 {
        out[c] = sh_dy[0];
        out[channels + c] = sh_dy_xmu[0];
    }
}

/// Channel-tiled variant of [`stats_kernel`] for inputs with few elements per sample and
/// channel (`S < TILE_C`, e.g. `[N, C]`): a cube covers `TILE_C` channels with `CUBE_DIM_X`
/// units across channels (adjacent units read adjacent addresses when `S = 1`) and
/// `CUBE_DIM_Y` units across samples, whose partials are Chan-combined in shared memory.
#[cube(launch)]
fn stats_tiled_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let width = CUBE_DIM_X as usize;
    let rows = CUBE_DIM_Y as usize;
    let c = CUBE_POS_X as usize * width + tx;
    let channels = x.shape(1);
    let spatial = x.shape(2);
    let total = x.shape(0) * spatial;

    let mut count = f32::new(0.0);
    let mut mean = f32::new(0.0);
    let mut m2 = f32::new(0.0);
    let mut pivot = f32::new(0.0);
    if c < channels {
        pivot = f32::cast_from(x[c * spatial]);
        let mut j = ty;
        while j < total {
            let sample = j / spatial;
            let s = j % spatial;
            let v = f32::cast_from(x[(sample * channels + c) * spatial + s]) - pivot;
            count += f32::new(1.0);
            let delta = v - mean;
            mean += delta / count;
            m2 += delta * (v - mean);
            j += rows;
        }
    }

    let mut sh_count = Shared::new_slice(block);
    let mut sh_mean = Shared::new_slice(block);
    let mut sh_m2 = Shared::new_slice(block);
    let slot = ty * width + tx;
    sh_count[slot] = count;
    sh_mean[slot] = mean;
    sh_m2[slot] = m2;
    sync_cube();

    chan_tree(
        &mut sh_count,
        &mut sh_mean,
        &mut sh_m2,
        slot,
        ty,
        rows,
        width,
    );

    if ty == 0 && c < channels {
        out[c] = pivot;
        out[channels + c] = sh_mean[tx];
        out[2 * channels + c] = sh_m2[tx];
        out[3 * channels + c] = sh_count[tx];
    }
}

/// Channel-tiled variant of [`grad_sums_kernel`] (see [`stats_tiled_kernel`]).
#[cube(launch)]
fn grad_sums_tiled_kernel<F: Float>(
    grad: &Tensor<F>,
    x: &Tensor<F>,
    params: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let width = CUBE_DIM_X as usize;
    let rows = CUBE_DIM_Y as usize;
    let c = CUBE_POS_X as usize * width + tx;
    let channels = x.shape(1);
    let spatial = x.shape(2);
    let total = x.shape(0) * spatial;

    let mut sum_dy = f32::new(0.0);
    let mut sum_dy_xmu = f32::new(0.0);
    if c < channels {
        let pivot = params[c];
        let m = params[channels + c];
        let mut j = ty;
        while j < total {
            let sample = j / spatial;
            let s = j % spatial;
            let index = (sample * channels + c) * spatial + s;
            let dy = f32::cast_from(grad[index]);
            sum_dy += dy;
            sum_dy_xmu += dy * ((f32::cast_from(x[index]) - pivot) - m);
            j += rows;
        }
    }

    let mut sh_dy = Shared::new_slice(block);
    let mut sh_dy_xmu = Shared::new_slice(block);
    let slot = ty * width + tx;
    sh_dy[slot] = sum_dy;
    sh_dy_xmu[slot] = sum_dy_xmu;
    sync_cube();

    sum_tree(&mut sh_dy, &mut sh_dy_xmu, slot, ty, rows, width);

    if ty == 0 && c < channels {
        out[c] = sh_dy[tx];
        out[channels + c] = sh_dy_xmu[tx];
    }
}

/// One unit per element: `y = ((x − K) − m) · γ · invstd + β`.
#[cube(launch)]
fn normalize_kernel<F: Float>(
    x: &Tensor<F>,
    params: &Tensor<f32>,
    gamma: &Tensor<f32>,
    beta: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let channels = x.shape(1);
    let c = (i / x.shape(2)) % channels;
    let xmu = (f32::cast_from(x[i]) - params[c]) - params[channels + c];
    let scale = gamma[c] * params[2 * channels + c];
    out[i] = F::cast_from(xmu * scale + beta[c]);
}

/// One unit per element: `dx = γ · invstd · (dy − g0 − (x − μ) · g1)`, with
/// `g0 = Σdy / N` and `g1 = invstd² · Σdy(x − μ) / N` from the global `sums`.
#[cube(launch)]
fn grad_input_kernel<F: Float>(
    grad: &Tensor<F>,
    x: &Tensor<F>,
    params: &Tensor<f32>,
    gamma: &Tensor<f32>,
    sums: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let channels = x.shape(1);
    let c = (i / x.shape(2)) % channels;
    let invstd = params[2 * channels + c];
    let inv_n = params[3 * channels + c];
    let g0 = sums[c] * inv_n;
    // invstd · (invstd · (Σ / N)): no invstd² that could overflow on its own.
    let g1 = invstd * (invstd * (sums[channels + c] * inv_n));
    let xmu = (f32::cast_from(x[i]) - params[c]) - params[channels + c];
    let inner = f32::cast_from(grad[i]) - g0 - xmu * g1;
    out[i] = F::cast_from(inner * (gamma[c] * invstd));
}

/// One unit per channel: combines every rank's `[K; mean of x − K; M2; count]` (`gathered`,
/// a contiguous `[W, 4, C]`) into the `[6, C]` rows described at
/// [`SyncBatchNormBackend::sync_bn_combine`]; `local` is this rank's contiguous `[4, C]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn combine_kernel<F: Float>(
    gathered: &Tensor<F>,
    local: &Tensor<F>,
    running_mean: &Tensor<F>,
    running_var: &Tensor<F>,
    out: &mut Tensor<F>,
    epsilon: InputScalar,
    momentum: InputScalar,
    keep: InputScalar,
    #[comptime] unbiased: bool,
    #[define(F)] _dtype: ElemType,
) {
    let c = ABSOLUTE_POS;
    let channels = out.shape(1);
    if c >= channels {
        terminate!();
    }
    let world = gathered.shape(0);
    let zero = F::new(0.0);
    let one = F::new(1.0);

    // The common pivot: the average of the non-empty ranks' pivots.
    let mut pivots = zero;
    let mut present = zero;
    let mut r = 0;
    while r < world {
        let base = r * 4 * channels + c;
        if gathered[base + 3 * channels] > zero {
            pivots += gathered[base];
            present += one;
        }
        r += 1;
    }
    if present < one {
        present = one;
    }
    let pivot = pivots / present;

    let mut total = zero;
    let mut weighted = zero;
    r = 0;
    while r < world {
        let base = r * 4 * channels + c;
        let n = gathered[base + 3 * channels];
        let d = (gathered[base] - pivot) + gathered[base + channels];
        total += n;
        weighted += n * d;
        r += 1;
    }
    let mut safe_total = total;
    if safe_total < one {
        safe_total = one;
    }
    let delta = weighted / safe_total;

    let mut m2 = zero;
    r = 0;
    while r < world {
        let base = r * 4 * channels + c;
        let n = gathered[base + 3 * channels];
        let dev = (gathered[base] - pivot) + gathered[base + channels] - delta;
        m2 += gathered[base + 2 * channels] + n * dev * dev;
        r += 1;
    }
    let biased = m2 / safe_total;
    let k = local[c];
    out[c] = k;
    out[channels + c] = (pivot - k) + delta;
    out[2 * channels + c] = one / F::sqrt(biased + epsilon.get::<F>());
    out[3 * channels + c] = one / safe_total;

    // Running statistics: BatchNorm's update, or unchanged without enough samples.
    let mut var = biased;
    let mut min_count = zero;
    if comptime!(unbiased) {
        let mut n_minus_1 = total - one;
        if n_minus_1 < one {
            n_minus_1 = one;
        }
        var = m2 / n_minus_1;
        min_count = one;
    }
    let mut new_mean = running_mean[c];
    let mut new_var = running_var[c];
    if total > min_count {
        let m = momentum.get::<F>();
        let kept = keep.get::<F>();
        new_mean = new_mean * kept + (pivot + delta) * m;
        new_var = new_var * kept + var * m;
    }
    out[4 * channels + c] = new_mean;
    out[5 * channels + c] = new_var;
}

/// A packed (contiguous) output of `shape` on `t`'s device, of `t`'s dtype. Not the backend's
/// default layout: on CUDA that pads rows (pitched), and the kernels write packed arrays.
fn empty_like(t: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, t.dtype)
}

/// `t` made contiguous, after checking that it is f32: a kernel argument declared
/// `&Tensor<f32>` would read any other dtype's bytes as f32.
fn f32_arg(t: CubeTensor, what: &str) -> CubeTensor {
    assert_eq!(
        t.dtype,
        DType::F32,
        "SyncBatchNorm kernels take {what} in f32, got {:?}",
        t.dtype
    );
    into_contiguous(t)
}

/// A packed f32 output of `shape` on `t`'s device (statistics and sums).
fn empty_f32(t: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, DType::F32)
}

/// Channels per cube of the tiled reductions, and sample rows per cube (`TILE_C · TILE_ROWS =
/// BLOCK`).
const TILE_C: usize = 32;
const TILE_ROWS: usize = BLOCK / TILE_C;

/// The units a per-channel reduction's cube gets on `x`'s device: [`BLOCK`] where the device
/// allows that many, else the largest power of two it allows. CubeCL's CPU runtime allows as
/// many units per cube as the machine has cores and runs each unit of a cube that synchronises
/// on a thread of its own (a spin barrier): a cube of [`BLOCK`] units there would be
/// [`BLOCK`] threads spinning on two cores.
fn reduction_units(x: &CubeTensor) -> usize {
    let allowed = x.client.properties().hardware.max_units_per_cube as usize;
    if allowed >= BLOCK {
        BLOCK
    } else {
        // The largest power of two ≤ allowed (≥ 1): the trees halve their lanes.
        1 << allowed.max(1).ilog2()
    }
}

/// Which reduction layout reads `x` coalesced: one cube per channel when a sample's channel
/// slice spans at least `TILE_C` consecutive elements, channel tiles otherwise. Tiles need
/// [`BLOCK`] units per cube; a device with fewer (the CPU runtime) takes one cube per channel.
fn tiled(x: &CubeTensor) -> bool {
    x.meta.shape()[2] < TILE_C && reduction_units(x) == BLOCK
}

fn per_channel_launch(x: &CubeTensor) -> (CubeCount, CubeDim) {
    let channels = x.meta.shape()[1];
    if tiled(x) {
        (
            CubeCount::Static(channels.div_ceil(TILE_C) as u32, 1, 1),
            CubeDim::new_2d(TILE_C as u32, TILE_ROWS as u32),
        )
    } else {
        (
            CubeCount::Static(channels as u32, 1, 1),
            CubeDim::new_1d(reduction_units(x) as u32),
        )
    }
}

fn elementwise_launch(out: &CubeTensor) -> (CubeCount, CubeDim) {
    let num = out.meta.shape().num_elements();
    let cube_dim = CubeDim::new(&out.client, num);
    (
        calculate_cube_count_elemwise(&out.client, num, cube_dim),
        cube_dim,
    )
}

/// Local statistics of `x` (`[N, C, S]`, `N·S ≥ 1`): `[4, C]` f32 rows of the pivot, the
/// mean of `x − K`, the M2 and the count (the tensor-op reference: [`crate::tensor_ops::stats`]).
pub fn stats(x: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let channels = x.shape()[1];
    assert!(
        x.shape().num_elements() > 0,
        "SyncBatchNorm per-channel reductions need at least one sample"
    );
    let out = empty_f32(&x, Shape::new([4, channels]));
    let (count, dim) = per_channel_launch(&x);
    let dtype = x.dtype;
    let (client, x_arg, out_arg) = (
        &out.client,
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    if tiled(&x) {
        stats_tiled_kernel::launch(
            client,
            count,
            dim,
            x_arg,
            out_arg,
            BLOCK,
            dtype_to_storage_type(dtype),
        );
    } else {
        stats_kernel::launch(
            client,
            count,
            dim,
            x_arg,
            out_arg,
            BLOCK,
            dtype_to_storage_type(dtype),
        );
    }
    out
}

/// Every rank's statistics (`gathered`, `[W, 4, C]`) combined with this rank's (`local`) into
/// the channel parameters and the new running statistics, `[6, C]` (reference:
/// [`crate::tensor_ops::combine`]).
pub fn combine(
    gathered: CubeTensor,
    local: CubeTensor,
    running_mean: CubeTensor,
    running_var: CubeTensor,
    options: CombineOptions,
) -> CubeTensor {
    let gathered = f32_arg(gathered, "the gathered statistics");
    let local = f32_arg(local, "this rank's statistics");
    let channels = local.shape()[1];
    let out = empty_like(&local, Shape::new([6, channels]));
    let elem = dtype_to_storage_type(local.dtype);
    let cube_dim = CubeDim::new(&out.client, channels);
    let count = calculate_cube_count_elemwise(&out.client, channels, cube_dim);
    combine_kernel::launch(
        &out.client,
        count,
        cube_dim,
        gathered.into_tensor_arg(),
        local.into_tensor_arg(),
        f32_arg(running_mean, "the running mean").into_tensor_arg(),
        f32_arg(running_var, "the running variance").into_tensor_arg(),
        out.clone().into_tensor_arg(),
        InputScalar::new(options.epsilon, elem),
        InputScalar::new(options.momentum, elem),
        InputScalar::new(1.0 - options.momentum, elem),
        options.unbiased,
        elem,
    );
    out
}

/// `y = ((x − K) − m) · (γ · invstd) + β` per channel (reference: [`crate::tensor_ops::normalize`]).
pub fn normalize(
    x: CubeTensor,
    params: CubeTensor,
    gamma: CubeTensor,
    beta: CubeTensor,
) -> CubeTensor {
    let x = into_contiguous(x);
    let out = empty_like(&x, x.shape());
    if x.shape().num_elements() == 0 {
        return out;
    }
    let (count, dim) = elementwise_launch(&out);
    let dtype = x.dtype;
    normalize_kernel::launch(
        &out.client,
        count,
        dim,
        x.into_tensor_arg(),
        f32_arg(params, "the channel parameters").into_tensor_arg(),
        f32_arg(gamma, "γ").into_tensor_arg(),
        f32_arg(beta, "β").into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    out
}

/// Local backward sums, `[2, C]`: `Σ dy` and `Σ dy · (x − μ)` per channel (reference:
/// [`crate::tensor_ops::grad_sums`]).
pub fn grad_sums(grad: CubeTensor, x: CubeTensor, params: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let channels = x.shape()[1];
    assert!(
        x.shape().num_elements() > 0,
        "SyncBatchNorm per-channel reductions need at least one sample"
    );
    let out = empty_f32(&x, Shape::new([2, channels]));
    let (count, dim) = per_channel_launch(&x);
    let dtype = x.dtype;
    let is_tiled = tiled(&x);
    let args = (
        into_contiguous(grad).into_tensor_arg(),
        x.into_tensor_arg(),
        f32_arg(params, "the channel parameters").into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    let elem = dtype_to_storage_type(dtype);
    if is_tiled {
        grad_sums_tiled_kernel::launch(
            &out.client,
            count,
            dim,
            args.0,
            args.1,
            args.2,
            args.3,
            BLOCK,
            elem,
        );
    } else {
        grad_sums_kernel::launch(
            &out.client,
            count,
            dim,
            args.0,
            args.1,
            args.2,
            args.3,
            BLOCK,
            elem,
        );
    }
    out
}

/// The input gradient from the backward sums of every rank (reference:
/// [`crate::tensor_ops::grad_input`]).
pub fn grad_input(
    grad: CubeTensor,
    x: CubeTensor,
    params: CubeTensor,
    gamma: CubeTensor,
    sums: CubeTensor,
) -> CubeTensor {
    let x = into_contiguous(x);
    let out = empty_like(&x, x.shape());
    if x.shape().num_elements() == 0 {
        return out;
    }
    let (count, dim) = elementwise_launch(&out);
    let dtype = x.dtype;
    grad_input_kernel::launch(
        &out.client,
        count,
        dim,
        into_contiguous(grad).into_tensor_arg(),
        x.into_tensor_arg(),
        f32_arg(params, "the channel parameters").into_tensor_arg(),
        f32_arg(gamma, "γ").into_tensor_arg(),
        f32_arg(sums, "the backward sums").into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    out
}
