//! Unit tests' stand-in for NCCL: [`HostStaged`] makes the device communicator's calls through
//! the host process group, so that the device path's own logic (gradient buckets packed,
//! reduced and sliced as tensors; SyncBatchNorm's device exchange) runs on CPU ranks and can
//! be compared with the host path. Its calls are those of the NCCL communicator, made through
//! the same interface, [`Collectives`], on the host group's buffers instead of device ones.
//! The group sums in rank order, as the host path does, so the two give the same bits.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{Device, Tensor, TensorData};
use ddp_comm::{Collectives, Compression, ReduceOp};

use crate::comm::{self, SharedGroup};
use crate::error::{DdpError, Result};

/// The device communicator's calls, staged through `group`.
#[derive(Debug, Clone)]
pub(crate) struct HostStaged {
    group: SharedGroup,
}

/// A tensor's values as f32 on the host.
fn host_f32(what: &str, t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::TensorData {
            what: what.into(),
            msg: format!("{e:?}"),
        })
}

impl HostStaged {
    /// The stand-in over `group`.
    pub(crate) fn new(group: SharedGroup) -> Self {
        HostStaged { group }
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        comm::lock(&self.group).world_size()
    }

    /// Every device is the stand-in's.
    pub(crate) fn holds(&self, _device: &Device) -> bool {
        true
    }

    /// Each tensor read to the host, all-reduced by the group (with `compression` on the
    /// wire), and made a tensor again on its device.
    pub(crate) fn all_reduce_many(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Vec<Tensor<1>>> {
        tensors
            .into_iter()
            .map(|t| {
                let device = t.device();
                let mut values = host_f32("bucket (host-staged device path)", t)?;
                let n = values.len();
                Collectives::all_reduce(
                    &mut *comm::lock(&self.group),
                    &mut values,
                    op,
                    compression,
                )?;
                Ok(Tensor::from_data(TensorData::new(values, [n]), &device))
            })
            .collect()
    }

    /// `packed` read to the host, reduce-scattered by the group (with `compression` on the
    /// wire), and made a tensor again on its device.
    pub(crate) fn reduce_scatter(
        &self,
        packed: Tensor<1>,
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<1>> {
        let device = packed.device();
        let mut values = host_f32("bucket (host-staged reduce-scatter)", packed)?;
        let n = values.len();
        Collectives::reduce_scatter(
            &mut *comm::lock(&self.group),
            &mut values,
            counts,
            op,
            compression,
        )?;
        Ok(Tensor::from_data(TensorData::new(values, [n]), &device))
    }

    /// `buf` read to the host, its shards all-gathered by the group, and made a tensor again.
    pub(crate) fn all_gather_into(&self, buf: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        let device = buf.device();
        let mut values = host_f32("parameters (host-staged all-gather)", buf)?;
        let n = values.len();
        Collectives::all_gather_into(&mut *comm::lock(&self.group), &mut values, counts)?;
        Ok(Tensor::from_data(TensorData::new(values, [n]), &device))
    }

    /// Every rank's tensor, gathered by the group in rank order.
    pub(crate) fn all_gather(&self, local: Tensor<1>) -> Result<Tensor<1>> {
        let device = local.device();
        let mine = host_f32("statistics (host-staged device path)", local)?;
        let mut g = comm::lock(&self.group);
        let (rank, world, n) = (g.rank(), g.world_size(), mine.len());
        let mut all = vec![0f32; n * world];
        all[rank * n..(rank + 1) * n].copy_from_slice(&mine);
        Collectives::all_gather_into(&mut *g, &mut all, &vec![n; world])?;
        let n = all.len();
        Ok(Tensor::from_data(TensorData::new(all, [n]), &device))
    }

    /// The sum over all ranks of a backend tensor, read to the host in f32 (as NCCL sums it)
    /// and uploaded in its dtype.
    pub(crate) fn all_reduce_sum<B: Backend>(
        &self,
        local: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        let err = |msg: String| DdpError::TensorData {
            what: "sums (host-staged device path)".into(),
            msg,
        };
        let shape = local.shape();
        let dtype = local.dtype();
        let device = local.device();
        let data = burn::tensor::try_read_sync(B::float_into_data(local))
            .ok_or_else(|| err("no synchronous read".into()))?
            .map_err(|e| err(format!("{e:?}")))?;
        let mut values = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| err(format!("{e:?}")))?;
        Collectives::all_reduce(
            &mut *comm::lock(&self.group),
            &mut values,
            ReduceOp::Sum,
            Compression::None,
        )?;
        let data = TensorData::new(values, shape).convert_dtype(dtype);
        Ok(B::float_from_data(data, &device))
    }
}
