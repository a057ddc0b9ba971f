//! The device combination of every rank's statistics (`sync_bn_combine`, through the backend
//! extension on Flex and, with `wgpu`, on wgpu with kernels and tensor operations) against the
//! f64 reference, with empty ranks and a large mean.

use burn_ddp_batchnorm::ChannelStats;
use burn_ddp_batchnorm::stats::ROWS;

use super::{CombineOptions, SyncBatchNormBackend};

fn direct(xs: &[f64]) -> ChannelStats {
    ChannelStats::of(xs)
}

/// `values[rank][channel]` → the `[W, 4, C]` layout every rank contributes, as the
/// kernels compute it (pivot = first sample, mean and M2 relative to it).
fn gathered(values: &[Vec<Vec<f64>>], channels: usize) -> (Vec<f32>, Vec<ChannelStats>) {
    let mut flat = Vec::new();
    let mut want = vec![ChannelStats::default(); channels];
    for rank in values {
        let mut rows = vec![vec![0.0f32; channels]; ROWS];
        for (c, xs) in rank.iter().enumerate() {
            if let Some(&k) = xs.first() {
                let s = direct(xs);
                rows[0][c] = k as f32;
                rows[1][c] = (s.mean - k) as f32;
                rows[2][c] = s.m2 as f32;
                rows[3][c] = xs.len() as f32;
                want[c] = want[c].merge(s);
            }
        }
        flat.extend(rows.into_iter().flatten());
    }
    (flat, want)
}

/// The running statistics the combination tests start from (C = 2).
const RUNNING: ([f32; 2], [f32; 2]) = ([0.5, -1.0], [2.0, 3.0]);

/// `sync_bn_combine` on `device` as f64 rows (`[6 · C]`).
fn combine_on(
    device: &burn::tensor::Device,
    kernels: bool,
    gathered: (Vec<f32>, [usize; 3]),
    local_rank: usize,
    unbiased: bool,
) -> Vec<f64> {
    use burn::backend::Dispatch;
    use burn::tensor::{Tensor, TensorData};
    let (flat, shape) = gathered;
    let all = Tensor::<3>::from_data(TensorData::new(flat, shape), device);
    let local = all
        .clone()
        .narrow(0, local_rank, 1)
        .reshape([shape[1], shape[2]]);
    let out = Tensor::<2>::from_dispatch(Dispatch::sync_bn_combine(
        all.into_dispatch(),
        local.into_dispatch(),
        Tensor::<1>::from_floats(RUNNING.0, device).into_dispatch(),
        Tensor::<1>::from_floats(RUNNING.1, device).into_dispatch(),
        CombineOptions {
            epsilon: 1e-5,
            momentum: 0.1,
            unbiased,
        },
        kernels,
    ));
    assert_eq!(out.dims(), [6, shape[2]]);
    out.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .unwrap()
}

fn check_combination(device: &burn::tensor::Device, kernels: bool) {
    let channels = 2;
    let sample = |rank: usize, i: usize, c: usize| {
        let base = if c == 0 { 1000.0 } else { -3.0 };
        let spread = if c == 0 { 0.01 } else { 2.0 };
        base + spread * ((rank * 31 + i * 7 + c) as f64 * 0.37).sin()
    };
    let sizes = [5usize, 0, 3, 11];
    let values: Vec<Vec<Vec<f64>>> = sizes
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..channels)
                .map(|c| (0..n).map(|i| sample(r, i, c) as f32 as f64).collect())
                .collect()
        })
        .collect();
    let (flat, want) = gathered(&values, channels);
    let shape = [sizes.len(), ROWS, channels];
    for local_rank in [0, 1, 3] {
        for unbiased in [false, true] {
            let out = combine_on(device, kernels, (flat.clone(), shape), local_rank, unbiased);
            let at = |r: usize, c: usize| out[r * channels + c];
            for (c, w) in want.iter().enumerate() {
                let what = format!("kernels {kernels}, rank {local_rank}, channel {c}");
                // Row 0: this rank's pivot; row 1: the global mean relative to it.
                let k = values[local_rank][c].first().copied().unwrap_or(0.0);
                assert_eq!(at(0, c), k, "{what}: pivot");
                let exact = w.mean - k;
                assert!(
                    (at(1, c) - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "{what}"
                );
                let invstd = 1.0 / (w.biased_var() + 1e-5).sqrt();
                assert!((at(2, c) - invstd).abs() / invstd < 1e-4, "{what}: invstd");
                assert!((at(3, c) * w.count - 1.0).abs() < 1e-6, "{what}: 1/N");
                let mean = 0.9 * RUNNING.0[c] as f64 + 0.1 * w.mean;
                assert!((at(4, c) - mean).abs() <= 1e-4, "{what}: running mean");
                let var = if unbiased {
                    w.unbiased_var()
                } else {
                    w.biased_var()
                };
                let var = 0.9 * RUNNING.1[c] as f64 + 0.1 * var;
                assert!(
                    (at(5, c) - var).abs() / var < 1e-5,
                    "{what}: {} vs {var}",
                    at(5, c)
                );
            }
        }
    }

    // No sample anywhere: finite parameters, and the running statistics keep their values.
    let out = combine_on(
        device,
        kernels,
        (vec![0.0; 2 * ROWS], [1, ROWS, 2]),
        0,
        true,
    );
    assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
    let running: Vec<f64> = RUNNING
        .0
        .iter()
        .chain(&RUNNING.1)
        .map(|&v| v as f64)
        .collect();
    assert_eq!(&out[8..12], running.as_slice());
}

#[test]
fn device_combination_matches_f64_with_empty_ranks_and_a_large_mean() {
    check_combination(&burn::tensor::Device::flex(), false);
}

#[cfg(feature = "wgpu")]
#[test]
fn device_combination_kernel_and_tensor_ops_on_wgpu_match_f64() {
    let device = burn::tensor::Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    check_combination(&device, true);
    check_combination(&device, false);
}
