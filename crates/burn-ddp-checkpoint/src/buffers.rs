//! A model's buffers — its float tensors that take no gradient: BatchNorm's running mean and
//! variance, frozen parameters — as bytes ([`pack_buffers`]) and back ([`restore_buffers`]). With
//! per-rank BatchNorm every rank's running statistics differ; a checkpoint keeps each rank's,
//! so that a resume at the same world size continues exactly where every rank was.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};

use crate::CheckpointError;

/// Collects the bytes of every buffer in visit order.
struct Packer {
    bytes: Vec<u8>,
}

impl ModuleVisitor for Packer {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            self.bytes
                .extend_from_slice(param.val().into_data().as_bytes());
        }
    }
}

/// The bytes of `model`'s buffers (its float tensors that take no gradient) in visit order,
/// with its newest running statistics: what [`restore_buffers`] puts back.
pub fn pack_buffers<M: Module>(model: &M) -> Vec<u8> {
    crate::running_state::commit_running_states(model);
    let mut p = Packer { bytes: Vec::new() };
    model.visit(&mut p);
    p.bytes
}

/// Replaces every buffer by the next slice of the bytes.
struct Unpacker<'a> {
    bytes: &'a [u8],
    offset: usize,
    short: bool,
}

impl ModuleMapper for Unpacker<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if param.is_require_grad() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let end = self.offset + shape.num_elements() * dtype.size();
        let Some(chunk) = self.bytes.get(self.offset..end) else {
            self.short = true;
            return Param::from_mapped_value(id, tensor, mapper);
        };
        self.offset = end;
        let data = TensorData::from_bytes_vec(chunk.to_vec(), shape, dtype);
        Param::from_mapped_value(id, Tensor::<D>::from_data(data, &tensor.device()), mapper)
    }
}

/// `model` with its buffers replaced by `bytes` (what [`pack_buffers`] made of a model of the same
/// shape).
///
/// # Errors
/// [`CheckpointError::DoesNotFit`] (with an empty path) when the bytes do not match the
/// model's buffers.
pub fn restore_buffers<M: Module>(model: M, bytes: &[u8]) -> Result<M, CheckpointError> {
    // A pending update of the model's own would overwrite the restored values.
    crate::running_state::commit_running_states(&model);
    let mut u = Unpacker {
        bytes,
        offset: 0,
        short: false,
    };
    let model = model.map(&mut u);
    if u.short || u.offset != bytes.len() {
        return Err(CheckpointError::DoesNotFit {
            path: std::path::PathBuf::new(),
            reason: format!(
                "this rank's buffers: {} bytes saved, the model's buffers take {}",
                bytes.len(),
                pack_buffers(&model).len()
            ),
        });
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use burn::nn::{BatchNorm, BatchNormConfig};
    use burn::tensor::{Device, Tensor};

    use super::*;

    fn values(bn: &BatchNorm) -> Vec<f32> {
        let mut v = bn
            .running_mean
            .value()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        v.extend(
            bn.running_var
                .value()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap(),
        );
        v
    }

    /// BatchNorm's running statistics (after a training forward, still pending) go into the
    /// bytes and come back into another BatchNorm; parameters stay; a wrong size is an error.
    #[test]
    fn running_statistics_round_trip_and_parameters_stay() {
        // A training model: its parameters take gradients, its running statistics do not.
        let device = Device::flex().autodiff();
        let trained: BatchNorm = BatchNormConfig::new(3).init(&device);
        let x = Tensor::<4>::random(
            [4, 3, 2, 2],
            burn::tensor::Distribution::Normal(2.0, 3.0),
            &device,
        );
        let _ = trained.forward(x);
        let bytes = pack_buffers(&trained);
        assert_eq!(bytes.len(), 2 * 3 * 4, "mean and var, 3 channels of f32");
        let fresh: BatchNorm = BatchNormConfig::new(3).init(&device);
        let gamma = fresh.gamma.val().into_data();
        let restored = restore_buffers(fresh, &bytes).unwrap();
        assert_eq!(values(&restored), values(&trained));
        assert_ne!(values(&restored)[..3], [0.0; 3]);
        assert_eq!(restored.gamma.val().into_data(), gamma);
        let other: BatchNorm = BatchNormConfig::new(4).init(&device);
        assert!(restore_buffers(other, &bytes).is_err());
        let fresh: BatchNorm = BatchNormConfig::new(3).init(&device);
        assert!(restore_buffers(fresh, &bytes[..20]).is_err());
    }
}
