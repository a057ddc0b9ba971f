//! Per-channel statistics on the host and their cross-rank combination (Chan et al.'s parallel
//! formula), in f64.

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

/// The layout every rank all-gathers: `[count, mean_0..mean_C, m2_0..m2_C]` (f64).
pub(crate) fn pack(count: f64, stats: &[ChannelStats]) -> Vec<f64> {
    let mut buf = Vec::with_capacity(1 + 2 * stats.len());
    buf.push(count);
    buf.extend(stats.iter().map(|s| s.mean));
    buf.extend(stats.iter().map(|s| s.m2));
    buf
}

/// Combines the gathered `pack`ed buffers of every rank (rank order), channel by channel.
pub(crate) fn combine_gathered(gathered: &[f64], channels: usize) -> Vec<ChannelStats> {
    let stride = 1 + 2 * channels;
    let mut out = vec![ChannelStats::default(); channels];
    for rank in gathered.chunks_exact(stride) {
        let count = rank[0];
        for (c, acc) in out.iter_mut().enumerate() {
            *acc = acc.merge(ChannelStats {
                count,
                mean: rank[1 + c],
                m2: rank[1 + channels + c],
            });
        }
    }
    out
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

    #[test]
    fn gathered_layout_round_trips() {
        let a = [
            ChannelStats {
                count: 2.0,
                mean: 1.0,
                m2: 2.0,
            },
            ChannelStats {
                count: 2.0,
                mean: -1.0,
                m2: 0.5,
            },
        ];
        let b = [ChannelStats::default(); 2];
        let c = [
            ChannelStats {
                count: 1.0,
                mean: 4.0,
                m2: 0.0,
            },
            ChannelStats {
                count: 1.0,
                mean: 3.0,
                m2: 0.0,
            },
        ];
        let mut gathered = pack(2.0, &a);
        gathered.extend(pack(0.0, &b));
        gathered.extend(pack(1.0, &c));
        let out = combine_gathered(&gathered, 2);
        assert_eq!(out[0], a[0].merge(c[0]));
        assert_eq!(out[1], a[1].merge(c[1]));
        assert_eq!(out[0].count, 3.0);
    }
}
