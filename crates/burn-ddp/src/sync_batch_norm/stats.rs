//! Per-channel statistics and their cross-rank combination.
//!
//! [`SyncBatchNorm`](super::SyncBatchNorm) combines every rank's (pivot, mean, M2, count) on
//! the device ([`SyncBatchNormBackend::sync_bn_combine`](super::SyncBatchNormBackend::sync_bn_combine):
//! a CubeCL kernel or tensor operations), so the statistics never have to visit the host (NCCL
//! moves them in device memory; the host transport stages them). [`ChannelStats`] is the same
//! combination on the host in f64 (Chan et al.'s pairwise formula), the reference the device
//! combination is tested against.

/// One rank's statistics of one channel: sample count, mean and sum of squared deviations.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ChannelStats {
    /// Number of samples.
    pub count: f64,
    /// Mean of the samples (0 when `count` is 0).
    pub mean: f64,
    /// Sum of squared deviations from `mean` (M2; 0 when `count` is 0).
    pub m2: f64,
}

impl ChannelStats {
    /// Combines two partial statistics (Chan, Golub & LeVeque): no sum / sum-of-squares
    /// cancellation, and an empty side leaves the other unchanged.
    ///
    /// ```
    /// use burn_ddp::sync_batch_norm::ChannelStats;
    /// let a = ChannelStats { count: 2.0, mean: 1.0, m2: 2.0 }; // {0, 2}
    /// let b = ChannelStats { count: 1.0, mean: 4.0, m2: 0.0 }; // {4}
    /// let ab = a.merge(b);
    /// assert_eq!((ab.count, ab.mean, ab.m2), (3.0, 2.0, 8.0));
    /// ```
    pub fn merge(self, other: ChannelStats) -> ChannelStats {
        if other.count == 0.0 {
            return self;
        }
        if self.count == 0.0 {
            return other;
        }
        let count = self.count + other.count;
        let delta = other.mean - self.mean;
        ChannelStats {
            count,
            mean: self.mean + delta * other.count / count,
            m2: self.m2 + other.m2 + delta * delta * self.count * other.count / count,
        }
    }

    /// Biased variance `M2 / n` (Burn's and PyTorch's normalisation variance).
    pub fn biased_var(&self) -> f64 {
        if self.count > 0.0 {
            self.m2 / self.count
        } else {
            0.0
        }
    }

    /// Unbiased variance `M2 / (n − 1)` (PyTorch's running-variance convention).
    pub fn unbiased_var(&self) -> f64 {
        if self.count > 1.0 {
            self.m2 / (self.count - 1.0)
        } else {
            f64::NAN
        }
    }
}

/// Rows of the `[ROWS, C]` statistics each rank contributes: the pivot `K` (the rank's first
/// sample of the channel, 0 without samples), the mean of `x − K`, the M2 of `x` and the
/// sample count.
pub(crate) const ROWS: usize = 4;

/// The scalar settings of [`SyncBatchNormBackend::sync_bn_combine`](super::SyncBatchNormBackend::sync_bn_combine).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CombineOptions {
    /// Added to the variance in `1 / sqrt(σ² + ε)`.
    pub epsilon: f64,
    /// Weight of the batch statistics in the running-statistics update.
    pub momentum: f64,
    /// Whether the running variance takes `M2 / (N − 1)` (PyTorch) instead of `M2 / N`.
    pub unbiased: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn direct(xs: &[f64]) -> ChannelStats {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let m2 = xs.iter().map(|x| (x - mean) * (x - mean)).sum();
        ChannelStats { count: n, mean, m2 }
    }

    #[test]
    fn merge_equals_direct_with_empty_parts() {
        let xs: Vec<f64> = (0..11)
            .map(|i| 1000.0 + (i as f64 * 0.37).sin() * 0.01)
            .collect();
        let parts = [&xs[..5], &xs[5..5], &xs[5..8], &xs[8..]];
        let merged = parts.iter().fold(ChannelStats::default(), |acc, p| {
            acc.merge(if p.is_empty() {
                ChannelStats::default()
            } else {
                direct(p)
            })
        });
        let want = direct(&xs);
        assert_eq!(merged.count, want.count);
        assert!((merged.mean - want.mean).abs() < 1e-12);
        assert!((merged.m2 - want.m2).abs() <= 1e-9 * want.m2);
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
        use super::super::{CombineOptions, SyncBatchNormBackend};
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
}
