//! How SyncBatchNorm's per-channel values travel between ranks.
//!
//! - [`Exchange::Local`]: world size 1 (or no process group): no collective and no readback;
//!   the statistics stay on the device.
//! - [`Exchange::Host`]: the process group's host collectives (TCP / shared memory). The
//!   `[4, C]` statistics and the `[2, C]` backward sums are read to the host, exchanged in f64
//!   and uploaded again — also how other GPU backends (wgpu) take part.
//! - `Exchange::Nccl` (feature `cuda`): when [`crate::Ddp`] installed an NCCL communicator, the
//!   same values are all-gathered / all-reduced by NCCL in CUDA device memory, with no host
//!   round trip (see [`crate::nccl`]).
//!
//! Every rank picks the same variant: the group and the communicator are process-wide and set
//! up collectively by [`crate::Ddp`], so the collectives of a layer always match across ranks.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{Tensor, TensorData};
use ddp_comm::ReduceOp;

use super::error::SyncBatchNormError;
use super::transfer::{read_host, upload};
use crate::comm::{self, SharedGroup};
use crate::cuda::DeviceComm;

/// The transport of one SyncBatchNorm call; see the [module docs](self).
pub(crate) enum Exchange {
    /// No other rank.
    Local,
    /// Host-staged through the process group.
    Host(SharedGroup),
    /// NCCL on CUDA device memory (never in builds without `cuda`).
    Nccl(DeviceComm),
}

/// What [`Exchange::all_gather`] returns.
pub(crate) struct Gathered {
    /// `[W, R, C]`: every rank's `[R, C]` contribution, in rank order, on the caller's device.
    pub stats: Tensor<3>,
    /// The total sample count over all ranks where the host knows it without reading the
    /// device (`None` on the NCCL path, which never reads the statistics back).
    pub total_count: Option<f64>,
}

impl Exchange {
    /// The transport's name, for the timeline.
    fn name(&self) -> &'static str {
        match self {
            Exchange::Local => "local",
            Exchange::Host(_) => "host",
            Exchange::Nccl(_) => "nccl",
        }
    }

    /// The transport every rank of this process group uses.
    pub(crate) fn current() -> Exchange {
        // An NCCL communicator first: in a world of one it exists only when it was asked for
        // (`NcclPolicy::Required`), and then the statistics take the NCCL path as with N ranks.
        if let Some(device_comm) = DeviceComm::installed() {
            return Exchange::Nccl(device_comm);
        }
        let Some(group) = comm::group() else {
            return Exchange::Local;
        };
        if comm::lock(&group).world_size() == 1 {
            return Exchange::Local;
        }
        Exchange::Host(group)
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        match self {
            Exchange::Local => 1,
            Exchange::Host(group) => comm::lock(group).world_size(),
            Exchange::Nccl(device_comm) => device_comm.world_size(),
        }
    }

    /// All-gathers every rank's `[R, C]` tensor into `[W, R, C]` on `local`'s device. Row
    /// `count_row` holds the rank's sample count `count` (the same in every channel).
    pub(crate) fn all_gather(
        &self,
        local: Tensor<2>,
        count_row: usize,
        count: usize,
    ) -> Result<Gathered, SyncBatchNormError> {
        let _span =
            ddp_comm::trace::span("syncbn_stats_exchange", "syncbn").arg("path", self.name());
        let [rows, channels] = local.dims();
        match self {
            Exchange::Local => Ok(Gathered {
                stats: local.reshape([1, rows, channels]),
                total_count: Some(count as f64),
            }),
            Exchange::Host(group) => {
                let device = local.device();
                let dtype = local.dtype();
                let mine = local
                    .into_data()
                    .convert::<f64>()
                    .try_into_vec::<f64>()
                    .map_err(|e| SyncBatchNormError::Device(format!("{e:?}")))?;
                let mut pg = comm::lock(group);
                let world = pg.world_size();
                let mut all = vec![0.0f64; mine.len() * world];
                ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new(
                    "SyncBatchNorm forward statistics",
                ));
                pg.all_gather(&mine, &mut all)?;
                drop(pg);
                let total = all
                    .chunks_exact(rows * channels)
                    .map(|rank| rank[count_row * channels])
                    .sum();
                let data = TensorData::new(all, [world, rows, channels]).convert_dtype(dtype);
                Ok(Gathered {
                    stats: Tensor::from_data(data, &device),
                    total_count: Some(total),
                })
            }
            Exchange::Nccl(device_comm) => {
                let world = device_comm.world_size();
                let flat = local
                    .cast(burn::tensor::DType::F32)
                    .reshape([rows * channels]);
                let all = device_comm
                    .all_gather(flat)
                    .map_err(|e| SyncBatchNormError::Device(e.to_string()))?;
                Ok(Gathered {
                    stats: all.reshape([world, rows, channels]),
                    total_count: None,
                })
            }
        }
    }

    /// Sums a backend tensor over all ranks (inside the autodiff backward pass).
    pub(crate) fn all_reduce_sum<B: Backend>(
        &self,
        local: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, SyncBatchNormError> {
        let _span =
            ddp_comm::trace::span("syncbn_grad_exchange", "syncbn").arg("path", self.name());
        match self {
            Exchange::Local => Ok(local),
            Exchange::Host(group) => {
                let (device, dtype, shape) = (local.device(), local.dtype(), local.shape());
                let mut buf = read_host::<B>(local)?;
                let mut pg = comm::lock(group);
                ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new(
                    "SyncBatchNorm backward sums",
                ));
                pg.all_reduce(&mut buf, ReduceOp::Sum)?;
                drop(pg);
                Ok(upload::<B>(&buf, &shape, dtype, &device))
            }
            Exchange::Nccl(device_comm) => device_comm
                .all_reduce_sum::<B>(local)
                .map_err(|e| SyncBatchNormError::Device(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn a_world_of_one_exchanges_nothing() {
        // The lib tests install no group or a group of one (`ProcessGroup::single`).
        let exchange = Exchange::current();
        assert!(matches!(exchange, Exchange::Local));
        assert_eq!(exchange.world_size(), 1);
        let local = Tensor::<2>::ones([4, 3], &Device::flex());
        let gathered = exchange.all_gather(local, 3, 7).expect("local");
        assert_eq!(gathered.stats.dims(), [1, 4, 3]);
        assert_eq!(gathered.total_count, Some(7.0));
    }

    /// The device exchange (the NCCL arm: statistics gathered and sums reduced as device
    /// tensors) on two CPU ranks through the host-staged stand-in for NCCL, against the host
    /// exchange: the same values (exact in f32 here) in the same layout.
    #[test]
    fn the_device_exchange_equals_the_host_exchange_on_two_ranks() {
        use burn::backend::Flex;
        crate::test_ranks::run_ranks(2, |group, rank| {
            let values = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            let device = Device::flex();
            let r = rank as f32;
            let local =
                Tensor::<2>::from_floats([[1.0 + r, 2.0, 3.0], [4.0, 5.0 * r, 6.0]], &device);
            let host = Exchange::Host(group.clone());
            let dev = Exchange::Nccl(DeviceComm::host_staged(group.clone()));
            assert_eq!(dev.world_size(), 2);
            let h = host.all_gather(local.clone(), 1, 3).unwrap();
            let d = dev.all_gather(local.clone(), 1, 3).unwrap();
            assert_eq!(d.stats.dims(), [2, 2, 3]);
            assert_eq!(values(h.stats), values(d.stats), "rank {rank}: gathered");
            let sum = |e: &Exchange| {
                let primitive = local.clone().try_into_primitive::<Flex>().unwrap();
                let out = e.all_reduce_sum::<Flex>(primitive).unwrap();
                Tensor::<2>::from_primitive::<Flex>(out)
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap()
            };
            assert_eq!(sum(&host), sum(&dev), "rank {rank}: summed");
            assert_eq!(sum(&dev), vec![3.0, 4.0, 6.0, 8.0, 5.0, 12.0]);
        });
    }

    /// The NCCL transport in a world of one: real NCCL calls on Burn CUDA tensors, which must
    /// hand back exactly what they got.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs an NVIDIA GPU with libcuda and libnccl, and Burn's CUDA backend built \
                (cubecl-llvm downloads LLVM at build time)"]
    fn nccl_transport_in_a_world_of_one_hands_back_its_input() {
        use burn::backend::Cube;
        use ddp_nccl::{NcclGroup, NcclOptions};
        use std::sync::{Arc, Mutex};
        let device = Device::cuda(0);
        let nccl = NcclGroup::single(&NcclOptions {
            device: Some(0),
            ..NcclOptions::default()
        })
        .expect("an NCCL communicator of one on GPU 0");
        let exchange = Exchange::Nccl(DeviceComm::nccl(Arc::new(Mutex::new(nccl))));
        let local = Tensor::<2>::from_floats([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], &device);
        let values = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().expect("f32");
        let want = values(local.clone());

        let gathered = exchange
            .all_gather(local.clone(), 1, 3)
            .expect("all-gather");
        assert_eq!(gathered.total_count, None);
        assert_eq!(gathered.stats.dims(), [1, 2, 3]);
        assert_eq!(values(gathered.stats.reshape([2, 3])), want);

        let primitive = local.try_into_primitive::<Cube>().expect("a Cube tensor");
        let summed = exchange
            .all_reduce_sum::<Cube>(primitive)
            .expect("all-reduce");
        assert_eq!(values(Tensor::<2>::from_primitive::<Cube>(summed)), want);
    }
}
