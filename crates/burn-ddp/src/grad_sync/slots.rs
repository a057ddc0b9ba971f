//! A slot per trainable float parameter, in module visit order: its gradient taken out of
//! Burn's `GradientsParams`, and the averaged gradient registered back.

use std::hash::Hasher;

use burn::module::{ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};

/// One trainable float parameter in visit order.
pub(crate) struct Slot {
    pub(crate) id: ParamId,
    pub(crate) shape: Shape,
    pub(crate) numel: usize,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// This rank's gradient, flattened (taken out of the `GradientsParams`).
    pub(crate) grad: Option<Tensor<1>>,
    /// The averaged gradient (flat, f32, possibly a view into its bucket's tensor), once its
    /// bucket came back.
    pub(crate) reduced: Option<Tensor<1>>,
}

impl Slot {
    /// Takes this rank's gradient to the host as f32 (zeros when this rank has none): the
    /// host buffer a host-side reduction reads and writes in place.
    pub(crate) fn take_host_f32(&mut self) -> TensorData {
        match self.grad.take() {
            None => TensorData::new(vec![0f32; self.numel], [self.numel]),
            Some(g) => {
                let data = g.into_data();
                if data.dtype() == DType::F32 {
                    data
                } else {
                    data.convert::<f32>()
                }
            }
        }
    }
}

/// Visits trainable float params and takes their gradients out.
pub(crate) struct SlotCollector<'a> {
    pub(crate) grads: &'a mut GradientsParams,
    pub(crate) slots: Vec<Slot>,
}

impl ModuleVisitor for SlotCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let grad = self.grads.remove::<D>(param.id);
        let (shape, dtype, device) = match &grad {
            Some(g) => (g.shape(), g.dtype(), g.device()),
            None => {
                let v = param.val();
                (v.shape(), v.dtype(), v.device().without_autodiff())
            }
        };
        let numel = shape.num_elements();
        self.slots.push(Slot {
            id: param.id,
            shape,
            numel,
            dtype,
            device,
            grad: grad.map(|g| g.reshape([numel])),
            reduced: None,
        });
    }
}

/// Registers averaged gradients back with the right rank `D`.
pub(crate) struct SlotWriter<'a> {
    pub(crate) grads: &'a mut GradientsParams,
    pub(crate) slots: std::slice::IterMut<'a, Slot>,
}

impl ModuleVisitor for SlotWriter<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let Some(slot) = self.slots.next() else {
            return;
        };
        debug_assert_eq!(slot.id, param.id);
        if let Some(flat) = slot.reduced.take() {
            // f32 (host path), or already the gradient's dtype (device path): stay on device.
            let grad = if slot.dtype == DType::F32 || flat.dtype() == slot.dtype {
                let flat = if flat.device() == slot.device {
                    flat
                } else {
                    flat.to_device(&slot.device)
                };
                flat.reshape(slot.shape.clone())
            } else {
                let data = flat.into_data().convert_dtype(slot.dtype);
                Tensor::<1>::from_data(data, &slot.device).reshape(slot.shape.clone())
            };
            self.grads.register::<D>(slot.id, grad);
        }
    }
}

/// FNV-1a over the slot sizes and ranks: equal on ranks with the same trainable layout.
pub(crate) fn layout_fingerprint(slots: &[Slot]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(&(slots.len() as u64).to_le_bytes());
    for s in slots {
        h.write(&(s.shape.num_dims() as u64).to_le_bytes());
        for &d in s.shape.iter() {
            h.write(&(d as u64).to_le_bytes());
        }
    }
    h.finish()
}
