//! Per-channel statistics and their cross-rank combination.
//!
//! [`combine`] is what [`SyncBatchNorm`](super::SyncBatchNorm) runs: it combines every rank's
//! (pivot, mean, M2, count) on the device with tensor operations, so the statistics never
//! have to visit the host (NCCL moves them in device memory; the host transport stages them).
//! [`ChannelStats`] is the same combination on the host in f64 (Chan et al.'s pairwise
//! formula), the reference the device combination is tested against.

use burn::tensor::{Bool, DType, Tensor};

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

/// The global statistics of one training call, on the device (f32).
pub(crate) struct Global {
    /// `[4, C]` channel parameters for the normalisation and backward operations: this
    /// rank's pivot `K`, `μ − K`, `1 / sqrt(σ² + ε)` and `1 / N` (see the backend docs).
    pub params: Tensor<2>,
    /// The global mean μ per channel.
    pub mean: Tensor<1>,
    /// The batch variance for the running statistics (biased or unbiased, as asked).
    pub var: Tensor<1>,
    /// Per channel: whether there were enough samples for `var` (N > 0, or N > 1 unbiased).
    /// Where not, the running statistics keep their values.
    pub valid: Tensor<1, Bool>,
}

/// Combines the all-gathered `[W, ROWS, C]` statistics of every rank into the global ones,
/// with tensor operations on their device, in f32.
///
/// Every rank's mean is first re-expressed relative to a common pivot `P` (the average of the
/// non-empty ranks' pivots, which lies among the samples), so with data of mean 1000 and
/// std 0.01 no step subtracts two large numbers whose difference matters:
/// `d_r = (K_r − P) + m_r`, `δ = Σ n_r d_r / N`, `μ = P + δ`,
/// `M2 = Σ M2_r + Σ n_r (d_r − δ)²` (the parallel form of Chan's update). Ranks with no
/// samples have `n_r = 0` and drop out.
pub(crate) fn combine(
    gathered: Tensor<3>,
    local_pivot: Tensor<1>,
    epsilon: f64,
    unbiased: bool,
) -> Global {
    let [world, rows, channels] = gathered.dims();
    debug_assert_eq!(rows, ROWS);
    let gathered = gathered.cast(DType::F32);
    let row = |r: usize| gathered.clone().narrow(1, r, 1).reshape([world, channels]);
    let (pivots, means, m2s, counts) = (row(0), row(1), row(2), row(3));

    let present = counts.clone().greater_elem(0.0).float();
    let present_ranks = present.clone().sum_dim(0).clamp_min(1.0); // [1, C]
    let pivot = (pivots.clone() * present).sum_dim(0) / present_ranks;
    let d = (pivots - pivot.clone()) + means;
    let total = counts.clone().sum_dim(0); // [1, C]
    let safe_total = total.clone().clamp_min(1.0);
    let delta = (counts.clone() * d.clone()).sum_dim(0) / safe_total.clone();
    let dev = d - delta.clone();
    let m2 = m2s.sum_dim(0) + (counts * dev.clone() * dev).sum_dim(0);
    let biased = m2.clone() / safe_total.clone();
    let invstd = (biased.clone() + epsilon).sqrt().recip();

    let local_pivot = local_pivot.cast(DType::F32).reshape([1, channels]);
    let local_mean = (pivot.clone() - local_pivot.clone()) + delta.clone();
    let params = Tensor::cat(vec![local_pivot, local_mean, invstd, safe_total.recip()], 0);
    let var = if unbiased {
        m2 / (total.clone() - 1.0).clamp_min(1.0)
    } else {
        biased
    };
    let valid = total.greater_elem(if unbiased { 1.0 } else { 0.0 });
    Global {
        params,
        mean: (pivot + delta).reshape([channels]),
        var: var.reshape([channels]),
        valid: valid.reshape([channels]),
    }
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

    #[test]
    fn device_combination_matches_f64_with_empty_ranks_and_a_large_mean() {
        use burn::tensor::{Device, TensorData};
        let device = Device::flex();
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
        let world = sizes.len();
        let all = Tensor::<3>::from_data(TensorData::new(flat, [world, ROWS, channels]), &device);
        for local_rank in [0, 1, 3] {
            let local_pivot = all.clone().narrow(0, local_rank, 1).narrow(1, 0, 1);
            let eps = 1e-5;
            let global = combine(all.clone(), local_pivot.reshape([channels]), eps, false);
            let read = |t: Tensor<1>| t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap();
            let mean = read(global.mean);
            let var = read(global.var);
            let params = global
                .params
                .into_data()
                .convert::<f64>()
                .try_to_vec::<f64>()
                .unwrap();
            for c in 0..channels {
                let w = want[c];
                assert!(
                    (mean[c] - w.mean).abs() <= 1e-4,
                    "mean {} vs {}",
                    mean[c],
                    w.mean
                );
                let rel = (var[c] - w.biased_var()).abs() / w.biased_var();
                assert!(
                    rel < 1e-4,
                    "channel {c}: var {} vs {} ({rel})",
                    var[c],
                    w.biased_var()
                );
                let invstd = 1.0 / (w.biased_var() + eps).sqrt();
                assert!((params[2 * channels + c] - invstd).abs() / invstd < 1e-4);
                assert_eq!(params[3 * channels + c], (1.0 / w.count as f32) as f64);
                // Row 0 is this rank's pivot, row 1 the global mean relative to it.
                let k = params[c];
                let exact = (w.mean - k) as f32 as f64;
                assert!((params[channels + c] - exact).abs() <= 1e-4 * (1.0 + exact.abs()));
            }
            assert_eq!(read(global.valid.float()), vec![1.0; channels]);
        }
    }

    #[test]
    fn device_combination_of_no_samples_is_marked_invalid() {
        use burn::tensor::{Device, TensorData};
        let device = Device::flex();
        let all = Tensor::<3>::from_data(TensorData::new(vec![0.0f32; 8], [1, ROWS, 2]), &device);
        let global = combine(all, Tensor::zeros([2], &device), 1e-5, true);
        let valid = global
            .valid
            .float()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_eq!(valid, vec![0.0, 0.0]);
        let params = global.params.into_data().try_to_vec::<f32>().unwrap();
        assert!(params.iter().all(|v| v.is_finite()), "{params:?}");
    }
}
