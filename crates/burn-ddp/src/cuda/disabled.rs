//! The CUDA glue in a build without the `cuda` feature: every rank computes on the device it is
//! given or on the CPU, and there is no device communicator ([`DeviceComm`] has no values).

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{Device, Tensor};
use ddp_comm::{Compression, GroupOptions, LaunchEnv, ReduceOp};

use super::NcclSetting;
use crate::comm::SharedGroup;
use crate::error::{DdpError, Result};

/// Whether this build has the CUDA path.
pub(crate) const ENABLED: bool = false;

/// Where a rank runs its model.
#[derive(Debug, Clone, Default)]
pub(crate) enum DeviceChoice {
    /// The CPU (Flex): this build has no CUDA.
    #[default]
    Auto,
    /// CUDA, which this build cannot give ([`crate::DdpBuilder::cuda`]).
    Cuda,
    /// A device chosen by the caller.
    Fixed(Device),
}

impl DeviceChoice {
    /// The device of the rank with this local rank.
    ///
    /// # Errors
    /// CUDA was asked for.
    pub(crate) fn resolve(self, _local_rank: usize, _local_world_size: usize) -> Result<Device> {
        match self {
            DeviceChoice::Auto => Ok(Device::flex()),
            DeviceChoice::Cuda => Err(DdpError::InvalidSetting(format!(
                "CUDA was asked for (DdpBuilder::cuda), but {WITHOUT_CUDA}"
            ))),
            DeviceChoice::Fixed(d) => Ok(d),
        }
    }
}

/// Why this build cannot use CUDA.
const WITHOUT_CUDA: &str = "this program was built without burn-ddp's `cuda` feature";

/// A device communicator: none exists in this build.
#[derive(Debug, Clone)]
pub(crate) enum DeviceComm {}

impl DeviceComm {
    /// The process-wide communicator: none.
    pub(crate) fn installed() -> Option<DeviceComm> {
        None
    }

    /// Creates this rank's communicator: none in this build.
    ///
    /// # Errors
    /// NCCL was required ([`super::NcclPolicy::Required`]).
    pub(crate) fn connect(
        _env: &LaunchEnv,
        _group: &SharedGroup,
        _options: &GroupOptions,
        _device: &Device,
        setting: NcclSetting,
    ) -> Result<Option<DeviceComm>> {
        if setting.policy()? == super::NcclPolicy::Required {
            return Err(DdpError::NcclUnavailable(WITHOUT_CUDA.into()));
        }
        Ok(None)
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        match *self {}
    }

    /// Whether `device` is the communicator's device.
    pub(crate) fn holds(&self, _device: &Device) -> bool {
        match *self {}
    }

    /// The element-wise reduction of every tensor over all ranks.
    pub(crate) fn all_reduce_many(
        &self,
        _tensors: Vec<Tensor<1>>,
        _op: ReduceOp,
        _compression: Compression,
    ) -> Result<Vec<Tensor<1>>> {
        match *self {}
    }

    /// Every rank's tensor, concatenated in rank order.
    pub(crate) fn all_gather(&self, _local: Tensor<1>) -> Result<Tensor<1>> {
        match *self {}
    }

    /// The sum of a backend tensor over all ranks.
    pub(crate) fn all_reduce_sum<B: Backend>(
        &self,
        _local: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        match *self {}
    }
}
