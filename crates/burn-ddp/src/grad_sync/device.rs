//! The device path: every bucket concatenated on its CUDA device and all-reduced there by
//! NCCL ([`crate::cuda::DeviceComm`]), with no host copy. Compiled in every build; taken only
//! with the `cuda` feature and a communicator.

use std::time::Instant;

use burn::tensor::{DType, Tensor};
use ddp_comm::ReduceOp;

use super::buckets::Bucket;
use super::slots::Slot;
use super::{GradientSynchronizer, PipelineTimes};
use crate::error::{DdpError, Result};

impl GradientSynchronizer {
    /// The device path: every bucket concatenated on the device, all of them all-reduced by
    /// one NCCL group call (one device synchronisation, one wait), then sliced back (see
    /// [`crate::nccl`]). Same buckets, in the same order, as the host path. The packed buckets
    /// are alive together, one extra copy of the gradients (PyTorch's DDP keeps its buckets
    /// the same way).
    pub(crate) fn reduce_buckets_on_device(
        &self,
        slots: &mut [Slot],
        buckets: &[Bucket],
    ) -> Result<PipelineTimes> {
        let mut times = PipelineTimes::default();
        let Some(device_comm) = &self.device_comm else {
            return Err(DdpError::InvalidSetting {
                setting: "GradientSynchronizer's device path",
                reason: "chosen without an NCCL communicator".into(),
            });
        };
        let t = Instant::now();
        let packed: Vec<Tensor<1>> = buckets
            .iter()
            .map(|bucket| pack_on_device(slots, bucket))
            .collect();
        times.fill += t.elapsed();
        let t = Instant::now();
        let reduced = device_comm.all_reduce_many(packed, ReduceOp::Mean, self.compression)?;
        times.all_reduce += t.elapsed();
        let t = Instant::now();
        for (bucket, reduced) in buckets.iter().zip(reduced) {
            let mut off = 0;
            for &i in &bucket.slots {
                let slot = &mut slots[i];
                let n = slot.numel;
                let part = if bucket.slots.len() == 1 {
                    reduced.clone()
                } else {
                    reduced.clone().slice(off..off + n)
                };
                // Back to the gradient's dtype on the device (no-op for f32).
                slot.reduced = Some(part.cast(slot.dtype));
                off += n;
            }
        }
        times.write_back += t.elapsed();
        Ok(times)
    }
}

/// A bucket's gradients (zeros for slots without one here) flattened, in f32, and
/// concatenated on their device.
fn pack_on_device(slots: &mut [Slot], bucket: &Bucket) -> Tensor<1> {
    let mut parts: Vec<Tensor<1>> = bucket
        .slots
        .iter()
        .map(|&i| {
            let slot = &mut slots[i];
            let flat = match slot.grad.take() {
                Some(g) => g,
                None => Tensor::<1>::zeros([slot.numel], &slot.device),
            };
            flat.cast(DType::F32)
        })
        .collect();
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(parts, 0)
    }
}
