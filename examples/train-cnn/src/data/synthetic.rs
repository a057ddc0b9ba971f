//! An embedded, procedurally generated image-classification dataset.
//!
//! Ten classes of 28×28 grayscale images: four oriented gratings, a disk, a ring, a square, a plus,
//! an X and a checkerboard. Every sample draws its own position, size, orientation jitter,
//! frequency, phase, contrast, brightness offset and noise level, so the task is learnable but
//! not solved after one epoch, and per-sample brightness offsets give the inputs a large,
//! varying mean — the regime where BatchNorm's batch statistics matter.
//!
//! Item `i` of a split is a pure function of `(seed, split, i)`: nothing is stored, nothing is
//! read from disk, and every process (rank) sees the same dataset.

use std::f64::consts::PI;

use super::{ImageItem, ImageSet};
use crate::rng::SplitMix64;

/// Side length of the generated images.
pub const SIDE: usize = 28;
/// Number of classes.
pub const NUM_CLASSES: usize = 10;

/// Which split of the synthetic dataset (the split is part of every item's random key, so the
/// splits share no sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training split.
    Train,
    /// Evaluation split.
    Eval,
}

/// A synthetic dataset of `len` images generated on demand from `seed`.
///
/// ```
/// use train_cnn::data::synthetic::{Split, SyntheticImages};
/// use train_cnn::data::ImageSet;
/// let ds = SyntheticImages::new(42, Split::Train, 100);
/// let a = ds.item(3);
/// assert_eq!(a.pixels.len(), 28 * 28);
/// assert_eq!(a, ds.item(3)); // deterministic
/// ```
#[derive(Debug, Clone)]
pub struct SyntheticImages {
    seed: u64,
    split: Split,
    len: usize,
}

impl SyntheticImages {
    /// `len` images of `split`, generated from `seed`.
    pub fn new(seed: u64, split: Split, len: usize) -> Self {
        Self { seed, split, len }
    }
}

impl ImageSet for SyntheticImages {
    fn len(&self) -> usize {
        self.len
    }

    fn dims(&self) -> (usize, usize) {
        (SIDE, SIDE)
    }

    fn num_classes(&self) -> usize {
        NUM_CLASSES
    }

    fn item(&self, index: usize) -> ImageItem {
        assert!(
            index < self.len,
            "index {index} out of range 0..{}",
            self.len
        );
        let split = match self.split {
            Split::Train => 1,
            Split::Eval => 2,
        };
        // Balanced classes: the label cycles; everything else is random per item.
        let label = index % NUM_CLASSES;
        let mut rng = SplitMix64::for_key(&[self.seed, split, index as u64]);
        ImageItem {
            pixels: render(label, &mut rng),
            label,
        }
    }
}

/// Smooth 0→1 edge: 1 inside (`d < 0`), 0 outside, linear over one pixel.
fn inside(d: f64) -> f64 {
    (0.5 - d).clamp(0.0, 1.0)
}

fn render(label: usize, rng: &mut SplitMix64) -> Vec<f32> {
    let c = (SIDE as f64 - 1.0) / 2.0;
    let cx = c + rng.uniform(-4.0, 4.0);
    let cy = c + rng.uniform(-4.0, 4.0);
    // Orientation jitter of up to ±20° keeps 45°-apart gratings separable but not trivially.
    let jitter = rng.uniform(-20.0, 20.0).to_radians();
    let freq = rng.uniform(0.10, 0.22); // cycles per pixel
    let phase = rng.uniform(0.0, 2.0 * PI);
    let size = rng.uniform(4.5, 8.5);
    let contrast = rng.uniform(0.35, 1.4);
    let offset = rng.uniform(-1.0, 2.0);
    let noise = rng.uniform(0.25, 0.75);

    let mut out = Vec::with_capacity(SIDE * SIDE);
    let (s, co) = jitter.sin_cos();
    for py in 0..SIDE {
        for px in 0..SIDE {
            let (dx, dy) = (px as f64 - cx, py as f64 - cy);
            // Coordinates rotated by the jitter.
            let u = co * dx + s * dy;
            let v = -s * dx + co * dy;
            let grating = |angle_deg: f64| {
                let a = angle_deg.to_radians();
                let t = a.cos() * u + a.sin() * v;
                0.5 + 0.5 * (2.0 * PI * freq * t + phase).sin()
            };
            let r = (u * u + v * v).sqrt();
            let value = match label {
                0 => grating(0.0),
                1 => grating(90.0),
                2 => grating(45.0),
                3 => grating(135.0),
                4 => inside(r - size),
                5 => inside((r - size).abs() - 1.2),
                6 => inside(u.abs().max(v.abs()) - size * 0.8),
                7 => inside(u.abs().min(v.abs()) - 1.3) * inside(u.abs().max(v.abs()) - size),
                8 => {
                    let (a, b) = ((u + v) / 2f64.sqrt(), (u - v) / 2f64.sqrt());
                    inside(a.abs().min(b.abs()) - 1.3) * inside(a.abs().max(b.abs()) - size)
                }
                _ => {
                    let k = 2.0 * PI * freq;
                    0.5 + 0.5 * ((k * u + phase).sin() * (k * v + phase).sin()).signum()
                }
            };
            let x = offset + contrast * value + noise * rng.normal();
            out.push(x as f32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_deterministic_and_splits_differ() {
        let a = SyntheticImages::new(5, Split::Train, 50);
        let b = SyntheticImages::new(5, Split::Train, 50);
        let e = SyntheticImages::new(5, Split::Eval, 50);
        let other_seed = SyntheticImages::new(6, Split::Train, 50);
        for i in [0, 1, 17, 49] {
            assert_eq!(a.item(i), b.item(i));
            assert_ne!(a.item(i).pixels, e.item(i).pixels);
            assert_ne!(a.item(i).pixels, other_seed.item(i).pixels);
        }
    }

    #[test]
    fn classes_are_balanced_and_pixels_finite() {
        let ds = SyntheticImages::new(1, Split::Train, 200);
        let mut counts = [0usize; NUM_CLASSES];
        for i in 0..ds.len() {
            let it = ds.item(i);
            counts[it.label] += 1;
            assert!(it.pixels.iter().all(|p| p.is_finite()));
        }
        assert!(counts.iter().all(|&c| c == 20), "{counts:?}");
    }

    #[test]
    fn samples_carry_different_brightness_offsets() {
        // Per-sample offsets: the mean pixel value of items of one class spreads widely.
        let ds = SyntheticImages::new(3, Split::Train, 400);
        let means: Vec<f64> = (0..ds.len())
            .filter(|i| i % NUM_CLASSES == 4)
            .map(|i| ds.item(i).pixels.iter().map(|&p| p as f64).sum::<f64>() / 784.0)
            .collect();
        let lo = means.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = means.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert!(
            hi - lo > 1.5,
            "class-4 mean brightness spans only {lo}..{hi}"
        );
    }

    #[test]
    fn a_nearest_class_mean_classifier_is_far_from_perfect() {
        // The task must not be trivial: a template matcher on raw pixels stays well below 100 %.
        let train = SyntheticImages::new(9, Split::Train, 2000);
        let eval = SyntheticImages::new(9, Split::Eval, 500);
        let mut means = vec![vec![0f64; SIDE * SIDE]; NUM_CLASSES];
        for i in 0..train.len() {
            let it = train.item(i);
            for (m, &p) in means[it.label].iter_mut().zip(&it.pixels) {
                *m += p as f64 / 200.0;
            }
        }
        let mut correct = 0;
        for i in 0..eval.len() {
            let it = eval.item(i);
            let best = (0..NUM_CLASSES)
                .min_by(|&a, &b| {
                    let d = |c: usize| -> f64 {
                        means[c]
                            .iter()
                            .zip(&it.pixels)
                            .map(|(m, &p)| (m - p as f64).powi(2))
                            .sum()
                    };
                    d(a).total_cmp(&d(b))
                })
                .unwrap();
            correct += usize::from(best == it.label);
        }
        let acc = correct as f64 / eval.len() as f64;
        assert!(acc < 0.8, "nearest class mean reaches {acc}");
    }
}
