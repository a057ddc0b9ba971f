//! The statistics of the BatchNorm sweep: mean ± standard deviation over seeds, paired
//! differences between modes that share a seed, and whether a difference is beyond its error
//! bars (Student's t, 95 %, two-sided).

use serde::Serialize;

/// Mean and sample standard deviation (`n − 1` in the denominator; 0 for fewer than two
/// values) of some values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MeanSd {
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
}

impl MeanSd {
    /// Of `values` (NaN when there are none).
    pub fn of(values: &[f64]) -> Self {
        let n = values.len();
        if n == 0 {
            return MeanSd {
                mean: f64::NAN,
                sd: f64::NAN,
                n,
            };
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let sd = if n < 2 {
            0.0
        } else {
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        };
        MeanSd { mean, sd, n }
    }
}

/// The difference `a − b` of two modes over the seeds they share: per seed, then mean ± sd,
/// with the half-width of its 95 % confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PairedDiff {
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
    /// Half-width of the 95 % confidence interval of the mean difference:
    /// `t(0.975, n − 1) · sd / √n` (infinite below two seeds: nothing can be concluded).
    pub ci95: f64,
    /// The smallest difference that counts at all (e.g. one eval image): seeds that agree
    /// exactly would otherwise make a rounding-level difference "significant".
    pub floor: f64,
}

impl PairedDiff {
    /// Of the per-seed differences `d`; differences up to `floor` in magnitude never count.
    pub fn of(d: &[f64], floor: f64) -> Self {
        let m = MeanSd::of(d);
        let ci95 = if m.n < 2 {
            f64::INFINITY
        } else {
            t_975(m.n - 1) * m.sd / (m.n as f64).sqrt()
        };
        PairedDiff {
            mean: m.mean,
            sd: m.sd,
            n: m.n,
            ci95,
            floor,
        }
    }

    /// Whether the difference is above 0 beyond its error bars (its 95 % interval excludes 0)
    /// and above the floor.
    pub fn above_zero(&self) -> bool {
        self.mean - self.ci95 > 0.0 && self.mean > self.floor
    }

    /// Whether the difference is below 0 beyond its error bars and the floor.
    pub fn below_zero(&self) -> bool {
        self.mean + self.ci95 < 0.0 && -self.mean > self.floor
    }
}

/// The 97.5 % quantile of Student's t distribution with `df` degrees of freedom (two-sided
/// 95 %): the table value for 1–30, the normal distribution's 1.96 beyond.
pub fn t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        _ => 1.96,
    }
}

/// The standard error of an accuracy `p` (a fraction) measured on `n` images:
/// `√(p (1 − p) / n)`.
pub fn accuracy_standard_error(p: f64, n: usize) -> f64 {
    if n == 0 {
        return f64::INFINITY;
    }
    (p * (1.0 - p) / n as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_sd() {
        let m = MeanSd::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m.mean, 5.0);
        assert!((m.sd - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(MeanSd::of(&[3.0]).sd, 0.0);
        assert!(MeanSd::of(&[]).mean.is_nan());
    }

    #[test]
    fn a_paired_difference_is_beyond_its_error_bars_only_when_its_interval_excludes_zero() {
        // Five seeds, every one 1.0 ± 0.1 lower: clearly below zero.
        let d = PairedDiff::of(&[-1.0, -0.9, -1.1, -1.0, -0.95], 0.0);
        assert!(d.below_zero() && !d.above_zero(), "{d:?}");
        assert!((d.ci95 - 2.776 * d.sd / 5f64.sqrt()).abs() < 1e-12);
        // Noise around zero: neither.
        let d = PairedDiff::of(&[0.3, -0.4, 0.1, -0.2, 0.15], 0.0);
        assert!(!d.below_zero() && !d.above_zero(), "{d:?}");
        // One seed proves nothing, however large the difference.
        let d = PairedDiff::of(&[-10.0], 0.0);
        assert!(!d.below_zero() && d.ci95.is_infinite());
        // Seeds that agree to the last bit on a rounding-level difference: below the floor.
        let d = PairedDiff::of(&[1e-6, 1e-6, 1e-6], 0.1);
        assert!(!d.above_zero(), "{d:?}");
        assert!(PairedDiff::of(&[0.5, 0.5, 0.5], 0.1).above_zero());
    }

    #[test]
    fn t_quantiles_fall_towards_the_normal_one() {
        assert_eq!(t_975(4), 2.776);
        assert!(t_975(1) > t_975(2) && t_975(30) > 1.96);
        assert_eq!(t_975(1000), 1.96);
        assert!(t_975(0).is_infinite());
    }

    #[test]
    fn standard_error_of_an_accuracy() {
        // 90 % on 10 000 images: 0.3 points.
        assert!((accuracy_standard_error(0.9, 10_000) - 0.003).abs() < 1e-12);
        assert!(accuracy_standard_error(0.5, 0).is_infinite());
    }
}
