//! Per-channel statistics and their cross-rank combination.
//!
//! burn-ddp's `SyncBatchNorm` combines every rank's (pivot, mean, M2, count) on the device
//! ([`tensor_ops::combine`](crate::tensor_ops::combine) or its CubeCL kernel), so the statistics never have to visit the host (NCCL
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
    /// The statistics of `samples`, computed directly (two passes; all zeros for none).
    pub fn of(samples: &[f64]) -> ChannelStats {
        if samples.is_empty() {
            return ChannelStats::default();
        }
        let count = samples.len() as f64;
        let mean = samples.iter().sum::<f64>() / count;
        let m2 = samples.iter().map(|x| (x - mean) * (x - mean)).sum();
        ChannelStats { count, mean, m2 }
    }

    /// Combines two partial statistics (Chan, Golub & LeVeque): no sum / sum-of-squares
    /// cancellation, and an empty side leaves the other unchanged.
    ///
    /// ```
    /// use burn_ddp_batchnorm::ChannelStats;
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
pub const ROWS: usize = 4;

/// The scalar settings of the combination ([`tensor_ops::combine`](crate::tensor_ops::combine)).
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
        ChannelStats::of(xs)
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
}
