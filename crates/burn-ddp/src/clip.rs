//! Clipping the averaged gradients by their global norm: PyTorch's
//! `torch.nn.utils.clip_grad_norm_(params, max_norm)` after DDP's all-reduce, for
//! [`crate::DdpOptimizer::with_global_norm_clipping`].
//!
//! The norm is that of all trainable parameters' averaged gradients together,
//! `‖g‖ = √(Σ_p Σ g_p²)`, and every gradient is scaled by `max_norm / (‖g‖ + 1e-6)` when that is
//! below 1 (PyTorch's formula). Burn's own `with_grad_clipping` clips each parameter by its own
//! norm, which is another algorithm.
//!
//! **Sharded and unsharded alike, bitwise.** Each parameter's sum of squares `Σ g_p²` is computed
//! by the same tensor operations on the same (bitwise equal) averaged gradient, on the rank that
//! holds it: every rank for the unsharded optimizer, its owner for the sharded one, whose
//! per-parameter sums are all-reduced (every other rank adds an exact 0). The sums are then
//! added in f64 in the model's visit order on every rank, so the norm, the scale and the
//! clipped gradients are the same bits whichever optimizer runs.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};

use crate::error::{DdpError, Result};

/// What PyTorch adds to the norm before dividing (`clip_grad_norm_`'s `1e-6`).
pub const NORM_EPSILON: f64 = 1e-6;

/// The sum of squares of each trainable parameter's gradient in `grads`, in `module`'s visit
/// order (0 for a parameter without one), each summed on its device in f32 (f16/bf16 gradients
/// cast to f32 first) and read back in one transfer.
///
/// # Errors
/// [`DdpError::TensorData`] when the sums cannot be read back.
pub(crate) fn squared_norms<M: Module>(module: &M, grads: &GradientsParams) -> Result<Vec<f64>> {
    struct Sums<'a> {
        grads: &'a GradientsParams,
        /// Per trainable parameter: the index of its sum in `sums`, if it has a gradient.
        index: Vec<Option<usize>>,
        sums: Vec<Tensor<1>>,
        device: Option<Device>,
    }
    impl ModuleVisitor for Sums<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let Some(g) = self.grads.get::<D>(param.id) else {
                self.index.push(None);
                return;
            };
            let g = if g.dtype() == DType::F32 {
                g
            } else {
                g.cast(DType::F32)
            };
            let device = self.device.get_or_insert_with(|| g.device()).clone();
            self.index.push(Some(self.sums.len()));
            self.sums.push(g.square().sum().to_device(&device));
        }
    }
    let mut v = Sums {
        grads,
        index: Vec::new(),
        sums: Vec::new(),
        device: None,
    };
    module.visit(&mut v);
    let values: Vec<f32> = if v.sums.is_empty() {
        Vec::new()
    } else {
        Tensor::cat(v.sums, 0)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| DdpError::TensorData {
                what: "the gradients' sums of squares".into(),
                msg: format!("{e:?}"),
            })?
    };
    Ok(v.index
        .into_iter()
        .map(|i| i.map_or(0.0, |i| f64::from(values[i])))
        .collect())
}

/// The global norm of gradients whose per-parameter sums of squares are `squared` (added in
/// this order), and the factor that clips it to `max_norm` (`None`: the norm is within it).
pub(crate) fn clip_factor(squared: &[f64], max_norm: f64) -> (f64, Option<f32>) {
    let norm = squared.iter().fold(0.0f64, |acc, s| acc + s).sqrt();
    let factor = max_norm / (norm + NORM_EPSILON);
    (norm, (factor < 1.0).then_some(factor as f32))
}

/// Every trainable parameter's gradient in `grads` multiplied by `factor`.
pub(crate) fn scale_gradients<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    factor: f32,
) -> GradientsParams {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads
                    .register::<D>(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    module.visit(&mut Scale {
        grads: &mut grads,
        factor,
    });
    grads
}

/// Checks a clipping threshold: finite and above 0.
///
/// # Errors
/// [`DdpError::InvalidSetting`] otherwise.
pub(crate) fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(())
    } else {
        Err(DdpError::InvalidSetting {
            setting: "DdpOptimizer::with_global_norm_clipping",
            reason: format!("max_norm must be finite and above 0, got {max_norm}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_factor_clips_the_global_norm() {
        // Gradients (3, 4): norm 5, clipped to 1 by a factor just under 1/5.
        let (norm, factor) = clip_factor(&[9.0, 16.0], 1.0);
        assert_eq!(norm, 5.0);
        assert!((factor.unwrap() - 0.2).abs() < 1e-6);
        assert_eq!(clip_factor(&[0.25], 1.0).1, None);
    }
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;

    #[test]
    fn the_norm_is_that_of_every_gradient_together_and_clipping_scales_them_all() {
        let device = Device::flex().autodiff();
        let model: Linear = LinearConfig::new(3, 2).init(&device);
        let x = Tensor::<2>::from_data(TensorData::from([[1.0f32, -2.0, 3.0]]), &device);
        let loss = model.forward(x).sum().mul_scalar(10.0);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let squared = squared_norms(&model, &grads).unwrap();
        // Weight: ∂/∂w = 10·xᵀ per output (2 columns), bias: 10 per output.
        let w = 2.0 * 100.0 * (1.0 + 4.0 + 9.0);
        let b = 2.0 * 100.0;
        assert_eq!(squared, [w, b]);
        let (norm, factor) = clip_factor(&squared, 1.0);
        assert!((norm - (w + b).sqrt()).abs() < 1e-9);
        let factor = factor.unwrap();
        let clipped = scale_gradients(&model, grads, factor);
        let after = squared_norms(&model, &clipped).unwrap();
        let (norm_after, again) = clip_factor(&after, 1.0);
        assert!((norm_after - 1.0).abs() < 1e-5, "{norm_after}");
        // Clipping again changes nothing beyond PyTorch's epsilon.
        assert!(again.is_none_or(|f| f > 0.99999), "{again:?}");
    }

    #[test]
    fn a_parameter_without_a_gradient_counts_zero() {
        let device = Device::flex().autodiff();
        let model: Linear = LinearConfig::new(2, 2).init(&device);
        let grads = GradientsParams::new();
        assert_eq!(squared_norms(&model, &grads).unwrap(), [0.0, 0.0]);
        assert_eq!(clip_factor(&[0.0, 0.0], 1.0).1, None);
    }

    #[test]
    fn a_threshold_must_be_positive_and_finite() {
        assert!(check_max_norm(1.0).is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = check_max_norm(bad).unwrap_err().to_string();
            assert!(e.contains("max_norm must be finite and above 0"), "{e}");
        }
    }
}
