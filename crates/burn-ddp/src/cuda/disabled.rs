//! The CUDA glue in a build without the `cuda` feature: every rank computes on the device it is
//! given or on the CPU, and there is no NCCL communicator.

use burn::tensor::Device;

use super::NcclSetting;
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

/// NCCL in a build without it: none; an error when it was required.
///
/// # Errors
/// NCCL was required ([`super::NcclPolicy::Required`]).
pub(crate) fn refuse_required_nccl(setting: NcclSetting) -> Result<()> {
    if setting.policy()? == super::NcclPolicy::Required {
        return Err(DdpError::NcclUnavailable(WITHOUT_CUDA.into()));
    }
    Ok(())
}
