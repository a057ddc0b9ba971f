//! The CUDA glue in a build without the `cuda` feature: every rank computes on the device it is
//! given or on the CPU, and there is no NCCL communicator.

use burn::tensor::Device;

use super::NcclSetting;
use crate::error::{DdpError, Result};

/// Whether this build has the CUDA path.
pub(crate) const ENABLED: bool = false;

/// The automatic choice: the CPU (Flex), this build has no CUDA.
pub(super) fn auto_device(_local_rank: usize, _local_world_size: usize) -> Result<Device> {
    Ok(Device::flex())
}

/// CUDA, which this build cannot give ([`crate::DdpBuilder::cuda`]).
///
/// # Errors
/// Always.
pub(super) fn cuda_device(_local_rank: usize, _local_world_size: usize) -> Result<Device> {
    Err(DdpError::InvalidSetting {
        setting: "DdpBuilder::cuda",
        reason: format!("CUDA was asked for, but {WITHOUT_CUDA}"),
    })
}

/// A device chosen by the caller: any device this build can make is usable.
pub(super) fn check_device(_device: &Device) -> Result<()> {
    Ok(())
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

/// A replacement in a job whose ranks use NCCL: impossible without the `cuda` feature.
///
/// # Errors
/// Always.
pub(crate) fn refuse_nccl_rejoin() -> Result<()> {
    Err(DdpError::NcclUnavailable(format!(
        "the running job's ranks use NCCL, but this replacement cannot: {WITHOUT_CUDA}"
    )))
}
