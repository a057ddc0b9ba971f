//! A small, documented, stable random number generator (SplitMix64).
//!
//! The synthetic dataset and the shuffles in this example must give the same numbers on every
//! platform and with every release of every dependency, so they use this fixed algorithm
//! instead of a library RNG whose stream may change between versions.

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state advanced by a Weyl constant and mixed.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for one item of a stream: mixes several words into one seed so that
    /// neighbouring keys (`[seed, split, index]`) give unrelated streams.
    pub fn for_key(words: &[u64]) -> Self {
        let mut h = 0x9E37_79B9_7F4A_7C15u64;
        for &w in words {
            h = mix(h ^ w.wrapping_add(0x632B_E59B_D9B4_E019));
        }
        Self::new(h)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// A uniform `f64` in `[0, 1)` (53 random bits).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform `f64` in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// A uniform integer in `0..n` (`n > 0`), by rejection so there is no modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no value to return");
        let zone = u64::MAX - (u64::MAX % n) - 1;
        loop {
            let v = self.next_u64();
            if v <= zone {
                return v % n;
            }
        }
    }

    /// A standard normal sample (Box–Muller; one of the pair is discarded for simplicity).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_reference_stream() {
        // Reference values of SplitMix64 seeded with 0 (from the published algorithm).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn uniform_and_normal_have_the_expected_moments() {
        let mut r = SplitMix64::new(7);
        let n = 100_000;
        let (mut s, mut s2) = (0.0, 0.0);
        for _ in 0..n {
            let x = r.normal();
            s += x;
            s2 += x * x;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.03, "var {var}");
        let u: f64 = (0..n).map(|_| r.next_f64()).sum::<f64>() / n as f64;
        assert!((u - 0.5).abs() < 0.01);
    }

    #[test]
    fn shuffle_is_a_permutation_and_depends_on_the_seed() {
        let mut a: Vec<usize> = (0..100).collect();
        let mut b = a.clone();
        SplitMix64::new(1).shuffle(&mut a);
        SplitMix64::new(2).shuffle(&mut b);
        assert_ne!(a, b);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }
}
